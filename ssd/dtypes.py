"""Model dtypes by name, and what ``"auto"`` means on a given device.

``auto`` picks bfloat16 where the device computes it natively: CUDA GPUs that support it, and CPUs with
AVX-512 BF16 or AMX. Older GPUs get float16. Other CPUs get float32, because there PyTorch emulates bf16
matrix products: a one-row decode step costs about the same in either dtype (the weights are read from
memory either way), but the multi-row steps speculation is made of (K + 1 verification rows, tree decoding
over many branches) run several times slower in emulated bf16 than in float32.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

logger = logging.getLogger(__name__)

DTYPE_NAMES = ("auto", "bfloat16", "float32", "float16")
NATIVE_BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU feature flags the kernel reports (empty where ``/proc/cpuinfo`` is not available)."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def cpu_has_native_bf16() -> bool:
    return any(flag in cpu_flags() for flag in NATIVE_BF16_CPU_FLAGS)


def resolve_dtype(name: str, device: str) -> str:
    """The concrete dtype name for ``name`` on ``device`` (``name`` unchanged unless it is ``auto``)."""
    if name not in DTYPE_NAMES:
        raise ValueError(f"dtype {name!r} is not supported; choose one of {list(DTYPE_NAMES)}")
    if name != "auto":
        return name
    if device.startswith("cuda"):
        import torch

        return "bfloat16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "float16"
    chosen = "bfloat16" if cpu_has_native_bf16() else "float32"
    logger.debug("dtype auto on %s: %s", device, chosen)
    return chosen


def torch_dtype(name: str):
    """The torch dtype of a concrete dtype name."""
    import torch

    return {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}[name]
