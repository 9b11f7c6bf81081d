"""Penalties and biases on the target's logits: what ``SamplingParams``' logit_bias, repetition_penalty,
frequency_penalty and presence_penalty do to a position's logits, given the tokens before it.

Every mode computes the same function of the same tokens: a plain decode step at the sequence's next position,
and a verification round at each of its K + 1 positions with the drafts before that position counted as generated
(they are, if the position's token is ever emitted), so greedy tokens stay those of plain decoding and sampled
ones follow the penalised distribution. SD's and EAGLE-3's drafts are penalised the same way, with the drafts before
them counted (``DraftDistribution.draw``), so they follow the penalised target more often; SSD's worker drafts
without penalties, which costs acceptance only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ssd.sampling_params import SamplingParams


@dataclass(frozen=True)
class PenaltyRow:
    """One logits row to penalise: its sampling options and the tokens before its position."""

    row: int
    params: SamplingParams
    prompt: Sequence[int]
    output: Sequence[int]  # generated tokens before the position (drafts included in a verification)


def apply_penalties(logits: torch.Tensor, rows: Sequence[PenaltyRow]) -> None:
    """Penalise ``logits [N, V]`` in place, row by row: logit_bias, then repetition, frequency and presence."""
    for r in rows:
        p, x = r.params, logits[r.row]  # [V] view
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=x.device)
            x[ids] += torch.tensor(list(p.logit_bias.values()), dtype=x.dtype, device=x.device)
        if p.repetition_penalty != 1.0:
            seen = np.union1d(np.asarray(r.prompt, dtype=np.int64), np.asarray(r.output, dtype=np.int64))
            ids = torch.from_numpy(seen).to(x.device)
            values = x[ids]
            x[ids] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
        if (p.frequency_penalty or p.presence_penalty) and len(r.output):
            tokens, counts = np.unique(np.asarray(r.output, dtype=np.int64), return_counts=True)
            ids = torch.from_numpy(tokens).to(x.device)
            penalty = p.frequency_penalty * torch.from_numpy(counts).to(x) + p.presence_penalty
            x[ids] -= penalty


def check_token_ids(params: SamplingParams, vocab_size: int) -> None:
    """Refuse a logit_bias naming a token the model does not have (a clear error, not an index error later)."""
    if params.logit_bias:
        bad = sorted(t for t in params.logit_bias if t >= vocab_size)
        if bad:
            raise ValueError(f"logit_bias names token ids {bad[:5]} outside the model's vocabulary of {vocab_size}")
