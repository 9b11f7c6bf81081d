"""What a whole forward step costs on this CPU per weight format: a decode step (one row), a verification of
K + 1 = 5 rows, and SSD tree steps of 8 and 16 branches, as ratios to the decode step.

Speculation pays on CPU only if checking K + 1 positions costs about what one decode step costs; an SSD draft
keeps up only if a tree step of many branches does too. This times the engine's model forward (paged attention
over ``--context`` cached tokens, every projection, the LM head on every row a step samples) with random weights
in the shapes of the default target (SmolLM2-135M), the default draft and Qwen2.5-1.5B, each packed in every
weight format that applies (Qwen2.5-1.5B: ``--big-formats``, fewer, to fit the memory), all held at once and
timed side by side: each round times one call of every step of every format.

    python bench/cpu_steps.py --threads 1 --json bench/results/cpu_products.json

The JSON's ``headline`` holds the issue's keys per format: ``verify5_over_decode`` (default target) and
``tree16_over_draft_decode`` (default draft, 16 branches).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from cpu_products import machine  # noqa: E402
from gpu_steps import BLOCK, Driver, random_model, step_inputs  # noqa: E402

from ssd.models import cpu_fused  # noqa: E402
from ssd.models.weight_formats import pack_weights  # noqa: E402
from ssd.options import WeightFormat  # noqa: E402

SMOLLM2_135M = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, vocab_size=49152, tie_word_embeddings=True)
DEFAULT_DRAFT = dict(SMOLLM2_135M, num_hidden_layers=4, vocab_size=12288)
QWEN25_15B = dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                  num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True)
MODELS = {"smollm2-135m": SMOLLM2_135M, "default-draft": DEFAULT_DRAFT, "qwen2.5-1.5b": QWEN25_15B}
FORMATS = ("fp16-packed", "fp16-packed+fused", "w8a8+fused", "w8a8+row-attention+fused", "q8_0+row-attention",
           "q8_0+row-attention+fused+python-layers", "q8_0+row-attention+fused", "q4_0+row-attention+fused",
           "q4_1+row-attention+fused")
# +row-attention: as a model with quantized activations (w8a8, q8_0, q4_0, q4_1) runs; +fused: the layers' glue
# (residual add + norm, RoPE + K/V write) through the C++ kernels of ssd/models/cpu_fused.py, as the engine runs
# float32 models on CPU by default (fused_kernels=True), and, where every projection is block-quantized and the
# attention row-invariant, all layers in one C++ call (ssd/models/layer_stack.py) unless +python-layers
OPTIONS = ("row-attention", "fused", "python-layers")
BIG_FORMATS = ("fp16-packed+fused", "q8_0+row-attention+fused+python-layers", "q8_0+row-attention+fused",
               "q4_0+row-attention+fused")  # ~4 GB each at 1.5B
STEPS = {"decode": (1, False), "verify5": (5, False), "tree8": (8, True), "tree16": (16, True)}


def build_driver(shape: dict, fmt: str, context: int) -> Driver:
    """A random model of ``shape`` in ``fmt`` (a weight format and options of :data:`OPTIONS` joined by ``+``)
    over a paged cache of ``context`` tokens and more."""
    weight_format, *options = fmt.split("+")
    if set(options) - set(OPTIONS):
        raise SystemExit(f"unknown options in {fmt!r}; known: {OPTIONS}")
    model = random_model(shape, torch.float32, torch.device("cpu"))
    pack_weights(model, WeightFormat(weight_format))
    if "fused" in options:
        if not cpu_fused.available():
            raise SystemExit("the fused CPU kernels could not be compiled here")
        model.enable_fused_kernels(kernels=cpu_fused)
        if "python-layers" in options:
            model.layer_stack = None
    return Driver(model, num_blocks=-(-(context + 32) // BLOCK), row_invariant="row-attention" in options)


def time_models(shape: dict, fmts: list[str], context: int, warmup: int, iters: int) -> dict[str, dict[str, float]]:
    """Median ms per step of each format in ``fmts``, measured side by side: every round times one call of each
    step of each format, so that the host's slow drifts (other load, memory traffic) fall on all of them alike."""
    drivers = {fmt: build_driver(shape, fmt, context) for fmt in fmts}
    inputs = {name: step_inputs(queries, context + queries, tree, shape["vocab_size"])
              for name, (queries, tree) in STEPS.items()}
    times: dict[str, dict[str, list[float]]] = {fmt: {name: [] for name in STEPS} for fmt in fmts}
    for round_ in range(warmup + iters):
        for fmt, driver in drivers.items():
            for name, flat in inputs.items():
                start = time.perf_counter()
                driver.step(flat)
                if round_ >= warmup:
                    times[fmt][name].append(time.perf_counter() - start)
    return {fmt: {name: round(statistics.median(t) * 1e3, 2) for name, t in steps.items()}
            for fmt, steps in times.items()}


def headline(results: dict) -> dict:
    """The issue's step ratios per format, where the models were measured."""
    out = {}
    for key, model, step in (("verify5_over_decode", "smollm2-135m", "verify5"),
                             ("tree16_over_draft_decode", "default-draft", "tree16"),
                             ("verify5_over_decode_1.5b", "qwen2.5-1.5b", "verify5")):
        if model in results:
            out[key] = {fmt: r["over_decode"][step] for fmt, r in results[model].items()}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--models", default=",".join(MODELS), help=f"subset of {','.join(MODELS)}")
    p.add_argument("--formats", default=",".join(FORMATS))
    p.add_argument("--big-formats", default=",".join(BIG_FORMATS), help="the formats of qwen2.5-1.5b")
    p.add_argument("--context", type=int, default=160, help="tokens already in the KV cache")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=15)
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    info = machine()
    print(f"# {info['cpu']}, {info['threads']} thread(s), torch {info['torch']} ({info['capability']}), "
          f"flags {' '.join(info['flags'])}; context {args.context} tokens")
    results: dict = {"machine": info, "command": "python " + " ".join(sys.argv), "context": args.context,
                     "results": {}}
    with torch.inference_mode():
        for name in args.models.split(","):
            print(f"\n## {name}: median ms per step (ratio to decode)")
            formats = (args.big_formats if name == "qwen2.5-1.5b" else args.formats).split(",")
            for fmt, ms in time_models(MODELS[name], formats, args.context, args.warmup, args.iters).items():
                ratios = {step: round(ms[step] / ms["decode"], 2) for step in STEPS}
                results["results"].setdefault(name, {})[fmt] = {"ms": ms, "over_decode": ratios}
                cells = "  ".join(f"{step} {ms[step]:7.2f} ({ratios[step]:.2f}x)" for step in STEPS)
                print(f"{fmt:26s} {cells}", flush=True)
    results["headline"] = headline(results["results"])
    print("\n" + json.dumps(results["headline"]))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
