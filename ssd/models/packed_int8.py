"""Draft weight format ``"int8-packed"``: int8 weights (one scale per output row) packed for FBGEMM, with each
product's input quantized to 8 bits on the fly ("dynamic" quantization); output float32 (CPU). The format
uses it for a draft's attention and gate/up projections (``pack_weights`` in ``weight_formats.py``).

An SSD tree step multiplies 5-20 rows (one per branch) by every weight of the draft, where FBGEMM's float16
GEMM is compute-bound; its int8 GEMM does the same work in about half the time (``bench/RESULTS.md``,
"Numbers behind the CPU code").

The rounding is coarser than float16 (weights to 1/127 of their row's largest magnitude, inputs to 1/127 of
the whole input's, computed with ``reduce_range`` so that FBGEMM's 16-bit pair sums never saturate), which is
harmless for a draft: its numerics only change how often its guesses are accepted, never the output, since
verification uses the exact distributions the draft drew from. It is not offered for targets.
"""

from __future__ import annotations

import warnings

import torch


class PackedInt8Product:
    """``x @ W.T (+ bias)`` with ``W`` held as per-row int8 packed for FBGEMM; ``x`` and the result are float32.

    Called like ``F.linear(x, weight, bias)``; the ``weight`` argument is ignored (the packed copy is used).
    """

    def __init__(self, weight: torch.Tensor) -> None:
        if weight.dim() != 2 or weight.device.type != "cpu":
            raise ValueError(f"a packed weight must be a 2-D CPU tensor, got {tuple(weight.shape)} on {weight.device}")
        w = weight.detach().float().contiguous()
        scales = (w.abs().amax(dim=1) / 127.0).clamp_min(torch.finfo(torch.float32).tiny).double()  # [out]
        zero_points = torch.zeros(w.shape[0], dtype=torch.long)  # [out]
        with warnings.catch_warnings():  # quantized tensor constructors warn that they are deprecated
            warnings.simplefilter("ignore")
            quantized = torch.quantize_per_channel(w, scales, zero_points, 0, torch.qint8)
            self.packed = torch.ops.quantized.linear_prepack(quantized, None)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None):
        out = torch.ops.quantized.linear_dynamic(x.contiguous(), self.packed, True)  # [rows, out]
        return out if bias is None else out + bias
