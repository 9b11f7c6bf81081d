"""The target's features per sequence, from the steps that compute them until an EAGLE-3 head reads them: what SD's
``Eagle3Proposer`` runs its head on and what SSD's client sends its draft worker."""

from __future__ import annotations

import torch

from ssd.core.sequence import Sequence


def head_can_draft(seq: Sequence) -> bool:
    """Whether a head can draft after ``seq``'s pending token now: the target has computed every token before it
    (so the pending token's row has its feature), and there is one (a one-token prompt's first step has no row)."""
    return seq.num_computed_tokens == seq.num_tokens - 1 >= 1


class TargetFeatureLog:
    """Per sequence, the features ``[m, F]`` of consecutive positions from a first one: rows the target computed
    past what verification keeps are overwritten when it computes those positions again."""

    def __init__(self) -> None:
        self._held: dict[int, tuple[int, torch.Tensor]] = {}  # seq_id -> (first position, features [m, F])

    def __len__(self) -> int:
        """Sequences with rows held."""
        return len(self._held)

    def observe(self, computed: list[tuple[int, int, int]], features: torch.Tensor) -> None:
        """A target step computed, for each ``(seq_id, first position, count)`` in flat order, the rows of
        ``features [T, F]``."""
        offset = 0
        for seq_id, start, count in computed:
            rows = features[offset : offset + count]
            offset += count
            held = self._held.get(seq_id)
            if held is not None and held[0] <= start <= held[0] + len(held[1]):
                rows = torch.cat([held[1][: start - held[0]], rows])
                start = held[0]
            self._held[seq_id] = (start, rows)

    def span(self, seq_id: int, first: int, end: int) -> tuple[int, torch.Tensor] | None:
        """The held rows among positions ``first..end-1``: (their first position, ``[m, F]``), or None."""
        held = self._held.get(seq_id)
        if held is None:
            return None
        start, rows = held
        lo, hi = max(first, start), min(end, start + len(rows))
        return (lo, rows[lo - start : hi - start]) if hi > lo else None

    def gather(self, seq_id: int, first: int, end: int, out: torch.Tensor) -> int:
        """Copy the held rows among positions ``first..end-1`` into ``out [end - first, F]`` (left alone elsewhere);
        returns how many there were."""
        span = self.span(seq_id, first, end)
        if span is None:
            return 0
        start, rows = span
        out[start - first : start - first + len(rows)] = rows
        return len(rows)

    def forget(self, seq_id: int, end: int) -> None:
        """Drop the rows before position ``end`` (read and kept by the head)."""
        held = self._held.get(seq_id)
        if held is not None:
            start, rows = held
            if start + len(rows) <= end:
                del self._held[seq_id]
            else:
                self._held[seq_id] = (end, rows[max(0, end - start) :])

    def release(self, seq_id: int) -> None:
        self._held.pop(seq_id, None)

    def clear(self) -> None:
        self._held.clear()
