"""Weight format ``"w8a8"``: int8 weights (one scale per output channel) times int8 activations quantized per
row (one scale per row), multiplied in integers by FBGEMM; output float32 (CPU).

Why: a decode step, a verification (K + 1 rows) or an SSD tree step (a row per branch) multiplies a few rows by
every weight of the model, so on CPU it should cost what reading the weights costs. FBGEMM's float16 GEMM is
compute-bound from two rows on (``bench/RESULTS.md``, "Numbers behind the CPU code"); its int8 GEMM reads half
the bytes and, with VNNI, stays close to flat up to ~8 rows (``bench/cpu_products.py`` measures both on the
machine at hand).

Batch invariance: each row is quantized with its own scale (``s_i = max|x_i| / L``, ``q_i = round(x_i / s_i)``)
and the product of integers is exact, so a row's result is bitwise the same whatever rows share the call and
wherever it sits among them; that keeps every mode, batch size and K token-identical. (FBGEMM's own dynamic
quantization, used by ``packed_int8.py``, takes one scale per call and is not.) The integer-valued ``q`` is
passed with scale 1 and a zero point, so FBGEMM's quantization of it is lossless.

Levels: with VNNI (``avx512_vnni`` / ``avx_vnni``) FBGEMM accumulates u8 x s8 products in 32 bits, so
activations use L = 127 (zero point 128). Without it, pairs of products are summed in saturating 16 bits, so
activations use L = 63 (zero point 64: unsigned values below 128), which cannot saturate. The format's numbers
therefore depend on the CPU family; within one machine every mode and batch shape agrees.

Targets: every product is batch-invariant, but a target must be invariant as a whole forward, and PyTorch's
attention is not: the SDPA calls of a decode step, a K + 1 verification and a prefill sum in different orders,
a last-bit matter in float weights (fp16-packed logits differ by ~6e-5 between those paths on the default
target) that per-row activation rounding amplifies (a flipped rounding step, then 30 layers: 4.5 in the
logits), so SD and SSD would not reproduce AR. A w8a8 target therefore computes attention with the
row-invariant kernel (``ssd/models/row_attention.py``), with which its logits are bitwise identical on all
three paths (``bench/step_invariance.py``). A w8a8 target is a different model from its checkpoint (its
top-1 agreement with the float32 checkpoint: ``bench/quant_agreement.py``); a draft's numerics only change its
acceptance, which stayed within noise (``train/measure.py``; both in ``bench/RESULTS.md``).
"""

from __future__ import annotations

import functools
import warnings

import torch

from ssd.cpu_features import cpu_flags

VNNI_FLAGS = ("avx512_vnni", "avx_vnni")


def has_vnni() -> bool:
    """Whether the CPU multiplies int8 with 32-bit accumulation (AVX-512 VNNI or AVX-VNNI)."""
    return any(flag in cpu_flags() for flag in VNNI_FLAGS)


@functools.cache
def activation_levels() -> tuple[int, int]:
    """(L, zero point) of the per-row activation quantization on this CPU (see the module docstring)."""
    return (127, 128) if has_vnni() else (63, 64)


def quantize_per_channel(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out, in] as a symmetric per-output-channel ``qint8`` tensor (scale max|w_row| / 127)."""
    w = weight.detach().float().contiguous()
    scales = (w.abs().amax(dim=1) / 127.0).clamp_min(torch.finfo(torch.float32).tiny).double()  # [out]
    zero_points = torch.zeros(w.shape[0], dtype=torch.long)  # [out]
    with warnings.catch_warnings():  # quantized tensor constructors warn that they are deprecated
        warnings.simplefilter("ignore")
        return torch.quantize_per_channel(w, scales, zero_points, 0, torch.qint8)


class RowwiseInt8Product:
    """``x @ W.T (+ bias)`` with ``W`` held as per-channel int8 packed for FBGEMM and ``x`` quantized per row;
    ``x`` and the result are float32. Called like ``F.linear(x, weight, bias)``; ``weight`` is ignored."""

    def __init__(self, weight: torch.Tensor) -> None:
        if weight.dim() != 2 or weight.device.type != "cpu":
            raise ValueError(f"a packed weight must be a 2-D CPU tensor, got {tuple(weight.shape)} on {weight.device}")
        self.in_features = weight.shape[1]
        self.levels, self.zero_point = activation_levels()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            self.packed = torch.ops.quantized.linear_prepack(quantize_per_channel(weight), None)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor | None = None, bias: torch.Tensor | None = None):
        rows = x.reshape(-1, self.in_features)  # [rows, in]
        scale = rows.abs().amax(dim=1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny) / self.levels
        q = torch.round(rows / scale)  # [rows, in], integers in [-L, L]
        out = torch.ops.quantized.linear_with_input_q_dq_qweight_dq_output_fp32(q, 1.0, self.zero_point, self.packed)
        out = (out * scale).reshape(*x.shape[:-1], out.shape[-1])  # [..., out]
        return out if bias is None else out + bias
