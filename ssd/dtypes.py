"""Model dtypes by name, and what ``"auto"`` means on a given device.

``auto`` picks bfloat16 on CUDA GPUs that support it, float16 on older ones. On a CPU it picks float32 where
PyTorch has its FBGEMM backend, whose GEMM for float16 weights packed in its own layout (the engine's
``weight_format="auto"`` then stores the weights that way, see ``ssd/models/weight_formats.py``) is the fastest
kernel for the few-row products decoding is made of, even on CPUs that compute bfloat16 natively, because a
one-row bfloat16 product runs at a fraction of the memory bandwidth (measured: ``bench/RESULTS.md``, "Numbers
behind the CPU code"). Without FBGEMM it picks
bfloat16 where the CPU computes it natively (AVX-512 BF16 or AMX), else float32: there PyTorch emulates
bf16 matrix products, and the multi-row steps speculation is made of (K + 1 verification rows, tree decoding
over many branches) run several times slower in emulated bf16 than in float32.
"""

from __future__ import annotations

import logging

from ssd.cpu_features import cpu_flags
from ssd.options import Dtype

logger = logging.getLogger(__name__)

NATIVE_BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_has_native_bf16() -> bool:
    return any(flag in cpu_flags() for flag in NATIVE_BF16_CPU_FLAGS)


def resolve_dtype(name: Dtype | str, device: str) -> Dtype:
    """The concrete dtype for ``name`` on ``device`` (``name`` unchanged unless it is ``auto``)."""
    name = Dtype.parse(name, "dtype")
    if name is not Dtype.AUTO:
        return name
    if device.startswith("cuda"):
        import torch

        return Dtype.BFLOAT16 if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else Dtype.FLOAT16
    from ssd.models.weight_formats import fbgemm_available  # imports torch: only when resolving for a CPU

    if fbgemm_available():
        chosen = Dtype.FLOAT32  # weights stored as packed float16 (weight_format "auto")
    else:
        chosen = Dtype.BFLOAT16 if cpu_has_native_bf16() else Dtype.FLOAT32
    logger.debug("dtype auto on %s: %s", device, chosen)
    return chosen


def torch_dtype(name: str):
    """The torch dtype of a concrete dtype name."""
    import torch

    return {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}[name]
