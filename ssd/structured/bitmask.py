"""Allowed-token bitmasks (32 tokens per int32, bit i of word w = token 32 w + i) applied to logits rows."""

from __future__ import annotations

import torch

_SHIFTS = torch.arange(32, dtype=torch.int32)


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def unpack(masks: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[N, W]`` int32 bitmasks -> ``[N, vocab_size]`` bool, True where the token is allowed."""
    bits = (masks.unsqueeze(-1) >> _SHIFTS) & 1  # arithmetic shift: bit 31 of a negative word reads as 1 too
    return bits.reshape(masks.shape[0], -1)[:, :vocab_size].bool()


def apply_bitmasks(logits: torch.Tensor, rows: list[int], masks: torch.Tensor) -> None:
    """Set ``logits[rows[i], t]`` to -inf for every token t that ``masks[i]`` does not allow (in place)."""
    if not rows:
        return
    allowed = unpack(masks, logits.shape[-1]).to(logits.device)
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
