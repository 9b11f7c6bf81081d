"""Speculative decoding with an EAGLE-3 head (``method="eagle3"``): drafts from the target's own hidden states.

The target runs with its features on: each step hands the proposer the hidden states entering the head's three
target layers for every token it computed (:meth:`Eagle3Proposer.observe_target`). The head keeps a paged KV
cache of its own (one layer) over *rows*: row p holds the token at p + 1 read with the feature of position p
(:mod:`ssd.models.eagle3`). A round for a sequence whose target has computed positions 0..n-1 (the token at n
pending):

1. catch up: one forward over the rows the head has not run up to row n - 1 (the last round's accepted tokens
   and its bonus token, or a whole prompt), each with the target's feature of its position; the last row's
   logits give d_1;
2. draft d_2..d_K one row at a time, each row reading the previous row's output as its feature (the head's own
   prediction of the target's);
3. forget the rows of step 2 (the mirror's count goes back to n): next round the target's features of the
   tokens it accepted replace them.

With prompt lookup on (``prompt_lookup``), a draft position where the context repeats takes the copied token
with a one-hot q instead of the head's draw; the head still runs that row, whose output is the next row's
feature. Rows are batched over sequences in every step. Positions the target did not compute (its prefix cache served
them) have no features: the head reads zeros there, which costs acceptance, never exactness. Exactness comes
from verification, as for every proposer: each draft's q is the processed distribution it was drawn from.
"""

from __future__ import annotations

import logging

import torch

from ssd.core.block_pool import BlockPool
from ssd.core.kv_cache_manager import KVCacheManager
from ssd.core.sequence import Sequence
from ssd.models.eagle3 import Eagle3Head
from ssd.options import LookupConfig
from ssd.runtime.forward_items import ForwardItem
from ssd.speculative.drafting import DraftDistribution
from ssd.speculative.head_runner import HeadDrafts, HeadRunner, draft_with_head
from ssd.speculative.mirrors import DraftMirrors
from ssd.speculative.target_features import TargetFeatureLog, head_can_draft
from ssd.speculative.proposal import (
    DraftStatistics,
    Proposal,
    ProposalRequest,
    VerifiedRound,
)

logger = logging.getLogger(__name__)


