"""How close a model in each weight format stays to its float32 checkpoint: teacher-forced top-1 agreement.

A quantized target is a different model from its checkpoint; this says how different. The float32 checkpoint
greedily continues each prompt (chat prompts with the chat template, code stubs raw); every format then reads
the same token sequences in one forward each, and we count the generated positions where its argmax equals the
checkpoint's (and the mean absolute log-probability gap of the checkpoint's token).

    python bench/quant_agreement.py --num 10 --max-tokens 48 [--model PATH] [--formats fp16-packed,w8a8]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "train"))

from eval_prompts import CHAT_EVAL, CODE_EVAL  # noqa: E402
from gpu_steps import sequence_logits  # noqa: E402

from ssd.models.loader import load_model  # noqa: E402
from ssd.models.weight_formats import pack_weights  # noqa: E402
from ssd.options import WeightFormat  # noqa: E402


def sequences(model_path: str, num: int, max_tokens: int) -> list[tuple[int, list[int]]]:
    """(prompt length, prompt + the float32 checkpoint's greedy continuation) per prompt."""
    from ssd import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    with LLM(model_path, dtype="float32", kv_cache_memory="256MiB") as llm:
        chats = [[{"role": "user", "content": p}] for p in CHAT_EVAL[:num]]
        outputs = llm.chat(chats, params) + llm.generate(CODE_EVAL[:num], params)
    return [(len(o.prompt_token_ids), list(o.prompt_token_ids) + list(o.token_ids)) for o in outputs]


def logprobs_of(model, tokens: list[int]) -> torch.Tensor:
    """Log-probabilities ``[n, V]`` of the next token at every position, from one causal forward."""
    return torch.log_softmax(sequence_logits(model, tokens, [len(tokens)]).double(), dim=-1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="target checkpoint (default: the fetched SmolLM2-135M)")
    p.add_argument("--formats", default="fp16-packed,w8a8")
    p.add_argument("--num", type=int, default=10, help="prompts per set (chat, code)")
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    if args.model is None:
        from ssd.models.fetch import fetch_default_target

        args.model = str(fetch_default_target())
    seqs = sequences(args.model, args.num, args.max_tokens)
    reference, _ = load_model(args.model, dtype=torch.float32)
    results = {"model": args.model, "positions": sum(len(t) - n for n, t in seqs), "formats": {}}
    with torch.inference_mode():
        ref_lps = [logprobs_of(reference, tokens) for _, tokens in seqs]
        for fmt in args.formats.split(","):
            model, _ = load_model(args.model, dtype=torch.float32)
            pack_weights(model, WeightFormat(fmt))
            agree, gaps = 0, []
            for (n, tokens), ref in zip(seqs, ref_lps):
                lp = logprobs_of(model, tokens)
                rows = range(n - 1, len(tokens) - 1)  # positions whose next token was generated
                chosen = torch.tensor(tokens[n:])
                agree += int((lp[rows].argmax(-1) == ref[rows].argmax(-1)).sum())
                gaps.append((lp[rows].gather(1, chosen[:, None]) - ref[rows].gather(1, chosen[:, None])).abs())
            gap = float(torch.cat(gaps).mean())
            results["formats"][fmt] = {"top1_agreement": round(agree / results["positions"], 4),
                                       "mean_abs_logprob_gap": round(gap, 4)}
            print(f"{fmt:12s} top-1 agreement with float32 {agree / results['positions']:.2%} "
                  f"over {results['positions']} positions; mean |log p gap| of the chosen token {gap:.4f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
