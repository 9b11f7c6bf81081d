"""Distil SmolLM2-135M-Instruct into a small reduced-vocabulary draft for speculative decoding.

The draft keeps the target's width (576) so that it can start from the target's own weights: a few of the
target's decoder layers, its final norm, and its (tied) embedding restricted to the draft vocabulary, the
``--vocab-size - 1`` most frequent target ids in the training data plus one "unknown" input id. It is then
trained to match the target's next-token distribution (soft cross-entropy against the target's top-20
logprobs, renormalised over ids the draft can say) on the target's own greedy continuations and on Python
standard-library code (see make_data.py).

Usage:
  python train/distill.py probe  [--layers ...]           # untrained top-1 agreement of layer choices
  python train/distill.py train  --layers 0,1,2,29 --vocab-size 8192 --max-steps N --out DIR
  python train/distill.py export --ckpt DIR/draft.pt --dest models/smollm2-draft
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from make_data import continuation_files, sampled_files, selfchat_files


logger = logging.getLogger("distill")
DATA = Path(__file__).resolve().parent / "data"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
MAX_LEN = 256


def target_path() -> str:
    from ssd.models.fetch import fetch_default_target

    return str(fetch_default_target())


# ------------------------------------------------------------------------------------------------ vocabulary
def special_ids(path: str) -> list[int]:
    """Ids of the tokenizer's added/special tokens: the draft must be able to propose (e.g.) <|im_end|>."""
    data = json.loads((Path(path) / "tokenizer.json").read_text(encoding="utf-8"))
    return sorted(int(t["id"]) for t in data.get("added_tokens", []))


def build_vocab(counts: torch.Tensor, size: int, always: list[int]) -> tuple[np.ndarray, int]:
    """draft_to_target (sorted target ids, then -1 for the unknown id) and the unknown id."""
    keep = set(always)
    # Unseen ids rank by id: the tokenizer's BPE merges are numbered roughly by corpus frequency.
    score = counts.double() + 1e-3 * (1.0 - torch.arange(counts.numel(), dtype=torch.float64) / counts.numel())
    for tid in torch.argsort(score, descending=True, stable=True).tolist():
        if len(keep) >= size - 1:
            break
        keep.add(int(tid))
    d2t = np.array(sorted(keep) + [-1], dtype=np.int64)
    return d2t, len(d2t) - 1


# ------------------------------------------------------------------------------------------------ data
@dataclass
class Example:
    ids: list[int]  # target ids, the model input
    start: int  # first position whose prediction is trained
    top_ids: torch.Tensor  # [T', K] teacher top-k target ids for positions start..start+T'-1
    top_lp: torch.Tensor  # [T', K]


def load_examples(data: Path) -> tuple[list[Example], list[Example], list[Example]]:
    """(train gen, validation, train chunks). Validation: the greedy continuations of every 8th prompt, the
    answers to every 8th self-written request, and every 16th stdlib and docs chunk; sampled continuations of
    held-out prompts are not used at all."""
    gen_train, gen_val, lib = [], [], []
    greedy = [(start + j, r) for f, start in continuation_files(data) for j, r in enumerate(torch.load(f))]
    greedy += [(j, r) for f in selfchat_files(data) for j, r in enumerate(torch.load(f))]
    sampled = [(start + j, r) for f, start in sampled_files(data) for j, r in enumerate(torch.load(f))]
    for kind, records in (("greedy", greedy), ("sampled", sampled)):
        for prompt_index, r in records:
            n = min(len(r["output"]), MAX_LEN)
            if n < 2:
                continue
            start = len(r["prompt"]) - 1  # position start + j predicts output[j]
            ex = Example(r["prompt"] + r["output"][: n - 1], start, r["top_ids"][:n], r["top_lp"][:n])
            if prompt_index % 8 != 0:
                gen_train.append(ex)
            elif kind == "greedy":
                gen_val.append(ex)
    for f in (data / "stdlib.pt", data / "docs.pt"):
        if f.exists():
            for i, r in enumerate(torch.load(f)):
                t = len(r["ids"])
                ex = Example(r["ids"], 0, r["top_ids"][: t - 1], r["top_lp"][: t - 1])
                (gen_val if i % 16 == 0 else lib).append(ex)
    return gen_train, gen_val, lib


def data_stamp(data: Path) -> tuple:
    files = [f for f, _ in continuation_files(data) + sampled_files(data)] + selfchat_files(data)
    return tuple((f.name, f.stat().st_mtime) for f in files)