class Eagle3Proposer:
    def __init__(
        self,
        head: Eagle3Head,
        feature_layers: tuple[int, ...],
        num_blocks: int,
        block_size: int,
        distribution: DraftDistribution,
        default_generator: torch.Generator,
        device: torch.device | str = "cpu",
        lookup: LookupConfig | None = None,
    ) -> None:
        self.runner = HeadRunner(head, num_blocks, block_size, device)
        self.feature_layers = feature_layers  # the target layers whose entering hidden states the head reads
        self.device = self.runner.device
        # No prefix caching: a row's K/V depends on the token after its position, so the target's block hashes
        # do not name it.
        self.kv_manager = KVCacheManager(BlockPool(num_blocks, block_size, enable_prefix_caching=False))
        self.drafts = DraftMirrors(self.kv_manager, lookup)  # a mirror's num_computed_tokens counts the head's rows
        self.mirrors, self.lookups = self.drafts.mirrors, self.drafts.lookups
        self.distribution = distribution
        self.default_generator = default_generator
        self.features = TargetFeatureLog()  # the target's, of positions the head has not run yet
        self.rows_without_features = 0  # rows the head ran on zeros (positions served by the target's prefix cache)
        self.available = True
        self.failure: str | None = None

    def statistics(self) -> DraftStatistics:
        return DraftStatistics()  # the head runs inside the target's steps: nothing beyond the round counters

    def prepare(self, seqs: list[Sequence]) -> None:
        """Nothing to overlap in-process: the head catches up when it first proposes."""

    # ------------------------------------------------------------------ the target's features
    def observe_target(self, computed: list[tuple[int, int, int]], features: torch.Tensor) -> None:
        """The target's step computed, for each ``(seq_id, first position, count)`` in flat order, the rows of
        ``features [T, 3 Ht]`` (a round reads only positions the target holds)."""
        self.features.observe(computed, features)

    def _target_features(self, seq_id: int, first: int, end: int) -> torch.Tensor:
        """The target's features of positions ``first..end-1`` ``[end - first, 3 Ht]`` (zeros where unknown)."""
        out = torch.zeros(end - first, self.runner.target_feature_size, device=self.device)
        self.rows_without_features += (end - first) - self.features.gather(seq_id, first, end, out)
        return out

    # ------------------------------------------------------------------ proposing
    @torch.inference_mode()
    def propose(self, requests: list[ProposalRequest]) -> Proposal:
        """Drafts for every request whose target has computed all but its pending token; none for a prompt
        whose step is also to verify (``prompt_step_speculation``): the head needs the prompt's features."""
        num_drafts = [r.num_drafts if head_can_draft(r.seq) else 0 for r in requests]
        ready = [i for i, n in enumerate(num_drafts) if n > 0]
        width = max(num_drafts)
        if len(ready) == len(requests):
            drafts = self._draft(requests)
            return Proposal(drafts.tokens, drafts.probs, num_drafts, copied=drafts.copied)
        tokens = torch.zeros(len(requests), width, dtype=torch.long, device=self.device)  # [B, K]
        probs = torch.zeros(len(requests), width, self.distribution.target_vocab_size, device=self.device)
        copied = torch.zeros(len(requests), width, dtype=torch.bool)  # [B, K]
        if ready:
            index = torch.tensor(ready, device=self.device)
            drafts = self._draft([requests[i] for i in ready])
            tokens[index], probs[index], copied[index] = drafts.tokens, drafts.probs, drafts.copied
        return Proposal(tokens, probs, num_drafts, copied=copied)

    def _draft(self, requests: list[ProposalRequest]) -> HeadDrafts:
        """The three steps of a round for these requests (``num_drafts`` each, at least one)."""
        mirrors = [self.drafts.mirror(r.seq) for r in requests]
        ends = [r.seq.num_computed_tokens for r in requests]  # rows 0..end-1 read the target's features
        items, feature_rows = [], []
        for mirror, r, end in zip(mirrors, requests, ends):
            first = min(mirror.num_computed_tokens, end - 1)  # at least the row of the pending token
            mirror.num_computed_tokens = first
            if not self.kv_manager.allocate_slots(mirror, end - first, r.num_drafts - 1):
                raise RuntimeError("EAGLE-3 head KV cache exhausted; it is sized never to run out before the "
                                   "target's")
            items.append(ForwardItem(r.seq.token_ids[first + 1 : end + 1], first, mirror.block_table))
            feature_rows.append(self._target_features(r.seq.seq_id, first, end))
        drafts = draft_with_head(
            self.runner, items, self.runner.fuse(torch.cat(feature_rows)), [r.num_drafts for r in requests],
            [r.seq.sampling_params for r in requests], [r.generator for r in requests], self.distribution,
            self.default_generator, [self.lookups.get(r.seq.seq_id) for r in requests],
            grammars=[r.grammar for r in requests], seqs=[r.seq for r in requests],
        )
        for r, mirror, end in zip(requests, mirrors, ends):
            mirror.num_computed_tokens = end  # step 2's rows are dropped: the target's features replace them
            self.features.forget(r.seq.seq_id, end)
        return drafts

    def on_verified(self, rounds: list[VerifiedRound]) -> None:
        for round_ in rounds:
            mirror = self.mirrors.get(round_.seq.seq_id)
            if mirror is not None:
                self.kv_manager.trim(mirror)

    def release(self, seq: Sequence) -> None:
        self.drafts.release(seq.seq_id)
        self.features.release(seq.seq_id)

    def shutdown(self) -> None:
        self.drafts.clear()
        self.features.clear()
