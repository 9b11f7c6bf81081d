"""Build the draft's distillation data from offline sources only.

Stages (run in order; each writes one file under --out, default train/data/):

* ``gen``    — the target's own greedy continuations of the training prompts (train/prompts.py plus the
               generated ones of train/prompt_gen.py), produced by our
               engine in bf16 (exactly what the draft must predict at serving time), with the target's
               top-20 logprobs at every generated position as soft labels.
* ``stdlib`` — chunks of the Python standard library sources on this machine, with the target's top-20
               logprobs at every position from one fp32 forward pass (teaches the draft code in general).
* ``docs``   — chunks of the Python documentation's reStructuredText sources (Debian's python3.11-doc),
               labelled the same way (English technical prose beyond the template prompts).
* ``selfchat`` — requests written by the target itself (sampled from the chat template cut right after the
               user turn opens, the way an instruction-tuned model completes a user message) and the
               target's greedy answers to them with top-20 logprobs: varied chat beyond the templates.
* ``vocab``  — token frequencies over all sets; the reduced draft vocabulary is the most frequent ids.

Usage: python train/make_data.py gen|hfgen|stdlib|docs|selfchat|vocab [--out DIR] [options]
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
import sysconfig
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from prompt_gen import all_prompts, generation_order  # noqa: E402

logger = logging.getLogger("make_data")
TOPK = 20


def target_path() -> str:
    from ssd.models.fetch import fetch_default_target

    return str(fetch_default_target())


def continuation_files(data: Path) -> list[tuple[Path, int]]:
    """Greedy continuation files (``gen.pt``, ``hfgen.pt``, ``hfgen_<start>.pt`` parts) with the index of
    their first prompt: record j of a file continues prompt ``start + j`` of ``generation_order``."""
    names = [(data / "gen.pt", 0), (data / "hfgen.pt", 0)]
    names += [(f, int(f.stem.rsplit("_", 1)[1])) for f in sorted(data.glob("hfgen_*.pt"))]
    return [(f, start) for f, start in names if f.exists()]


def selfchat_files(data: Path) -> list[Path]:
    """Answers to the target's self-written requests (``selfchat.pt``); record j answers request j."""
    return [f for f in (data / "selfchat.pt",) if f.exists()]


def sampled_files(data: Path) -> list[tuple[Path, int]]:
    """Sampled continuation files (``hfsample_t<100 T>_<start>.pt``) with the index of their first prompt."""
    return [(f, int(f.stem.rsplit("_", 1)[1])) for f in sorted(data.glob("hfsample_t*_*.pt"))]


def labelled_record(o) -> dict:
    """A continuation record from one of our engine's outputs requested with ``logprobs=TOPK``."""
    top_ids = torch.zeros(len(o.token_ids), TOPK, dtype=torch.int32)  # [T, K]
    top_lp = torch.full((len(o.token_ids), TOPK), -1e4, dtype=torch.float16)  # [T, K]
    for i, lp in enumerate(o.logprobs or []):
        items = sorted((lp.top or {lp.token_id: lp.logprob}).items(), key=lambda kv: -kv[1])[:TOPK]
        for j, (tid, val) in enumerate(items):
            top_ids[i, j] = tid
            top_lp[i, j] = max(val, -1e4)
    return {"prompt": list(o.prompt_token_ids), "output": list(o.token_ids), "top_ids": top_ids, "top_lp": top_lp}


