"""Per-sequence work items of a forward pass and their flattening into one packed step.

A runner's caller describes each sequence's share of a pass as a :class:`ForwardItem`; :func:`flatten_items`
turns a list of them into the packed form the attention layout code consumes (one token list, positions, a
:class:`SequenceLayout` per sequence and the rows whose logits are wanted). Tests and the GPU check script
build steps through the same function, so there is one place that knows how items become a step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ssd.models.attention_layout import SequenceLayout, block_slots


@dataclass
class ForwardItem:
    """One sequence's share of a forward pass.

    ``token_ids`` are written at logical positions ``start_pos ..``; their slots come from ``block_table``
    unless ``write_slots``/``read_slots``/``positions``/``mask`` are given explicitly (tree decoding puts
    branch tokens in scratch slots whose order differs from their logical positions). ``num_logits`` is how
    many trailing tokens need logits (0 for a non-final prefill chunk, 1 for decode, K+1 for verification).
    """

    token_ids: list[int]
    start_pos: int
    block_table: list[int]
    num_logits: int = 1
    positions: np.ndarray | None = None
    write_slots: np.ndarray | None = None
    read_slots: np.ndarray | None = None
    mask: np.ndarray | None = None


@dataclass
class FlatStep:
    """A step's items packed into one flat batch of ``T`` tokens."""

    token_ids: list[int]  # [T]
    positions: np.ndarray  # [T] int64 logical (RoPE) positions
    layouts: list[SequenceLayout]  # one per item, in item order
    logit_rows: list[int]  # [N] rows of the flat batch whose logits are wanted, in item order

    @property
    def all_rows(self) -> bool:
        """True when every token of the step needs logits (no row selection)."""
        return len(self.logit_rows) == len(self.token_ids)


def flatten_items(items: list[ForwardItem], block_size: int) -> FlatStep:
    """Pack ``items`` into one step; slots not given explicitly come from each item's block table."""
    token_ids: list[int] = []
    positions: list[np.ndarray] = []
    layouts: list[SequenceLayout] = []
    logit_rows: list[int] = []
    offset = 0
    for item in items:
        n = len(item.token_ids)
        end = item.start_pos + n
        token_ids.extend(item.token_ids)
        positions.append(item.positions if item.positions is not None else np.arange(item.start_pos, end))
        write = item.write_slots
        if write is None:
            write = block_slots(item.block_table, block_size, item.start_pos, end)
        read = item.read_slots
        if read is None:
            read = block_slots(item.block_table, block_size, 0, end)
        layouts.append(SequenceLayout(write_slots=write, read_slots=read, mask=item.mask))
        logit_rows.extend(range(offset + n - item.num_logits, offset + n))
        offset += n
    pos = np.concatenate(positions).astype(np.int64) if positions else np.zeros(0, dtype=np.int64)
    return FlatStep(token_ids, pos, layouts, logit_rows)
