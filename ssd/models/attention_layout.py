"""Build :class:`AttentionMetadata` for a batch from per-sequence slot lists.

The executor describes each sequence of the step by the slots its new tokens are written to and the slots
it reads (which include the new ones); this module turns that into padded index tensors and masks once per
step. Kept free of model code so that runners for target, draft and tree decoding share it. The index
tensors reach the device in one non-blocking copy (:func:`ssd.runtime.host_transfer.arrays_to_device`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ssd.models.attention import AttentionMetadata
from ssd.runtime.host_transfer import arrays_to_device


@dataclass
class SequenceLayout:
    """Attention layout of one sequence in a step.

    ``read_slots`` are the cache slots the sequence attends to, in order; the new tokens' slots
    (``write_slots``) must be among them. Without ``mask`` attention is causal: query i sees
    ``read_slots[: len(read_slots) - len(write_slots) + i + 1]``. With ``mask`` (``[q_len, len(read_slots)]``
    bool) it is explicit, as tree attention needs.
    """

    write_slots: list[int] | np.ndarray
    read_slots: list[int] | np.ndarray
    mask: np.ndarray | None = None


def sequence_mask(layout: SequenceLayout) -> np.ndarray:
    """The ``[q_len, kv_len]`` bool mask of one sequence: its explicit mask, or causal over its read slots."""
    q_len, kv_len = len(layout.write_slots), len(layout.read_slots)
    if layout.mask is not None:
        if layout.mask.shape != (q_len, kv_len):
            raise ValueError(f"mask shape {layout.mask.shape} != ({q_len}, {kv_len})")
        return layout.mask
    first = kv_len - q_len  # key index of the first new token
    return np.arange(kv_len)[None, :] <= (first + np.arange(q_len))[:, None]


def build_attention_metadata(layouts: list[SequenceLayout], device: torch.device | str = "cpu") -> AttentionMetadata:
    """Reference metadata for ``layouts``, moved to ``device`` in one transfer."""
    arrays = metadata_arrays(layouts)
    return _as_metadata(arrays_to_device(arrays, device))


@dataclass
class StepTensors:
    """Everything one forward pass needs on the device, delivered by :func:`build_step_tensors`."""

    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    logit_rows: torch.Tensor  # [N] int64 rows of the flat batch whose logits are wanted
    meta: AttentionMetadata


def build_step_tensors(
    token_ids: list[int] | np.ndarray,
    positions: np.ndarray,
    layouts: list[SequenceLayout],
    logit_rows: list[int] | np.ndarray,
    device: torch.device | str = "cpu",
) -> StepTensors:
    """Token ids, positions, logit rows and attention metadata of a step in ONE host-to-device copy (pinned,
    non-blocking on CUDA), instead of one blocking copy per tensor."""
    head = [
        np.asarray(token_ids, dtype=np.int64),
        np.asarray(positions, dtype=np.int64),
        np.asarray(logit_rows, dtype=np.int64),
    ]
    tensors = arrays_to_device(head + metadata_arrays(layouts), device)
    return StepTensors(tensors[0], tensors[1], tensors[2], _as_metadata(tensors[3:]))


def _as_metadata(tensors: list[torch.Tensor]) -> AttentionMetadata:
    return AttentionMetadata(
        slot_mapping=tensors[0],
        kv_slots=tensors[1],
        query_rows=tensors[2],
        out_index=tensors[3],
        mask=tensors[4] if len(tensors) > 4 else None,
    )


def metadata_arrays(layouts: list[SequenceLayout]) -> list[np.ndarray]:
    """Host arrays of the reference metadata: slot_mapping, kv_slots, query_rows, out_index[, mask]."""
    num_seqs = len(layouts)
    q_lens = [len(s.write_slots) for s in layouts]
    kv_lens = [len(s.read_slots) for s in layouts]
    max_q, max_kv = max(q_lens), max(kv_lens)
    num_tokens = sum(q_lens)

    slot_mapping = np.concatenate([np.asarray(s.write_slots, dtype=np.int64) for s in layouts])
    kv_slots = np.zeros((num_seqs, max_kv), dtype=np.int64)
    query_rows = np.full((num_seqs, max_q), num_tokens, dtype=np.int64)
    out_index = np.empty(num_tokens, dtype=np.int64)

    uniform = all(q == 1 for q in q_lens) and all(k == max_kv for k in kv_lens) and all(s.mask is None for s in layouts)
    mask = None if uniform else np.zeros((num_seqs, 1, max_q, max_kv), dtype=bool)

    start = 0
    for b, (layout, q_len, kv_len) in enumerate(zip(layouts, q_lens, kv_lens)):
        kv_slots[b, :kv_len] = layout.read_slots
        query_rows[b, :q_len] = np.arange(start, start + q_len)
        out_index[start : start + q_len] = b * max_q + np.arange(q_len)
        if mask is not None:
            mask[b, 0, :q_len, :kv_len] = sequence_mask(layout)
            mask[b, 0, q_len:, 0] = True  # padded query rows: attend somewhere so softmax stays finite
        start += q_len

    return [slot_mapping, kv_slots, query_rows, out_index] + ([] if mask is None else [mask])


def block_slots(block_table: list[int], block_size: int, start: int, end: int) -> np.ndarray:
    """Cache slots of logical token positions ``start .. end-1`` of a sequence with this block table."""
    positions = np.arange(start, end)
    blocks = np.asarray(block_table, dtype=np.int64)[positions // block_size]
    return blocks * block_size + positions % block_size
