"""Constrained against unconstrained decoding, per mode, on the default target: what structured outputs cost.

For AR, SD and SSD (the project's draft, K = 4) this generates the same chat prompts greedily, once plainly and
once constrained to a JSON schema (the prompts ask for that JSON), alternating the two and repeating, and prints
tok/s of each, their ratio, the acceptance length and the mask time per generated token in the engine's process
(computing the grammar's masks and applying them to the target's logits and, for SD, to the draft's: on the critical
path; SSD's draft-side masks run in its worker, overlapped with verification).
Every constrained output is checked to parse and to equal constrained AR's.

    python bench/structured_speed.py [--max-tokens 64] [--repeats 2] [--json bench/results/structured_speed.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from machine import machine_info  # noqa: E402

from ssd import LLM, SamplingParams  # noqa: E402
from ssd.models.fetch import fetch_default_target  # noqa: E402
from ssd.models.weight_formats import fbgemm_available  # noqa: E402
from ssd import step  # noqa: E402
from ssd.speculative.drafting import DraftDistribution  # noqa: E402
from ssd.structured.grammar import Grammar  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"},
                   "hobbies": {"type": "array", "items": {"type": "string"}}},
    "required": ["name", "age", "city", "hobbies"],
    "additionalProperties": False,
}
PROMPTS = [
    "Describe a fictional person as a JSON object with the keys name, age, city and hobbies.",
    "Return JSON for a character from a novel: name, age, city, hobbies (a list).",
    "Give me a JSON record of a software engineer with name, age, city and a list of hobbies.",
    "Output a JSON object about a retired teacher: name, age, city, hobbies.",
]
MODES = {
    "ar": None,
    "sd": {"method": "draft_model", "num_speculative_tokens": 4},
    "ssd": {"method": "ssd", "num_speculative_tokens": 4},
}


class MaskClock:
    """Accumulates the wall time of mask work in this process: the grammar's masks, applying them to the target's
    logits (``ssd.step.apply_bitmasks``) and to an in-process draft's (``DraftDistribution.constrain``)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        for owner, name in ((Grammar, "masks_along"), (Grammar, "mask_after"), (step, "apply_bitmasks"),
                            (DraftDistribution, "constrain")):
            setattr(owner, name, self._timed(getattr(owner, name)))

    def _timed(self, inner):
        def timed(*args):
            start = time.perf_counter()
            try:
                return inner(*args)
            finally:
                self.seconds += time.perf_counter() - start

        return timed


def run_mode(mode: str, model: str, draft: str, args: argparse.Namespace, clock: MaskClock) -> dict[str, Any]:
    spec = MODES[mode]
    options = dict(dtype="float32", weight_format="fp16-packed" if fbgemm_available() else "dense", seed=0)
    if spec is not None:
        options["speculative_config"] = {**spec, "model": draft}
    conversations = [[{"role": "user", "content": p}] for p in PROMPTS]
    plain = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    constrained = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, structured_outputs={"json": SCHEMA})
    results: dict[str, Any] = {"plain": [], "constrained": []}
    with LLM(model, **options) as llm:
        llm.chat(conversations[:1], SamplingParams(temperature=0.0, max_tokens=16))  # warm-up
        llm.chat(conversations[:1], SamplingParams(temperature=0.0, max_tokens=16, structured_outputs={"json": SCHEMA}))
        for _ in range(args.repeats):
            for name, params in (("plain", plain), ("constrained", constrained)):
                tokens, seconds, masks, emitted, rounds = 0, 0.0, 0.0, 0, 0
                texts = []
                for conversation in conversations:  # batch 1: one request at a time
                    clock.seconds = 0.0
                    start = time.perf_counter()
                    out = llm.chat([conversation], params)[0]
                    seconds += time.perf_counter() - start
                    masks += clock.seconds
                    tokens += len(out.token_ids)
                    texts.append(out.text)
                    if out.spec_stats is not None:
                        emitted += out.spec_stats.num_emitted_tokens
                        rounds += out.spec_stats.num_drafts
                results[name].append({"tok_s": tokens / seconds, "tokens": tokens, "mask_ms_per_token": 1e3 * masks / tokens,
                                      "acceptance_length": emitted / rounds if rounds else None, "texts": texts})
    return results


def summarise(results: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in ("plain", "constrained"):
        runs = results[name]
        out[name] = {
            "tok_s": statistics.median(r["tok_s"] for r in runs),
            "mask_ms_per_token": statistics.median(r["mask_ms_per_token"] for r in runs),
            "acceptance_length": runs[0]["acceptance_length"],
            "texts": runs[0]["texts"],
        }
    out["constrained_over_plain"] = out["constrained"]["tok_s"] / out["plain"]["tok_s"]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--draft", default=str(ROOT / "models" / "smollm2-draft"))
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    model = str(fetch_default_target())
    clock = MaskClock()
    report: dict[str, Any] = {"machine": machine_info(), "model": model, "draft": args.draft,
                              "max_tokens": args.max_tokens, "schema": SCHEMA, "modes": {}}
    for mode in MODES:
        report["modes"][mode] = summarise(run_mode(mode, model, args.draft, args, clock))
    reference = report["modes"]["ar"]["constrained"]["texts"]
    for mode, r in report["modes"].items():
        r["constrained_equals_ar"] = r["constrained"]["texts"] == reference
        r["constrained_parse"] = sum(_parses(t) for t in r["constrained"]["texts"])
        print(f"{mode:4s} plain {r['plain']['tok_s']:6.1f} tok/s  constrained {r['constrained']['tok_s']:6.1f} tok/s  "
              f"ratio {r['constrained_over_plain']:.2f}  acceptance {r['plain']['acceptance_length']} -> "
              f"{r['constrained']['acceptance_length']}  mask {r['constrained']['mask_ms_per_token']:.3f} ms/token  "
              f"parse {r['constrained_parse']}/{len(PROMPTS)}  equal to AR {r['constrained_equals_ar']}")
    for mode in ("sd", "ssd"):
        report[f"{mode}_constrained_over_ar_constrained"] = (
            report["modes"][mode]["constrained"]["tok_s"] / report["modes"]["ar"]["constrained"]["tok_s"])
    print(f"constrained SD / AR {report['sd_constrained_over_ar_constrained']:.2f}, "
          f"SSD / AR {report['ssd_constrained_over_ar_constrained']:.2f}; {report['machine'].get('cpu_model')}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")


def _parses(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except json.JSONDecodeError:
        return False


if __name__ == "__main__":
    main()
