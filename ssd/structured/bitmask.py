"""Allowed-token bitmasks (32 tokens per int32, bit i of word w = token 32 w + i) applied to logits rows."""

from __future__ import annotations

import torch

_SHIFTS = torch.arange(32, dtype=torch.int32)


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def unpack(masks: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[N, W]`` int32 bitmasks -> ``[N, vocab_size]`` bool, True where the token is allowed."""
    bits = (masks.unsqueeze(-1) >> _SHIFTS.to(masks.device)) & 1  # arithmetic shift: bit 31 of a negative word is 1
    return bits.reshape(masks.shape[0], -1)[:, :vocab_size].bool()


def pack(allowed: torch.Tensor) -> torch.Tensor:
    """``[V]`` bool -> ``[W]`` int32 bitmask (the inverse of :func:`unpack` for one row)."""
    padded = torch.zeros(bitmask_width(allowed.shape[0]) * 32, dtype=torch.int64)
    padded[: allowed.shape[0]] = allowed.to(torch.int64)
    words = (padded.view(-1, 32) << torch.arange(32, dtype=torch.int64)).sum(dim=-1)  # [W] in [0, 2**32)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def any_allowed(masks: torch.Tensor, among: torch.Tensor) -> torch.Tensor:
    """``[N]`` bool: whether each of ``masks [N, W]`` allows any token that the bitmask ``among [W]`` holds."""
    return ((masks & among) != 0).any(dim=-1)


def apply_bitmasks(logits: torch.Tensor, rows: list[int], masks: torch.Tensor) -> None:
    """Set ``logits[rows[i], t]`` to -inf for every token t that ``masks[i]`` does not allow, in place (runs of
    consecutive rows, a verification round's, through one view: no gather and scatter of [N, V] rows)."""
    vocab = logits.shape[-1]
    start = 0
    while start < len(rows):
        end = start + 1
        while end < len(rows) and rows[end] == rows[end - 1] + 1:
            end += 1
        allowed = unpack(masks[start:end].to(logits.device), vocab)  # [run, V]
        logits[rows[start] : rows[end - 1] + 1].masked_fill_(~allowed, float("-inf"))
        start = end