def stage_gen(out: Path, max_tokens: int, batch: int, budget_s: float, seed: int) -> None:
    """Greedy target continuations + top-k logprobs for every training prompt."""
    from ssd import LLM, SamplingParams

    path = target_path()
    llm = LLM(model=path, dtype="bfloat16", kv_cache_memory="1GiB", max_num_seqs=batch)
    tok = llm.tokenizer
    tp = all_prompts(seed)
    prompts: list[list[int]] = generation_order([tok.apply_chat_template([{"role": "user", "content": p}]) for p in tp.chat],
                                                [tok.encode(p) for p in tp.stubs], [tok.encode(p) for p in tp.doc_stubs], seed)
    logger.info("generating for %d prompts, max_tokens=%d, batch=%d", len(prompts), max_tokens, batch)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=TOPK)
    records = []
    t0 = time.time()
    step = 32
    for start in range(0, len(prompts), step):
        outs = llm.generate(prompts[start : start + step], params)
        records += [labelled_record(o) for o in outs]
        ntok = sum(len(r["output"]) for r in records)
        logger.info("%d/%d prompts, %d tokens, %.0f s", len(records), len(prompts), ntok, time.time() - t0)
        torch.save(records, out / "gen.pt")  # after every chunk: a time-boxed run keeps what it has
        if time.time() - t0 > budget_s:
            logger.info("time budget reached")
            break
    llm.shutdown()


def stage_hfgen(out: Path, max_tokens: int, batch: int, budget_s: float, seed: int, start: int,
                temperature: float = 0.0, end: int | None = None) -> None:
    """Like ``gen`` but with transformers' batched generate in fp32 (much faster here than per-sequence
    paged decoding under CPU contention); covers the prompts of ``generation_order`` from index ``start``
    up to ``end`` (exclusive; default all).

    ``temperature > 0`` samples the continuations instead (more contexts per prompt for the draft to learn
    from); the soft labels stay the target's unscaled next-token distribution at every position."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = target_path()
    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    tp = all_prompts(seed)
    chat = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
            for p in tp.chat]
    prompts = generation_order(chat, tp.stubs, tp.doc_stubs, seed)
    prompts = prompts[start:end]
    if temperature > 0:
        dest = out / f"hfsample_t{round(temperature * 100):03d}_{start:05d}.pt"
    else:
        dest = out / ("hfgen.pt" if start == 0 else f"hfgen_{start:05d}.pt")  # parts never overwrite each other
    sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else dict(do_sample=False)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    records = []
    t0 = time.time()
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    for s in range(0, len(prompts), batch):
        enc = tok(prompts[s : s + batch], return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.inference_mode():
            res = model.generate(**enc, max_new_tokens=max_tokens, return_dict_in_generate=True, output_logits=True,
                                 eos_token_id=eos, pad_token_id=eos, **sampling)
        width = enc["input_ids"].shape[1]
        lp = torch.log_softmax(torch.stack(res.logits, dim=1).float(), dim=-1)  # [B, T, V]
        val, idx = lp.topk(TOPK, dim=-1)  # [B, T, K]
        for b in range(len(prompts[s : s + batch])):
            mask = enc["attention_mask"][b].bool()
            prompt = enc["input_ids"][b][mask].tolist()
            gen = res.sequences[b, width:].tolist()
            n = gen.index(eos) + 1 if eos in gen else len(gen)
            records.append({"prompt": prompt, "output": gen[:n], "top_ids": idx[b, :n].to(torch.int32),
                            "top_lp": val[b, :n].to(torch.float16)})
        ntok = sum(len(r["output"]) for r in records)
        logger.info("%d/%d prompts, %d tokens, %.0f s", len(records), len(prompts), ntok, time.time() - t0)
        torch.save(records, dest)
        if time.time() - t0 > budget_s:
            logger.info("time budget reached")
            break


def user_turn_prefix(tok) -> list[int]:
    """The chat template's token ids up to where the user's message begins (system turn included): the
    common prefix of two renderings whose messages differ from their first character on."""
    a = tok.apply_chat_template([{"role": "user", "content": "Alpha"}])
    b = tok.apply_chat_template([{"role": "user", "content": "Omega"}])
    n = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    return list(a[:n])


def select_requests(samples: list[tuple[str, str | None, int]], exclude: list[str]) -> list[str]:
    """The sampled requests worth answering, from (text, finish reason, token count): those the target closed
    itself (finish reason "stop") with at least 4 tokens, each once, none of them an evaluation prompt."""
    seen = {p.strip().lower() for p in exclude}
    kept = []
    for text, finish_reason, num_tokens in samples:
        text = text.strip()
        if finish_reason == "stop" and num_tokens >= 4 and text.lower() not in seen:
            seen.add(text.lower())
            kept.append(text)
    return kept


def stage_selfchat(out: Path, num_requests: int, max_tokens: int, batch: int, budget_s: float, seed: int) -> None:
    """Requests sampled from the target (temperature 1, top-p 0.95, kept only when the target closed its user
    turn within 64 tokens; duplicates and evaluation prompts dropped), then the target's greedy answers with
    top-k logprobs, by our engine at its default precision (what the draft meets when serving)."""
    from eval_prompts import CHAT_EVAL

    from ssd import LLM, SamplingParams

    llm = LLM(model=target_path(), kv_cache_memory="2GiB", max_num_seqs=batch)
    tok = llm.tokenizer
    prefix = user_turn_prefix(tok)
    ask = [SamplingParams(temperature=1.0, top_p=0.95, max_tokens=64, seed=seed + i) for i in range(num_requests)]
    t0 = time.time()
    samples = llm.generate([prefix] * num_requests, ask)
    requests = select_requests([(o.text, o.finish_reason, len(o.token_ids)) for o in samples], CHAT_EVAL)
    logger.info("%d of %d sampled requests kept, %.0f s", len(requests), num_requests, time.time() - t0)
    prompts = [tok.apply_chat_template([{"role": "user", "content": r}]) for r in requests]
    answer = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=TOPK)
    records = []
    for s in range(0, len(prompts), 4 * batch):
        records += [labelled_record(o) for o in llm.generate(prompts[s : s + 4 * batch], answer)]
        ntok = sum(len(r["output"]) for r in records)
        logger.info("%d/%d answers, %d tokens, %.0f s", len(records), len(prompts), ntok, time.time() - t0)
        torch.save(records, out / "selfchat.pt")
        if time.time() - t0 > budget_s:
            logger.info("time budget reached")
            break
    llm.shutdown()


def stdlib_files(seed: int) -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and "test" not in p.parts)
    random.Random(seed).shuffle(files)
    return files


def doc_files(source: Path, seed: int) -> list[Path]:
    """The reStructuredText sources of a Sphinx HTML build (``_sources/**/*.rst.txt``), shuffled."""
    files = sorted(source.rglob("*.txt"))
    if not files:
        raise SystemExit(f"no .txt files under {source}; see train/README.md for getting python3.11-doc")
    random.Random(seed).shuffle(files)
    return files


def stage_stdlib(out: Path, num_chunks: int, chunk_len: int, seed: int, budget_s: float) -> None:
    """Standard-library code chunks with the target's top-k logprobs (fp32 teacher forward)."""
    label_chunks(out / "stdlib.pt", stdlib_files(seed), num_chunks, chunk_len, seed, budget_s)


