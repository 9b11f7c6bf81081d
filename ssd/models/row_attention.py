"""Row-invariant paged attention on CPU: each query row's result depends only on that row and the keys it sees.

PyTorch's SDPA sums in orders that depend on the call's shape (a decode step's single unmasked query, a
verification's masked rows, a prefill chunk), so the same token gets logits that differ in the last bits from
one kind of step to another. With float weights that is harmless; with activations quantized per row
(``"w8a8"`` targets, ``ssd/models/rowwise_int8.py``) a last-bit difference can flip a rounding step and grow
into a different token, so SD and SSD would stop reproducing AR. This kernel computes every (query row, head)
by a fixed sequence of its own: the dot product with each visible key (masked keys are skipped, not added as
zeros), the softmax, and the weighted sum of values in key order. The result for a token is therefore bitwise
the same in a decode step, a verification, a prefill chunk or any batch, at any thread count.

With AVX-512 and a head size that is a multiple of 16, one thread takes all query rows of a sequence and all
heads of one KV head together and goes through the keys 16 at a time for all of them, so each block of keys
and values comes from memory once for a verification's rows and GQA's heads, while each (row, head) still runs
its own chain: a fused multiply-add per 16-wide chunk of the head and one lane reduction per score (the lane
sums of 16 keys reduced together, in the pairs of a single vector's reduction), exponentials 16 keys at a time
by one polynomial, values accumulated in key order. Elsewhere a scalar path computes each (row, head) alone (16
fixed lanes combined pairwise, ``std::exp``): different bits from the vector path, but one machine always runs
the same path.

The C++ source (``ssd/models/csrc/row_attention.cpp``) is compiled once per machine on first use
(``ssd/models/native.py``; a C++ compiler and ninja are needed); :func:`available` says whether that worked.
"""

from __future__ import annotations

import torch

from ssd.models.native import cpu_kernels, cpu_kernels_available


def available() -> bool:
    """Whether the kernel compiled (or was found compiled) on this machine; logs why not."""
    return cpu_kernels_available()


def row_attention(
    query: torch.Tensor,  # [T, H, D] float32
    key_cache: torch.Tensor,  # [num_slots, Hkv, D] float32
    value_cache: torch.Tensor,  # [num_slots, Hkv, D] float32
    kv_slots: torch.Tensor,  # [B, L] int64
    query_rows: torch.Tensor,  # [B, Q] int64: row of the flat batch per padded query (>= T: padding)
    mask: torch.Tensor | None,  # [B, Q, L] bool (True: visible), None: every row sees all L slots
    scale: float,
) -> torch.Tensor:
    """Attention ``[T, H, D]`` of every query row over the slots it sees, each row computed on its own."""
    return cpu_kernels().row_attention(query.contiguous(), key_cache, value_cache, kv_slots, query_rows, mask,
                                   float(scale))
