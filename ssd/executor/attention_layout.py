"""Build :class:`AttentionMetadata` for a batch from per-sequence slot lists.

The executor describes each sequence of the step by the slots its new tokens are written to and the slots
it reads (which include the new ones); this module turns that into padded index tensors and masks once per
step. Kept free of model code so that runners for target, draft and tree decoding share it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ssd.executor.attention import AttentionMetadata


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


def build_attention_metadata(layouts: list[SequenceLayout], device: torch.device | str = "cpu") -> AttentionMetadata:
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
            if layout.mask is not None:
                if layout.mask.shape != (q_len, kv_len):
                    raise ValueError(f"mask shape {layout.mask.shape} != ({q_len}, {kv_len})")
                mask[b, 0, :q_len, :kv_len] = layout.mask
            else:
                first = kv_len - q_len  # key index of the first new token
                mask[b, 0, :q_len, :kv_len] = np.arange(kv_len)[None, :] <= (first + np.arange(q_len))[:, None]
            mask[b, 0, q_len:, 0] = True  # padded query rows: attend somewhere so softmax stays finite
        start += q_len

    as_tensor = lambda a: torch.from_numpy(a).to(device)  # noqa: E731
    return AttentionMetadata(
        slot_mapping=as_tensor(slot_mapping),
        kv_slots=as_tensor(kv_slots),
        query_rows=as_tensor(query_rows),
        out_index=as_tensor(out_index),
        mask=None if mask is None else as_tensor(mask),
    )


def block_slots(block_table: list[int], block_size: int, start: int, end: int) -> np.ndarray:
    """Cache slots of logical token positions ``start .. end-1`` of a sequence with this block table."""
    positions = np.arange(start, end)
    blocks = np.asarray(block_table, dtype=np.int64)[positions // block_size]
    return blocks * block_size + positions % block_size
