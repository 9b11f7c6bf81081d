"""Draft-free speculation (``method="ngram"``, vLLM's name for it): the drafts are prompt lookup's copies.

Each round proposes what :class:`~ssd.speculative.lookup.PromptLookup` copies after the sequence's own context, one
token after another, until it finds no earlier match or has ``num_drafts`` tokens; there is no draft model, so
a round costs only the lookups and the target's verification of the copies (none where nothing matched: plain
decoding). Text that repeats its context (code quoting its prompt, edits, lists) gets long accepted runs; other
text decodes as without speculation. Exact like every proposer here: the copies depend only on the context, so
their q is one-hot and verification accepts each with the target's probability of it.
"""

from __future__ import annotations

import torch

from ssd.core.sequence import Sequence
from ssd.options import LookupConfig
from ssd.speculative.lookup import PromptLookup, copied_run, new_lookup
from ssd.speculative.proposal import DraftStatistics, Proposal, ProposalRequest, VerifiedRound


class NgramProposer:
    available = True
    failure: str | None = None

    def __init__(self, vocab_size: int, lookup: LookupConfig) -> None:
        if not lookup.enabled:
            raise ValueError("method 'ngram' drafts with prompt lookup only; it needs prompt_lookup=True")
        self.vocab_size = vocab_size
        self.lookup = lookup
        self._lookups: dict[int, PromptLookup] = {}  # seq_id -> the index over that sequence's tokens

    def statistics(self) -> DraftStatistics:
        return DraftStatistics()  # no draft model

    def _lookup_for(self, seq: Sequence) -> PromptLookup:
        lookup = self._lookups.get(seq.seq_id)
        if lookup is None or lookup.tokens is not seq.token_ids:  # new, or its token list was replaced
            lookup = self._lookups[seq.seq_id] = new_lookup(self.lookup, seq.token_ids)
        return lookup

    def prepare(self, seqs: list[Sequence]) -> None:
        """Nothing to prefill."""

    def propose(self, requests: list[ProposalRequest]) -> Proposal:
        rows = [copied_run(self._lookup_for(r.seq), r.num_drafts) for r in requests]
        width = max([len(t) for t in rows] + [1])
        draft_tokens = torch.zeros(len(rows), width, dtype=torch.long)  # [B, K]
        draft_probs = torch.zeros(len(rows), width, self.vocab_size)  # [B, K, V] one-hot at each copy
        copied = torch.zeros(len(rows), width, dtype=torch.bool)  # [B, K]
        for i, tokens in enumerate(rows):
            n = len(tokens)
            draft_tokens[i, :n] = torch.tensor(tokens, dtype=torch.long)
            draft_probs[i, torch.arange(n), draft_tokens[i, :n]] = 1.0
            copied[i, :n] = True
        return Proposal(draft_tokens, draft_probs, [len(t) for t in rows], copied=copied)

    def on_verified(self, rounds: list[VerifiedRound]) -> None:
        """Nothing to keep in step: the lookups read the sequences' own token lists."""

    def release(self, seq: Sequence) -> None:
        self._lookups.pop(seq.seq_id, None)

    def shutdown(self) -> None:
        self._lookups.clear()
