"""The interface between the target-side step and whatever proposes draft tokens (draft model, prompt lookup,
SSD client): the :class:`Proposer` protocol, what flows through it, and the facts about the target a proposer
is built from. The engine reads a proposer only through this module."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from ssd.core.sequence import Sequence
from ssd.options import Fallback
from ssd.structured.grammar import Grammar


@dataclass
class ProposalRequest:
    """One sequence that wants ``num_drafts`` draft tokens after its pending token."""

    seq: Sequence
    num_drafts: int
    generator: torch.Generator | None
    grammar: Grammar | None = None  # structured outputs: drafts are drawn from the grammar's allowed tokens


@dataclass
class Proposal:
    """Draft tokens and the exact distributions they were drawn from (rows padded to the longest)."""

    draft_tokens: torch.Tensor  # [B, K] int64
    draft_probs: torch.Tensor  # [B, K, V] float32, V = the target's vocabulary size
    num_drafts: list[int]  # per row; row i uses draft_tokens[i, :num_drafts[i]]
    cache_hit: list[bool] | None = None  # SSD: whether each row came from the speculation cache
    fallback: list[Fallback | None] | None = None  # SSD: what served each row that missed (None: a hit)
    copied: torch.Tensor | None = None  # [B, K] bool: drafts that prompt lookup copied from the context
    # False for a row whose drafts are not the proposer's best guesses (SSD's random filler): their
    # acceptance says nothing about the rates the adaptive lookahead plans with. None: every row is.
    informative: list[bool] | None = None

    def origin(self, row: int) -> "DraftOrigin":
        """How row ``row``'s drafts were made."""
        return DraftOrigin(
            copied=None if self.copied is None else self.copied[row].tolist(),
            cache_hit=None if self.cache_hit is None else self.cache_hit[row],
            fallback=None if self.fallback is None else self.fallback[row],
            informative=True if self.informative is None else self.informative[row],
        )


@dataclass(frozen=True)
class DraftOrigin:
    """How one row's drafts were made, as far as the proposer says."""

    copied: list[bool] | None = None  # per draft position: prompt lookup copied it (None: not said)
    cache_hit: bool | None = None  # served from a speculation cache (None: the proposer has none)
    fallback: Fallback | None = None  # what served a cache miss
    informative: bool = True  # the acceptance of these drafts measures the proposer (see Proposal)


@dataclass
class VerifiedRound:
    """What verification decided for one sequence; proposers use it to keep their caches in step."""

    seq: Sequence
    num_drafts: int
    num_accepted: int
    output_tokens: list[int]
    origin: DraftOrigin = DraftOrigin()


@dataclass(frozen=True)
class TargetFacts:
    """What a proposer is built from besides the configuration: facts about the loaded target."""

    vocab_size: int  # rows of the target's logits (draft distributions are over these ids)
    hidden_size: int
    device: str
    dtype: str
    max_model_len: int
    num_kv_blocks: int  # the target's KV cache blocks (a draft sizes its own cache to never run out first)


@dataclass
class DraftStatistics:
    """Draft-side counters a proposer accumulates over its life (zero where it does no such work)."""

    build_time_s: float = 0.0  # SSD: time the draft worker spent building speculation caches
    build_branches: int = 0  # tree branches of those builds
    builds: int = 0  # cache builds with at least one branch
    builds_cut_short: int = 0  # of those, builds stopped early: the next request was waiting or due
    feature_bytes: int = 0  # SSD with an EAGLE-3 head: the target's features sent to the draft worker
    # SSD rounds as the target saw them: the wait from sending a request to its reply, and the draft's own time
    # serving it; the difference is the link (both directions, framing) and any build step the request queued
    # behind. Bytes of every message each way.
    rounds: int = 0
    reply_wait_s: float = 0.0
    serve_s: float = 0.0
    bytes_sent: int = 0
    bytes_received: int = 0
    link_rtt_s: float | None = None  # a draft server's link: HELLO -> READY less the server's setup


class Proposer(Protocol):
    """Everything the engine reads of a proposer."""

    available: bool  # False once the proposer can no longer draft (e.g. its process died)
    failure: str | None  # why it is no longer available

    def statistics(self) -> DraftStatistics:
        """The draft-side counters so far."""
        ...

    def prepare(self, seqs: list[Sequence]) -> None:
        """Sequences whose next token the target computes this step; an asynchronous draft may prefill them."""
        ...

    def propose(self, requests: list[ProposalRequest]) -> Proposal: ...

    def on_verified(self, rounds: list[VerifiedRound]) -> None: ...

    def release(self, seq: Sequence) -> None:
        """Forget a sequence (finished, aborted or preempted) and free its draft KV."""
        ...

    def shutdown(self) -> None: ...
