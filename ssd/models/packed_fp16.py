"""Weight format ``"fp16-packed"``: projections and LM head with float16 weights packed for FBGEMM, computing in
float32 (CPU); which models use it is decided in ``weight_formats.py``.

A decode step, a verification or a draft tree step multiplies a few rows by every weight matrix of the model,
so on CPU its time is the time to stream the weights through MKL's few-row float32 GEMM. FBGEMM's packed
float16 GEMM reads half the bytes and runs those shapes far better (``bench/RESULTS.md``, "Numbers behind the
CPU code"). Activations, norms, attention and the KV cache stay float32; each
weight is rounded once to float16 (11 significant bits, relative error <= 2^-11; the default target's
weights come from a 4-bit GGUF, the draft's from its float32 training).
"""

from __future__ import annotations

import torch

FP16_MAX = 65504.0


class PackedFp16Product:
    """``x @ W.T (+ bias)`` with ``W`` held as float16 packed for FBGEMM; ``x`` and the result are float32.

    Called like ``F.linear(x, weight, bias)``; the ``weight`` argument is ignored (the packed copy is used).
    """

    def __init__(self, weight: torch.Tensor) -> None:
        if weight.dim() != 2 or weight.device.type != "cpu":
            raise ValueError(f"a packed weight must be a 2-D CPU tensor, got {tuple(weight.shape)} on {weight.device}")
        if weight.numel() and float(weight.detach().abs().max()) > FP16_MAX:
            raise ValueError(
                f"a weight of shape {tuple(weight.shape)} exceeds the float16 range (|w| > {FP16_MAX:g}); "
                "use weight_format='dense'"
            )
        self.packed = torch.ops.quantized.linear_prepack_fp16(weight.detach().float().contiguous(), None)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None):
        out = torch.ops.quantized.linear_dynamic_fp16(x.contiguous(), self.packed)  # [rows, out]
        return out if bias is None else out + bias
