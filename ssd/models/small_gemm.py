"""``x @ W.T (+ b)`` for a few rows of ``x`` on CPU, in whichever of two equivalent GEMM orientations is faster.

BLAS libraries dispatch products with few rows (verifying K + 1 tokens, decoding a small batch, an SSD tree of a
few branches: ``[M, H] x [H, N]`` with M = 2..16) to kernels whose speed varies wildly with M, and the same
product computed as ``(W @ x.T).T`` is often much faster (``bench/RESULTS.md``, "Numbers behind the CPU code").

:class:`SmallRowMatmul` times both orientations the first time it meets a (weight shape, row count) and keeps
the faster; the transposed one must win by :data:`MARGIN`, so near ties keep the plain product. The timing
must see the weights as a forward pass does, streamed from memory: a projection's few MB would sit in the
last-level cache if the same matrix were multiplied repeatedly, and hot-cache timings favour the plain product
(the wrong choice in a real forward). So each trial multiplies copies of the weight totalling
:data:`COLD_BYTES` (twice this machine's 32 MiB L3), one product per copy, and the copies are freed after the
measurement. Both orientations compute the same dot products; only the summation order inside the BLAS kernel
may differ (last bits of float32).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

MIN_ROWS, MAX_ROWS = 2, 16  # one row is a matrix-vector product; many rows already run at full speed
MIN_WEIGHT_NUMEL = 1 << 18  # below this (256k weights), call overhead dominates and there is nothing to win
MARGIN = 1.15  # the transposed product must be this much faster to be chosen
TRIALS = 2
COLD_BYTES = 64 << 20  # weight copies streamed per trial, so that none is still cached when it is multiplied


Product = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def plain_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.linear(x, weight)  # [rows, out]


def transposed_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.mm(weight, x.t()).t().contiguous()  # [rows, out]


def cold_seconds(product: Product, x: torch.Tensor, weights: list[torch.Tensor]) -> float:
    """Seconds per ``product(x, w)`` over ``weights`` (distinct copies, so each is read from memory)."""
    start = time.perf_counter()
    for weight in weights:
        product(x, weight)
    return (time.perf_counter() - start) / len(weights)


def cold_copies(weight: torch.Tensor) -> list[torch.Tensor]:
    """``weight`` itself when it alone exceeds :data:`COLD_BYTES`, else enough copies to."""
    nbytes = weight.numel() * weight.element_size()
    return [weight] + [weight.clone() for _ in range(-(-COLD_BYTES // nbytes) - 1)]


class SmallRowMatmul:
    """``F.linear(x, weight, bias)`` with a measured choice of orientation per (weight shape, rows).

    One instance serves every projection of a model (the choice depends on the shape, not on the values).
    """

    def __init__(self, benchmark: Callable[[Product, torch.Tensor, list[torch.Tensor]], float] = cold_seconds) -> None:
        self.benchmark = benchmark  # seconds per product(x, w) over a list of copies of the weight
        self.transposed: dict[tuple, bool] = {}  # (weight shape, dtype, rows, threads) -> use (W @ x.T).T

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.shape[0]
        if (x.device.type != "cpu" or x.dim() != 2 or not MIN_ROWS <= rows <= MAX_ROWS
                or weight.numel() < MIN_WEIGHT_NUMEL):
            return F.linear(x, weight, bias)
        key = (tuple(weight.shape), weight.dtype, rows, torch.get_num_threads())
        use_transposed = self.transposed.get(key)
        if use_transposed is None:
            use_transposed = self.transposed[key] = self._measure(x, weight)
        if not use_transposed:
            return F.linear(x, weight, bias)
        out = transposed_product(x, weight)  # [rows, out]
        return out if bias is None else out + bias

    def _measure(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        with torch.no_grad():
            weights = cold_copies(weight.detach())
            plain, transposed = [], []
            for _ in range(TRIALS):  # interleaved, best of each: robust to a busy neighbour
                plain.append(self.benchmark(plain_product, x, weights))
                transposed.append(self.benchmark(transposed_product, x, weights))
        return min(transposed) * MARGIN < min(plain)
