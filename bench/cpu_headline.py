"""The CPU issue's five headline ratios in one place: the step ratios that ``cpu_steps.py`` measured, and the
end-to-end ratios of a ``llamacpp_peer.py`` run and a ``suite.py`` run by target format, copied with their sources
into the ``headline`` of ``bench/results/cpu_products.json`` (each ratio stays measured side by side within its
own run; this only gathers them).

    python bench/cpu_headline.py --steps bench/results/cpu_products.json \\
        --peer bench/results/llamacpp_peer.json --suite bench/results/suite_weight_formats_layer_stack.json

Keys added: ``ar_over_llamacpp`` (same GGUF, same quantization, batch 1, one and two threads, per format),
``best_spec_over_llamacpp`` (our fastest exact mode over llama.cpp's fastest, per format) and ``ssd_over_ar``
(default pair, batch 1, extra-device layout, per target format) with ``perfect_ssd_over_ar`` (SSD's bound at the
draft's measured acceptance), each HumanEval / chat, and ``sources``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DATASETS = ("humaneval", "chat")


def gather(steps: dict, peer: dict, suite: dict) -> dict:
    """``steps``' headline plus the peer's and the suite's ratios (see the module doc)."""
    headline = dict(steps.get("headline", {}))
    headline["ar_over_llamacpp"] = {
        fmt: {f"t{key.rsplit('_t', 1)[1]}": value for key, value in ratios.items()
              if key.startswith("ar_over_llamacpp_t")}
        for fmt, ratios in peer["ratios"].items()
    }
    headline["best_spec_over_llamacpp"] = {fmt: ratios["best_over_llamacpp_best"]
                                           for fmt, ratios in peer["ratios"].items()}
    headline["ssd_over_ar"] = {
        fmt: {name: round(run["headline"]["by_dataset"][name]["ssd_over_ar"], 3) for name in DATASETS}
        for fmt, run in suite["runs"].items()
    }
    # SSD's bound on these prompts: every round served from the cache at the draft's measured acceptance, with
    # no wait for the draft (what a missed ssd_over_ar is measured against)
    headline["perfect_ssd_over_ar"] = {
        fmt: {name: round(run["headline"]["by_dataset"][name]["perfect_ssd_over_ar"], 3) for name in DATASETS}
        for fmt, run in suite["runs"].items()
    }
    headline["sources"] = {"steps": steps.get("command"), "ar_over_llamacpp, best_spec_over_llamacpp": peer["command"],
                           "ssd_over_ar": suite["command"]}
    return headline


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", default="bench/results/cpu_products.json", help="cpu_steps.py's JSON (rewritten)")
    p.add_argument("--peer", default="bench/results/llamacpp_peer.json")
    p.add_argument("--suite", default="bench/results/suite_weight_formats_layer_stack.json",
                   help="suite runs by target format: {'command': ..., 'runs': {format: suite JSON}}")
    args = p.parse_args(argv)
    steps = json.loads(Path(args.steps).read_text())
    steps["headline"] = gather(steps, json.loads(Path(args.peer).read_text()), json.loads(Path(args.suite).read_text()))
    Path(args.steps).write_text(json.dumps(steps, indent=1) + "\n")
    print(json.dumps(steps["headline"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
