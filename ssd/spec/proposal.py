"""The interface between the target-side step and whatever proposes draft tokens (draft model, SSD client)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ssd.core.sequence import Sequence


@dataclass
class ProposalRequest:
    """One sequence that wants ``num_drafts`` draft tokens after its pending token."""

    seq: Sequence
    num_drafts: int
    generator: torch.Generator | None


@dataclass
class Proposal:
    """Draft tokens and the exact distributions they were drawn from (rows padded to the longest)."""

    draft_tokens: torch.Tensor  # [B, K] int64
    draft_probs: torch.Tensor  # [B, K, V] float32, V = the target's vocabulary size
    num_drafts: list[int]  # per row; row i uses draft_tokens[i, :num_drafts[i]]
    cache_hit: list[bool] | None = None  # SSD: whether each row came from the speculation cache
    fallback: list[str | None] | None = None  # SSD: the fallback kind used for a miss
    copied: torch.Tensor | None = None  # [B, K] bool: drafts that prompt lookup copied from the context


@dataclass
class VerifiedRound:
    """What verification decided for one sequence; proposers use it to keep their caches in step."""

    seq: Sequence
    num_drafts: int
    num_accepted: int
    output_tokens: list[int]


class Proposer(Protocol):
    available: bool  # False once the proposer can no longer draft (e.g. its process died)

    def prepare(self, seqs: list[Sequence]) -> None:
        """Sequences whose next token the target computes this step; an asynchronous draft may prefill them."""
        ...

    def propose(self, requests: list[ProposalRequest]) -> Proposal: ...

    def on_verified(self, rounds: list[VerifiedRound]) -> None: ...

    def release(self, seq: Sequence) -> None:
        """Forget a sequence (finished, aborted or preempted) and free its draft KV."""
        ...

    def shutdown(self) -> None: ...