def stage_docs(out: Path, source: Path, num_chunks: int, chunk_len: int, seed: int, budget_s: float) -> None:
    """Chunks of English technical prose (the Python documentation's sources) with the target's top-k
    logprobs: general language the template prompts do not cover, labelled far faster than generating."""
    label_chunks(out / "docs.pt", doc_files(source, seed), num_chunks, chunk_len, seed, budget_s)


def label_chunks(dest: Path, files: list[Path], num_chunks: int, chunk_len: int, seed: int, budget_s: float) -> None:
    """Up to two random ``chunk_len``-token chunks per file (so the set spans many files), labelled with the
    target's top-k logprobs at every position by an fp32 forward pass; saved to ``dest``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = target_path()
    tok = AutoTokenizer.from_pretrained(path)
    chunks: list[list[int]] = []
    rng = random.Random(seed)
    for f in files:
        if len(chunks) >= num_chunks:
            break
        try:
            text = f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        ids = tok.encode(text)
        if len(ids) < chunk_len:
            continue
        for _ in range(2):
            s = rng.randrange(0, len(ids) - chunk_len + 1)
            chunks.append(ids[s : s + chunk_len])
    chunks = chunks[:num_chunks]
    logger.info("%d chunks of %d tokens for %s", len(chunks), chunk_len, dest.name)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    records = []
    t0 = time.time()
    bs = 8
    with torch.inference_mode():
        for s in range(0, len(chunks), bs):
            x = torch.tensor(chunks[s : s + bs])  # [B, T]
            logits = model(input_ids=x).logits.float()  # [B, T, V]
            lp = torch.log_softmax(logits, dim=-1)
            val, idx = lp.topk(TOPK, dim=-1)  # [B, T, K]
            for b in range(x.shape[0]):
                records.append({"ids": chunks[s + b], "top_ids": idx[b].to(torch.int32), "top_lp": val[b].to(torch.float16)})
            logger.info("%d/%d chunks, %.0f s", len(records), len(chunks), time.time() - t0)
            if time.time() - t0 > budget_s:
                logger.info("time budget reached")
                break
    torch.save(records, dest)


def stage_vocab(out: Path) -> None:
    """Token counts over all training data, teacher top-1 weighted most (it is what the draft must say)."""
    counts = torch.zeros(49152, dtype=torch.float64)
    for f in [*(f for f, _ in continuation_files(out)), *selfchat_files(out), out / "stdlib.pt", out / "docs.pt"]:
        if not f.exists():
            continue
        for r in torch.load(f):
            seq = r.get("output", r.get("ids"))
            counts.index_add_(0, torch.tensor(seq), torch.ones(len(seq), dtype=torch.float64))
            counts.index_add_(0, r["top_ids"][:, 0].long(), torch.full((r["top_ids"].shape[0],), 2.0, dtype=torch.float64))
            counts.index_add_(0, r["top_ids"][:, 1:4].reshape(-1).long(), torch.full((r["top_ids"].shape[0] * 3,), 0.1, dtype=torch.float64))
    torch.save(counts, out / "vocab_counts.pt")
    nz = int((counts > 0).sum())
    logger.info("%d distinct token ids seen", nz)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("stage", choices=["gen", "hfgen", "stdlib", "docs", "selfchat", "vocab"])
    ap.add_argument("--start", type=int, default=0, help="hfgen: first shuffled prompt to cover")
    ap.add_argument("--end", type=int, default=None, help="hfgen: stop before this shuffled prompt (default: all)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="hfgen: sample continuations at this temperature (0: greedy)")
    ap.add_argument("--source", default="/usr/share/doc/python3.11/html/_sources",
                    help="docs: folder of .txt documentation sources (Debian's python3.11-doc)")
    ap.add_argument("--num-requests", type=int, default=2048, help="selfchat: requests to sample from the target")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "data"))
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--num-chunks", type=int, default=400)
    ap.add_argument("--chunk-len", type=int, default=256)
    ap.add_argument("--budget-s", type=float, default=600.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads; 1 is several times faster than 2 on the shared, loaded 2-core machine")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.stage == "gen":
        stage_gen(out, args.max_tokens, args.batch, args.budget_s, args.seed)
    elif args.stage == "hfgen":
        stage_hfgen(out, args.max_tokens, args.batch, args.budget_s, args.seed, args.start, args.temperature, args.end)
    elif args.stage == "stdlib":
        stage_stdlib(out, args.num_chunks, args.chunk_len, args.seed, args.budget_s)
    elif args.stage == "docs":
        stage_docs(out, Path(args.source), args.num_chunks, args.chunk_len, args.seed, args.budget_s)
    elif args.stage == "selfchat":
        stage_selfchat(out, args.num_requests, args.max_tokens, args.batch, args.budget_s, args.seed)
    else:
        stage_vocab(out)


if __name__ == "__main__":
    main()