def collate(batch: list[Example], t2d: torch.Tensor, unknown: int):
    """Right-padded inputs (causal attention needs no mask for trailing padding) and loss targets."""
    width = max(len(e.ids) for e in batch)
    x = torch.full((len(batch), width), unknown, dtype=torch.long)  # [B, T]
    k = batch[0].top_ids.shape[1]
    tid = torch.zeros(len(batch), width, k, dtype=torch.long)  # [B, T, K] draft ids
    tlp = torch.full((len(batch), width, k), -math.inf)  # [B, T, K]
    for b, e in enumerate(batch):
        x[b, : len(e.ids)] = t2d[torch.tensor(e.ids)]
        n = e.top_ids.shape[0]
        d = t2d[e.top_ids.long()]  # [n, K]
        lp = e.top_lp.float().masked_fill(d == unknown, -math.inf)
        tid[b, e.start : e.start + n] = d
        tlp[b, e.start : e.start + n] = lp
    return x, tid, tlp


def length_bucketed_batches(pool: list[Example], batch: int, rng: random.Random) -> list[list[Example]]:
    """One epoch of batches, each of similar-length examples, in random order.

    Batches are right-padded to their longest member; mixing 256-token stdlib chunks with ~130-token chat
    continuations would roughly double the cost of most steps.
    """
    order = pool[:]
    rng.shuffle(order)
    window = batch * 32
    batches = []
    for s in range(0, len(order), window):
        part = sorted(order[s : s + window], key=lambda e: len(e.ids))
        batches += [part[i : i + batch] for i in range(0, len(part), batch)]
    rng.shuffle(batches)
    return batches


def soft_ce(logits: torch.Tensor, tid: torch.Tensor, tlp: torch.Tensor, unknown: int):
    """Mean soft cross-entropy over positions with a teacher, and the draft's top-1 agreement there."""
    logits = logits.float()
    logits[..., unknown] = -math.inf  # the draft never proposes the unknown id
    valid = torch.isfinite(tlp).any(-1)  # [B, T]
    lq = torch.log_softmax(logits[valid], dim=-1)  # [N, Vd]
    p = torch.softmax(tlp[valid], dim=-1)  # [N, K] teacher, renormalised over ids the draft can say
    picked = lq.gather(1, tid[valid])  # [N, K]; -inf where the teacher id is outside the draft vocabulary
    loss = -torch.where(p > 0, p * picked, torch.zeros_like(picked)).sum(-1).mean()
    agree = (lq.argmax(-1) == tid[valid][:, 0]) & torch.isfinite(tlp[valid][:, 0])
    return loss, agree.float().sum(), valid.sum()


# ------------------------------------------------------------------------------------------------ model
def build_draft(path: str, layers: list[int], d2t: np.ndarray, unknown: int):
    """A LlamaForCausalLM with the target's width, initialised from the chosen target layers."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    target = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    cfg = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
    cfg.update(num_hidden_layers=len(layers), vocab_size=len(d2t), torch_dtype="bfloat16")
    config = LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})
    draft = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tsd = target.state_dict()
    emb = tsd["model.embed_tokens.weight"]  # [V, H]
    known = torch.from_numpy(d2t[d2t >= 0])
    outside = torch.ones(emb.shape[0], dtype=torch.bool)
    outside[known] = False
    new_emb = torch.empty(len(d2t), emb.shape[1])
    new_emb[torch.from_numpy(np.nonzero(d2t >= 0)[0])] = emb[known]
    new_emb[unknown] = emb[outside].mean(0)  # the input stand-in for every token the draft does not know
    sd = {"model.embed_tokens.weight": new_emb, "model.norm.weight": tsd["model.norm.weight"]}
    for i, src in enumerate(layers):
        for k, v in tsd.items():
            if k.startswith(f"model.layers.{src}."):
                sd[k.replace(f"model.layers.{src}.", f"model.layers.{i}.")] = v
    missing, unexpected = draft.load_state_dict(sd, strict=False)
    missing = [m for m in missing if m != "lm_head.weight"]
    if missing or unexpected:
        raise RuntimeError(f"draft init: missing {missing}, unexpected {unexpected}")
    draft.lm_head.weight = draft.model.embed_tokens.weight  # tied, as in the target (set explicitly)
    return draft, config


def evaluate(model, examples: list[Example], t2d, unknown: int, bs: int = 8) -> tuple[float, float]:
    model.eval()
    tot_loss = tot_agree = tot_n = 0.0
    with torch.inference_mode():
        for s in range(0, len(examples), bs):
            x, tid, tlp = collate(examples[s : s + bs], t2d, unknown)
            loss, agree, n = soft_ce(model(input_ids=x).logits, tid, tlp, unknown)
            tot_loss += float(loss) * float(n)
            tot_agree += float(agree)
            tot_n += float(n)
    model.train()
    return tot_loss / tot_n, tot_agree / tot_n


@dataclass
class Init:
    """Weights and vocabulary to continue training from."""
    state: dict[str, torch.Tensor]
    d2t: np.ndarray  # draft id -> target id, -1 for the unknown id (the last)
    unknown: int
    layers: list[int] | None  # the target layers it was built from, when recorded


def load_init(path: str) -> Init:
    """A ``draft.pt`` written by ``train`` or a folder written by ``export`` (fp32 copy of its bf16 weights;
    the folder does not record which target layers it came from)."""
    p = Path(path)
    if p.is_dir():
        from safetensors.torch import load_file

        from ssd.models.draft_vocab import DraftVocab

        vocab = DraftVocab.load(p)
        if vocab is None:
            raise ValueError(f"{p} has no draft vocabulary file")
        state = {k: v.float() for k, v in load_file(str(p / "model.safetensors")).items()}
        return Init(state, vocab.draft_to_target, vocab.unknown_id, None)
    ck = torch.load(p, weights_only=False)
    return Init(ck["state"], ck["d2t"], len(ck["d2t"]) - 1, list(ck["layers"]))


def expected_accept_len(a: float, k: int = 4) -> float:
    """1 + a + ... + a^k: mean acceptance length if every draft token matched with probability a."""
    return sum(a**i for i in range(k + 1))


# ------------------------------------------------------------------------------------------------ commands
def prepare(args, init: Init | None = None):
    """(target path, d2t, unknown id, target->draft table): the vocabulary of `init` when continuing, else
    the `--vocab-size` most frequent ids of the data's counts."""
    path = target_path()
    if init is not None:
        d2t, unknown = init.d2t, init.unknown
    else:
        counts = torch.load(Path(args.data) / "vocab_counts.pt")
        d2t, unknown = build_vocab(counts, args.vocab_size, special_ids(path))
    t2d = torch.full((49152,), unknown, dtype=torch.long)
    t2d[torch.from_numpy(d2t[:unknown])] = torch.arange(unknown)
    return path, d2t, unknown, t2d


