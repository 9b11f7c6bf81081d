"""Move a step's small host arrays to the device in one transfer.

A forward pass needs half a dozen small index tensors (slots, masks, positions, ...). Copying each from
pageable memory costs a blocking ``cudaMemcpy`` apiece; packing them into one pinned byte buffer and copying
it with ``non_blocking=True`` costs one asynchronous copy, so the host can keep queueing kernels. On CPU the
arrays are wrapped without copying.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

ALIGN = 8  # bytes; every section starts at a multiple, so int64 views of the byte buffer are legal


def torch_dtype(dtype: np.dtype) -> torch.dtype:
    """The torch dtype matching a numpy dtype (bool, int32, int64, float32, ...)."""
    return torch.from_numpy(np.empty(0, dtype=dtype)).dtype


def section_offsets(nbytes: Sequence[int]) -> tuple[list[int], int]:
    """Aligned start offsets of consecutive sections of the given sizes, and the total size."""
    offsets, total = [], 0
    for n in nbytes:
        offsets.append(total)
        total += -(-n // ALIGN) * ALIGN
    return offsets, total


def arrays_to_device(
    arrays: Sequence[np.ndarray], device: torch.device | str, pack: bool | None = None
) -> list[torch.Tensor]:
    """Tensors on ``device`` with the values, dtypes and shapes of ``arrays``.

    CUDA: one pinned staging buffer, one non-blocking copy; the returned tensors are views of one device
    buffer. The caching host allocator keeps the pinned buffer alive until the copy has run. CPU: zero-copy
    ``torch.from_numpy`` (the caller must not mutate the arrays while the tensors are in use). ``pack``
    forces the packed path (tests run it on CPU); default: pack on every device but the CPU.
    """
    device = torch.device(device)
    arrays = [np.ascontiguousarray(a) for a in arrays]
    if not (device.type != "cpu" if pack is None else pack):
        return [torch.from_numpy(a) for a in arrays]
    offsets, total = section_offsets([a.nbytes for a in arrays])
    host = torch.empty(max(total, ALIGN), dtype=torch.uint8, pin_memory=device.type == "cuda")
    staging = host.numpy()
    for a, off in zip(arrays, offsets):
        staging[off : off + a.nbytes] = a.reshape(-1).view(np.uint8)
    dev = host.to(device, non_blocking=True)  # [total] uint8
    return [
        dev[off : off + a.nbytes].view(torch_dtype(a.dtype)).view(a.shape) for a, off in zip(arrays, offsets)
    ]
