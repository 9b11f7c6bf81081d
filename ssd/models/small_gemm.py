"""``x @ W.T`` for a few rows of ``x`` on CPU, in whichever of two equivalent GEMM orientations is faster.

BLAS libraries dispatch products with few rows (verifying K + 1 tokens against a large LM head: ``[M, H] x
[H, V]`` with M = 2..16) to kernels whose speed varies wildly with M. With MKL on a 2-core AVX2 AMD EPYC,
the 49,152 x 576 head of the default target takes 12 ms for one row, 42 ms for three and 23 ms for five,
while the same product computed as ``(W @ x.T).T`` takes 6-12 ms for two to five rows. :class:`SmallRowMatmul`
times both orientations the first time it meets a row count and keeps the faster (the transposed one must
win by :data:`MARGIN`, so near ties keep the plain product and the choice does not flip between processes on
noise). Both compute the same dot products; only the summation order inside the BLAS kernel may differ.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

MIN_ROWS, MAX_ROWS = 2, 16  # one row is a matrix-vector product; many rows already run at full speed
MIN_WEIGHT_NUMEL = 1 << 20  # below this, call overhead dominates and there is nothing to win
MARGIN = 1.25  # the transposed product must be this much faster to be chosen
TRIALS = 3


Product = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def plain_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.linear(x, weight)  # [rows, out]


def transposed_product(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.mm(weight, x.t()).t().contiguous()  # [rows, out]


def seconds(product: Product, x: torch.Tensor, weight: torch.Tensor) -> float:
    start = time.perf_counter()
    product(x, weight)
    return time.perf_counter() - start


class SmallRowMatmul:
    """``F.linear(x, weight)`` (no bias) with a measured choice of orientation per (weight shape, rows)."""

    def __init__(self, benchmark: Callable[[Product, torch.Tensor, torch.Tensor], float] = seconds) -> None:
        self.benchmark = benchmark  # seconds one call of product(x, weight) takes
        self.transposed: dict[tuple, bool] = {}  # (weight shape, dtype, rows, threads) -> use (W @ x.T).T

    def __call__(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if (x.device.type != "cpu" or x.dim() != 2 or not MIN_ROWS <= rows <= MAX_ROWS
                or weight.numel() < MIN_WEIGHT_NUMEL):
            return plain_product(x, weight)
        key = (tuple(weight.shape), weight.dtype, rows, torch.get_num_threads())
        use_transposed = self.transposed.get(key)
        if use_transposed is None:
            use_transposed = self.transposed[key] = self._measure(x, weight)
        return (transposed_product if use_transposed else plain_product)(x, weight)

    def _measure(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        plain, transposed = [], []
        for _ in range(TRIALS):  # interleaved, best of each: robust to a busy neighbour
            plain.append(self.benchmark(plain_product, x, weight))
            transposed.append(self.benchmark(transposed_product, x, weight))
        return min(transposed) * MARGIN < min(plain)