def cmd_probe(args) -> None:
    path, d2t, unknown, t2d = prepare(args)
    _, val, _ = load_examples(Path(args.data))
    for spec in args.probe_layers.split(";"):
        layers = [int(v) for v in spec.split(",")]
        model, _ = build_draft(path, layers, d2t, unknown)
        loss, agree = evaluate(model, val, t2d, unknown)
        logger.info("layers %s: val loss %.3f top-1 agreement %.3f", layers, loss, agree)


def cmd_train(args) -> None:
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    layers = [int(v) for v in args.layers.split(",")]
    init = load_init(args.init) if args.init else None
    path, d2t, unknown, t2d = prepare(args, init)  # continuing keeps the earlier phase's vocabulary
    gen, val, lib = load_examples(Path(args.data))
    cover = sum(int((t2d[e.top_ids[:, 0].long()] != unknown).sum()) for e in val) / sum(e.top_ids.shape[0] for e in val)
    logger.info("vocab %d: covers %.4f of the target's greedy tokens on validation", len(d2t), cover)
    logger.info("%d gen train, %d gen val, %d stdlib examples", len(gen), len(val), len(lib))
    model, config = build_draft(path, layers, d2t, unknown)
    if init is not None:
        # Continue from an earlier phase or an exported draft (same layers and vocabulary).
        if init.layers is not None and init.layers != layers:
            raise ValueError(f"{args.init} was trained with layers {init.layers}, not {layers}")
        missing, unexpected = model.load_state_dict(init.state, strict=False)
        if [m for m in missing if m != "lm_head.weight"] or unexpected:
            raise ValueError(f"{args.init} does not fit layers {layers}: missing {missing}, unexpected {unexpected}")
        model.lm_head.weight = model.model.embed_tokens.weight
    model.train()
    if args.freeze_embeddings:
        # The tied embedding/head stays the target's: fewer weight gradients per step, less overfitting.
        model.get_input_embeddings().weight.requires_grad_(False)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # Weight decay on matrices only (not norms): a regulariser against overfitting the continuations.
    params = [q for q in model.parameters() if q.requires_grad]
    groups = [{"params": [q for q in params if q.dim() >= 2], "weight_decay": args.weight_decay},
              {"params": [q for q in params if q.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.98))
    pool = gen * args.gen_weight + lib
    seen_stamp = data_stamp(Path(args.data))
    rng = random.Random(args.seed)
    loss0, agree0 = evaluate(model, val, t2d, unknown)
    logger.info("step 0: val loss %.3f agree %.3f (est. accept len %.2f)", loss0, agree0, expected_accept_len(agree0))
    t0 = time.time()
    order: list[list[Example]] = []
    for step in range(1, args.max_steps + 1):
        # Cosine over training progress: the step count, or the elapsed share of the time budget if that is
        # further along (the shared machine's speed varies several-fold), so a time-boxed run still anneals.
        progress = min(1.0, max(step / args.max_steps, (time.time() - t0) / args.time_budget_s))
        lr = args.lr * min(1.0, step / args.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))
        for g in opt.param_groups:
            g["lr"] = lr
        if not order:
            stamp = data_stamp(Path(args.data))
            if stamp != seen_stamp:  # make_data.py may still be adding generated examples: pick them up
                gen, val, lib = load_examples(Path(args.data))
                pool, seen_stamp = gen * args.gen_weight + lib, stamp
                logger.info("data: %d gen train, %d val, %d stdlib examples", len(gen), len(val), len(lib))
            order = length_bucketed_batches(pool, args.batch, rng)
        batch = order.pop()
        x, tid, tlp = collate(batch, t2d, unknown)
        loss, agree, n = soft_ce(model(input_ids=x).logits, tid, tlp, unknown)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % args.log_every == 0:
            logger.info("step %d/%d lr %.2e loss %.3f agree %.3f  %.0f s  load %.1f", step, args.max_steps, lr,
                        float(loss.detach()), float(agree) / float(n), time.time() - t0, os.getloadavg()[0])
        if step % args.eval_every == 0 or step == args.max_steps:
            vl, va = evaluate(model, val, t2d, unknown)
            logger.info("step %d: val loss %.3f agree %.3f (est. accept len %.2f)", step, vl, va, expected_accept_len(va))
            torch.save({"state": model.state_dict(), "config": config.to_dict(), "d2t": d2t, "unknown": unknown,
                        "layers": layers, "step": step, "val_agree": va, "train_s": time.time() - t0}, out / "draft.pt")
        if time.time() - t0 > args.time_budget_s:
            logger.info("time budget reached at step %d", step)
            vl, va = evaluate(model, val, t2d, unknown)
            logger.info("final: val loss %.3f agree %.3f", vl, va)
            torch.save({"state": model.state_dict(), "config": config.to_dict(), "d2t": d2t, "unknown": unknown,
                        "layers": layers, "step": step, "val_agree": va, "train_s": time.time() - t0}, out / "draft.pt")
            break


