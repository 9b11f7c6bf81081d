"""Ordinary speculative decoding's proposer: a draft model in the engine's process, K sequential steps.

The draft keeps its own paged KV cache (own block pool, own prefix cache). For each sequence it keeps a
*mirror* sharing the target's token list; the mirror's ``num_computed_tokens`` says how much of it the draft
has seen. A round catches the draft up (every unseen token, ending with the pending one) and then drafts one
token per step from the draft distribution processed exactly like the target's (see ``drafting.py``), or the
token prompt lookup copies from the context (``lookup.py``).
"""

from __future__ import annotations

import logging

import torch

from ssd.core.kv_cache_manager import KVCacheManager
from ssd.core.sequence import Sequence
from ssd.options import LookupConfig
from ssd.runtime.model_runner import ModelRunner
from ssd.speculative.drafting import DraftDistribution, draft_sequentially
from ssd.speculative.mirrors import DraftMirrors
from ssd.speculative.proposal import DraftStatistics, Proposal, ProposalRequest, VerifiedRound

logger = logging.getLogger(__name__)


class DraftModelProposer:
    def __init__(
        self,
        runner: ModelRunner,
        kv_manager: KVCacheManager,
        distribution: DraftDistribution,
        default_generator: torch.Generator,
        lookup: LookupConfig | None = None,
    ) -> None:
        self.runner = runner
        self.kv_manager = kv_manager
        self.distribution = distribution
        self.default_generator = default_generator
        self.drafts = DraftMirrors(kv_manager, lookup)
        self.mirrors, self.lookups = self.drafts.mirrors, self.drafts.lookups
        self.computed: dict[int, int] = {}  # per sequence: tokens (own, then drafts) with K/V after proposing
        self.available = True
        self.failure: str | None = None

    def statistics(self) -> DraftStatistics:
        return DraftStatistics()  # the draft runs inside the target's steps: nothing beyond the round counters

    def prepare(self, seqs: list[Sequence]) -> None:
        """Nothing to overlap in-process: the draft catches up when it first proposes."""

    @torch.inference_mode()
    def propose(self, requests: list[ProposalRequest]) -> Proposal:
        mirrors = [self.drafts.mirror(r.seq) for r in requests]
        for mirror, r in zip(mirrors, requests):
            # Catch-up tokens plus K-1 drafts need slots (the last draft is never run through the draft).
            if not self.kv_manager.allocate_slots(mirror, mirror.num_uncomputed_tokens, r.num_drafts - 1):
                raise RuntimeError("draft KV cache exhausted; it is sized to never run out before the target's")
        num_drafts = [r.num_drafts for r in requests]
        drafts = draft_sequentially(
            self.runner,
            mirrors,
            num_drafts,
            [r.generator for r in requests],
            self.distribution,
            self.default_generator,
            lookups=[self.lookups[r.seq.seq_id] for r in requests],
            grammars=[r.grammar for r in requests],
        )
        for r, held in zip(requests, drafts.computed):
            self.computed[r.seq.seq_id] = held
        return Proposal(drafts.tokens, drafts.probs, num_drafts, copied=drafts.copied)

    def on_verified(self, rounds: list[VerifiedRound]) -> None:
        for round_ in rounds:
            mirror = self.mirrors.get(round_.seq.seq_id)
            if mirror is None:
                continue
            # The round's tokens were t_0..t_n (length before), then d_1..d_k accepted: valid K/V covers them
            # as far as the draft computed (at most t_n, d_1..d_{K-1}; less where prompt lookup copied).
            before = round_.seq.num_tokens - len(round_.output_tokens)
            held = self.computed.pop(round_.seq.seq_id, before)
            mirror.num_computed_tokens = min(before + round_.num_accepted, held)
            self.kv_manager.cache_full_blocks(mirror)
            self.kv_manager.trim(mirror)

    def release(self, seq: Sequence) -> None:
        self.drafts.release(seq.seq_id)
        self.computed.pop(seq.seq_id, None)

    def shutdown(self) -> None:
        self.drafts.clear()
        self.computed.clear()
