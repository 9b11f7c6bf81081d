"""What a few-row product costs on this CPU, per weight format and row count (issue: CPU products that cost by
bytes, not by rows).

For each model shape (the default target SmolLM2-135M, the default draft, and a Qwen2.5-1.5B layer) and each
weight format the engine has, it times the products of one decoder layer's four projections (qkv, o, gate_up,
down) and of the LM head for m = 1, 2, 5, 8, 16, 32 rows, with the weights streamed from memory as in a forward
pass (each call cycles through enough distinct copies of the layer to exceed the last-level cache), and prints
each format's milliseconds at m = 1 and its cost at m rows as a ratio to m = 1. It also checks each format's
batch invariance (a row alone, inside m rows, and moved: bitwise equal or not).

    python bench/cpu_products.py --threads 1 --json bench/results/cpu_products_kernels.json

Random weights of the right shapes: a product's time does not depend on the values.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ssd.cpu_features import cpu_flags  # noqa: E402
from ssd.models.block_quant import BlockKind, BlockQuantProduct  # noqa: E402
from ssd.models.packed_fp16 import PackedFp16Product  # noqa: E402
from ssd.models.packed_int8 import PackedInt8Product  # noqa: E402
from ssd.models.rowwise_int8 import RowwiseInt8Product, activation_levels  # noqa: E402

ROWS = (1, 2, 5, 8, 16, 32)
COLD_BYTES = 96 << 20  # weight bytes streamed per timed call: more than any last-level cache here


@dataclass(frozen=True)
class Shape:
    name: str
    hidden: int
    q_kv: int  # output rows of the fused qkv projection
    intermediate: int
    vocab: int

    def layer(self) -> dict[str, tuple[int, int]]:
        """(out, in) of each projection of one layer."""
        return {"qkv": (self.q_kv, self.hidden), "o": (self.hidden, self.hidden),
                "gate_up": (2 * self.intermediate, self.hidden), "down": (self.hidden, self.intermediate)}


SHAPES = {
    "smollm2-135m": Shape("smollm2-135m", 576, 576 + 2 * 192, 1536, 49152),
    "default-draft": Shape("default-draft", 576, 576 + 2 * 192, 1536, 12288),
    "qwen2.5-1.5b": Shape("qwen2.5-1.5b", 1536, 1536 + 2 * 256, 8960, 151936),
}


def dense(w: torch.Tensor):
    return lambda x: F.linear(x, w)


FORMATS = {
    "fp32-dense": dense,
    "fp16-packed": lambda w: PackedFp16Product(w),
    "int8-packed (per-call activation scale)": lambda w: PackedInt8Product(w),
    "w8a8 (per-row activation scale)": lambda w: RowwiseInt8Product(w),
    "q8_0 (blocks of 32, activations too)": lambda w: BlockQuantProduct(w, BlockKind.Q8_0),
    "q4_0 (blocks of 32, activations in q8_0)": lambda w: BlockQuantProduct(w, BlockKind.Q4_0),
    "q4_1 (q4_0 with block minimums)": lambda w: BlockQuantProduct(w, BlockKind.Q4_1),
}


def products_for(fmt: str, shapes: list[tuple[int, int]]) -> list[list]:
    """Enough copies of the given weights, built in ``fmt``, to exceed COLD_BYTES of float32."""
    per_copy = sum(o * i * 4 for o, i in shapes)
    copies = max(1, -(-COLD_BYTES // per_copy))
    return [[FORMATS[fmt](torch.randn(o, i) * 0.02) for o, i in shapes] for _ in range(copies)]


def median_ms(products: list[list], x_by_in: dict[int, torch.Tensor], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for copy in products:
            for product, (_, i) in copy:
                product(x_by_in[i])
        times.append((time.perf_counter() - start) / len(products) * 1e3)
    return statistics.median(times)


def invariant(product, in_features: int, m: int) -> bool:
    """Whether each row's result is bitwise the same alone, inside m rows, and at another position."""
    torch.manual_seed(1)
    x = torch.randn(m, in_features)
    together = product(x)
    rolled = product(torch.roll(x, 1, dims=0))
    alone = torch.cat([product(x[i : i + 1]) for i in range(m)])
    return bool(torch.equal(together, alone) and torch.equal(torch.roll(together, 1, dims=0), rolled))


def measure(shape: Shape, fmt: str, part: str, repeats: int) -> dict:
    shapes = list(shape.layer().values()) if part == "layer" else [(shape.vocab, shape.hidden)]
    built = products_for(fmt, shapes)
    products = [list(zip(copy, shapes)) for copy in built]
    result = {"ms": {}, "ratio": {}}
    for m in ROWS:
        xs = {i: torch.randn(m, i) for _, i in shapes}
        median_ms(products[:1], xs, 1)  # warm up (first-call allocation, kernel choice)
        result["ms"][m] = round(median_ms(products, xs, repeats), 3)
    result["ratio"] = {m: round(result["ms"][m] / result["ms"][1], 2) for m in ROWS}
    product, (_, in_features) = products[0][-1]
    result["batch_invariant_m16"] = invariant(product, in_features, 16)
    return result


def machine() -> dict:
    flags = cpu_flags()
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    return {"cpu": model, "threads": torch.get_num_threads(), "torch": torch.__version__,
            "capability": torch.backends.cpu.get_cpu_capability(),
            "flags": sorted(f for f in flags if f.startswith(("avx512", "amx", "avx_vnni", "avx2"))),
            "w8a8_activation_levels": activation_levels()[0]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"subset of {','.join(SHAPES)}")
    p.add_argument("--formats", default=",".join(FORMATS), help="subset of the formats (comma-separated)")
    p.add_argument("--parts", default="layer,head", help="layer (the four projections), head (the LM head)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", default="", help="write the results here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    info = machine()
    print(f"# {info['cpu']}, {info['threads']} thread(s), torch {info['torch']} ({info['capability']}), "
          f"flags {' '.join(info['flags'])}")
    results: dict = {"machine": info, "command": "python " + " ".join(sys.argv), "rows": list(ROWS), "results": {}}
    with torch.inference_mode():
        for shape_name in args.shapes.split(","):
            shape = SHAPES[shape_name]
            for part in args.parts.split(","):
                print(f"\n## {shape_name} {part}: ms at m=1, then cost at m rows / m=1; batch-invariant at m=16")
                for fmt in [f for f in FORMATS if f.split(" ")[0] in args.formats.split(",") or f in args.formats]:
                    r = measure(shape, fmt, part, args.repeats)
                    results["results"].setdefault(shape_name, {}).setdefault(part, {})[fmt] = r
                    ratios = " ".join(f"{m}:{r['ratio'][m]:.2f}x" for m in ROWS[1:])
                    print(f"{fmt:42s} {r['ms'][1]:8.3f} ms  {ratios}  invariant={r['batch_invariant_m16']}",
                          flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