def cmd_export(args) -> None:
    """Write a checkpoint folder the engine loads: config, bf16 safetensors, draft_vocab.json, tokenizer."""
    from safetensors.torch import save_file

    from ssd.models.draft_vocab import DraftVocab

    path = target_path()
    ck = torch.load(args.ckpt, weights_only=False)
    dest = Path(args.dest)
    dest.mkdir(parents=True, exist_ok=True)
    state = {k: v.to(torch.bfloat16).contiguous() for k, v in ck["state"].items() if k != "lm_head.weight"}
    save_file(state, str(dest / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((Path(path) / "config.json").read_text(encoding="utf-8"))
    cfg.update(num_hidden_layers=len(ck["layers"]), vocab_size=int(len(ck["d2t"])), torch_dtype="bfloat16")
    (dest / "config.json").write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")
    DraftVocab(49152, ck["d2t"], int(ck["unknown"])).save(dest)
    for name in TOKENIZER_FILES:
        if (Path(path) / name).exists():
            shutil.copy(Path(path) / name, dest / name)
    logger.info("exported step %d (layers %s, vocab %d) to %s", ck["step"], ck["layers"], len(ck["d2t"]), dest)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("command", choices=["probe", "train", "export"])
    ap.add_argument("--layers", default="0,1,2,29")
    ap.add_argument("--probe-layers", default="0,1,2,3;0,1,28,29;0,1,2,29;0,10,20,29")
    ap.add_argument("--vocab-size", type=int, default=8192)
    ap.add_argument("--max-steps", type=int, default=1000)
    ap.add_argument("--time-budget-s", type=float, default=2400.0)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay on weight matrices")
    ap.add_argument("--freeze-embeddings", action="store_true")
    ap.add_argument("--init", default="", help="a draft.pt or an exported draft folder to continue from")
    ap.add_argument("--gen-weight", type=int, default=2, help="times each generated example appears per epoch")
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--eval-every", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data", default=str(DATA), help="folder written by make_data.py")
    ap.add_argument("--out", default=str(DATA / "run"))
    ap.add_argument("--ckpt", default=str(DATA / "run" / "draft.pt"))
    ap.add_argument("--dest", default=str(Path(__file__).resolve().parent.parent / "models" / "smollm2-draft"))
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads; 1 is several times faster than 2 on the shared, loaded 2-core machine")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(args.threads)
    {"probe": cmd_probe, "train": cmd_train, "export": cmd_export}[args.command](args)


if __name__ == "__main__":
    main()
