"""Ordinary speculative decoding's proposer: a draft model in the engine's process, K sequential steps.

The draft keeps its own paged KV cache (own block pool, own prefix cache). For each sequence it mirrors the
target's token list; ``num_computed_tokens`` of the mirror says how much of it the draft has seen. A round
catches the draft up (all unseen tokens, ending with the pending token) and then decodes one token at a
time; draft tokens are sampled from the draft distribution processed exactly like the target's (same
temperature/top-k/top-p), and those distributions are returned for verification.
"""

from __future__ import annotations

import logging

import torch

from ssd.core.kv_cache_manager import KVCacheManager
from ssd.core.sequence import Sequence
from ssd.executor.model_runner import ForwardItem, ModelRunner
from ssd.sample.sampler import SamplingTensors, processed_probs, sample
from ssd.spec.proposal import Proposal, ProposalRequest, VerifiedRound

logger = logging.getLogger(__name__)


class DraftModelProposer:
    def __init__(
        self,
        runner: ModelRunner,
        kv_manager: KVCacheManager,
        target_vocab_size: int,
        num_usable_tokens: int,
        default_generator: torch.Generator,
    ) -> None:
        self.runner = runner
        self.kv_manager = kv_manager
        self.target_vocab_size = target_vocab_size
        self.num_usable_tokens = num_usable_tokens  # ids >= this never come from the tokenizer (padding rows)
        self.default_generator = default_generator
        self.mirrors: dict[int, Sequence] = {}
        self.available = True

    def prepare(self, seqs: list[Sequence]) -> None:
        """Nothing to overlap in-process: the draft catches up when it first proposes."""

    def _mirror(self, seq: Sequence) -> Sequence:
        mirror = self.mirrors.get(seq.seq_id)
        if mirror is None:
            # Shares the target's token list: appended tokens are visible without copying.
            mirror = Sequence(seq.seq_id, seq.prompt_token_ids, seq.sampling_params, token_ids=seq.token_ids)
            self.kv_manager.allocate_prefix(mirror)
            self.mirrors[seq.seq_id] = mirror
        return mirror

    @torch.inference_mode()
    def propose(self, requests: list[ProposalRequest]) -> Proposal:
        max_k = max(r.num_drafts for r in requests)
        mirrors = [self._mirror(r.seq) for r in requests]
        for mirror, r in zip(mirrors, requests):
            # Catch-up tokens plus K-1 drafts need slots (the last draft is never run through the draft).
            if not self.kv_manager.allocate_slots(mirror, mirror.num_uncomputed_tokens, r.num_drafts - 1):
                raise RuntimeError("draft KV cache exhausted; it is sized to never run out before the target's")
        device = self.runner.device
        draft_tokens = torch.zeros(len(requests), max_k, dtype=torch.long, device=device)  # [B, K]
        draft_probs = torch.zeros(len(requests), max_k, self.target_vocab_size, device=device)  # [B, K, V]
        pending: list[list[int]] = [m.token_ids[m.num_computed_tokens :] for m in mirrors]
        positions = [m.num_computed_tokens for m in mirrors]
        for step in range(max_k):
            active = [i for i, r in enumerate(requests) if r.num_drafts > step]
            items = [ForwardItem(pending[i], positions[i], mirrors[i].block_table, 1) for i in active]
            logits = self.runner.forward(items)  # [A, Vd]
            probs = self._processed(logits, [requests[i] for i in active])  # [A, V]
            rows = torch.tensor(active, device=device)
            st = SamplingTensors.from_params([requests[i].seq.sampling_params for i in active], device)
            tokens = sample(probs, [requests[i].generator for i in active], st.greedy, self.default_generator)
            draft_tokens[rows, step] = tokens
            draft_probs[rows, step] = probs
            for i, token in zip(active, tokens.tolist()):
                positions[i] += len(pending[i])
                pending[i] = [token]
        for mirror in mirrors:
            # The draft now holds K/V for t_1..t_n (and for d_1..d_{K-1}, which become real only once accepted).
            mirror.num_computed_tokens = mirror.num_tokens
        return Proposal(draft_tokens, draft_probs, [r.num_drafts for r in requests])

    def _processed(self, logits: torch.Tensor, requests: list[ProposalRequest]) -> torch.Tensor:
        """Draft distribution over the target's vocabulary, processed like the target's."""
        logits = logits[:, : self.num_usable_tokens]  # padding rows of either model are never proposed
        if logits.shape[-1] < self.target_vocab_size:
            pad = logits.new_full((logits.shape[0], self.target_vocab_size - logits.shape[-1]), float("-inf"))
            logits = torch.cat([logits, pad], dim=-1)  # [A, V]
        st = SamplingTensors.from_params([r.seq.sampling_params for r in requests], logits.device)
        return processed_probs(logits, st)

    def on_verified(self, rounds: list[VerifiedRound]) -> None:
        for round_ in rounds:
            mirror = self.mirrors.get(round_.seq.seq_id)
            if mirror is None:
                continue
            # The draft ran t_n, d_1..d_{K-1}; of these, d_1..d_k are now real tokens (t_n was computed already).
            valid_drafts = min(round_.num_accepted, round_.num_drafts - 1)
            mirror.num_computed_tokens = round_.seq.num_tokens - len(round_.output_tokens) + valid_drafts
            self.kv_manager.cache_full_blocks(mirror)
            self.kv_manager.trim(mirror)

    def release(self, seq: Sequence) -> None:
        mirror = self.mirrors.pop(seq.seq_id, None)
        if mirror is not None:
            self.kv_manager.free(mirror)

    def shutdown(self) -> None:
        for seq_id in list(self.mirrors):
            self.kv_manager.free(self.mirrors.pop(seq_id))
