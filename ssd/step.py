"""One engine step on the target: (optionally) propose, run the target once, sample or verify.

Every scheduled sequence contributes one :class:`ForwardItem`: a prefill chunk that needs no logits, a
chunk/decode whose last logits are sampled, or a speculation ``[t_n, d_1..d_K]`` whose K+1 logits are
verified. All of them share a single target forward pass, so mixed batches (prefill + decode + verify)
cost one pass.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from ssd.core.scheduler import ScheduledSequence
from ssd.core.sequence import Sequence
from ssd.outputs import TokenLogprob
from ssd.runtime.forward_items import ForwardItem
from ssd.runtime.model_runner import ModelRunner
from ssd.sample.penalties import PenaltyRow, apply_penalties
from ssd.sample.rejection import verify
from ssd.sample.sampler import SamplingTensors, compute_logprobs, processed_probs, sample
from ssd.speculative.proposal import Proposal, ProposalRequest, Proposer, VerifiedRound
from ssd.structured.bitmask import apply_bitmasks
from ssd.structured.grammar import Grammar

logger = logging.getLogger(__name__)


@dataclass
class RowContext:
    """What the executor needs to know about a sequence besides its tokens."""

    seq: Sequence
    generator: torch.Generator | None
    banned_token_ids: list[int] = field(default_factory=list)  # e.g. EOS while below min_tokens
    speculate: bool = False
    grammar: Grammar | None = None  # structured outputs: the state after the sequence's emitted tokens


@dataclass
class StepResult:
    new_tokens: dict[int, list[int]] = field(default_factory=dict)  # seq_id -> tokens to append, in order
    num_computed: dict[int, int] = field(default_factory=dict)  # seq_id -> tokens now in the target cache
    logprobs: dict[int, list[TokenLogprob]] = field(default_factory=dict)
    rounds: dict[int, VerifiedRound] = field(default_factory=dict)  # seq_id -> verification outcome
    propose_time_s: float = 0.0
    forward_time_s: float = 0.0


class StepExecutor:
    def __init__(self, runner: ModelRunner, proposer: Proposer | None, default_generator: torch.Generator) -> None:
        self.runner = runner
        self.proposer = proposer
        self.default_generator = default_generator

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSequence], contexts: dict[int, RowContext]) -> StepResult:
        result = StepResult()
        spec_rows = [
            s for s in scheduled if s.num_lookahead_tokens > 0 and contexts[s.seq.seq_id].speculate and _completes(s)
        ]
        proposal = None
        if self.proposer is not None:
            # Lets an asynchronous draft prefill new sequences while the target computes them.
            self.proposer.prepare([s.seq for s in scheduled if _completes(s) and contexts[s.seq.seq_id].speculate])
        if spec_rows and self.proposer is not None:
            start = time.perf_counter()
            requests = [
                ProposalRequest(s.seq, s.num_lookahead_tokens, contexts[s.seq.seq_id].generator,
                                contexts[s.seq.seq_id].grammar)
                for s in spec_rows
            ]
            proposal = self.proposer.propose(requests)
            result.propose_time_s = time.perf_counter() - start
        drafts = {}  # seq_id -> row of ``proposal``
        if proposal is not None:
            for row, s in enumerate(spec_rows):
                drafts[s.seq.seq_id] = row

        items: list[ForwardItem] = []
        for s in scheduled:
            seq = s.seq
            start_pos = seq.num_computed_tokens
            tokens = seq.token_ids[start_pos : start_pos + s.num_new_tokens]
            num_logits = 1 if _completes(s) else 0
            row = drafts.get(seq.seq_id)
            if row is not None:
                k = proposal.num_drafts[row]
                tokens = tokens + proposal.draft_tokens[row, :k].tolist()
                num_logits = 1 + k
            items.append(ForwardItem(tokens, start_pos, seq.block_table, num_logits))

        start = time.perf_counter()
        layers = getattr(self.proposer, "feature_layers", None)  # an EAGLE-3 head reads the target's features
        if layers:
            logits, features = self.runner.forward_with_features(items, layers)  # [N, V], [T, F]
            self.proposer.observe_target(  # type: ignore[union-attr]
                [(s.seq.seq_id, item.start_pos, len(item.token_ids)) for s, item in zip(scheduled, items)], features
            )
        else:
            logits = self.runner.forward(items)  # [N, V]
        result.forward_time_s = time.perf_counter() - start

        offset = 0
        sample_rows: list[tuple[Sequence, int]] = []  # (seq, logits row)
        spec_seqs: list[tuple[Sequence, int, int]] = []  # (seq, first logits row, proposal row)
        row_params = []  # sampling params of every logits row
        penalised: list[PenaltyRow] = []  # rows whose logits depend on the tokens before them
        masked_rows: list[int] = []  # rows a grammar constrains, and their bitmasks
        masks: list[torch.Tensor] = []
        for s, item in zip(scheduled, items):
            seq = s.seq
            result.num_computed[seq.seq_id] = seq.num_computed_tokens + s.num_new_tokens
            if item.num_logits == 0:
                continue
            row = drafts.get(seq.seq_id)
            if row is None:
                sample_rows.append((seq, offset))
            else:
                spec_seqs.append((seq, offset, row))
            params = seq.sampling_params
            row_params.extend([params] * item.num_logits)
            before = item.token_ids[len(item.token_ids) - item.num_logits + 1 :]  # the round's drafts
            if params.has_penalties:  # position j of a round counts the drafts before it as generated
                output = seq.output_token_ids
                penalised.extend(PenaltyRow(offset + j, params, seq.prompt_token_ids, output + before[:j])
                                 for j in range(item.num_logits))
            grammar = contexts[seq.seq_id].grammar
            if grammar is not None:  # position j's mask is the grammar's state after the drafts before it
                masked_rows.extend(range(offset, offset + item.num_logits))
                masks.append(grammar.masks_along(before))
            offset += item.num_logits

        apply_penalties(logits, penalised)
        if masked_rows:
            apply_bitmasks(logits, masked_rows, torch.cat(masks))
        _ban_tokens(logits, [(r, contexts[seq.seq_id].banned_token_ids, contexts[seq.seq_id].grammar is not None)
                             for seq, r in sample_rows])
        probs = processed_probs(logits, SamplingTensors.from_params(row_params, logits.device))  # [N, V]

        if sample_rows:
            seqs = [seq for seq, _ in sample_rows]
            rows = torch.tensor([r for _, r in sample_rows], device=logits.device)
            greedy = torch.tensor([seq.sampling_params.is_greedy for seq in seqs], device=logits.device)
            tokens = sample(
                probs[rows], [contexts[seq.seq_id].generator for seq in seqs], greedy, self.default_generator
            ).tolist()
            for (seq, r), token in zip(sample_rows, tokens):
                result.new_tokens[seq.seq_id] = [token]
                self._add_logprobs(result, seq, logits, [r], [token])

        if spec_seqs:
            self._verify(result, spec_seqs, proposal, logits, probs, contexts)
        return result

    def _verify(self, result, spec_seqs, proposal: Proposal, logits, probs, contexts) -> None:
        max_drafts = max(proposal.num_drafts[row] for _, _, row in spec_seqs)
        vocab = probs.shape[-1]
        target_probs = probs.new_zeros(len(spec_seqs), max_drafts + 1, vocab)  # [B, K+1, V]
        for i, (_, first, row) in enumerate(spec_seqs):
            k = proposal.num_drafts[row]
            target_probs[i, : k + 1] = probs[first : first + k + 1]
        # The proposal lives where its proposer made it (the draft's device, or the host for SSD's replies).
        proposal_rows = [row for _, _, row in spec_seqs]
        draft_probs = proposal.draft_probs[_index(proposal_rows, proposal.draft_probs), :max_drafts]  # [B, K, V]
        draft_tokens = proposal.draft_tokens[_index(proposal_rows, proposal.draft_tokens), :max_drafts]  # [B, K]
        seqs = [seq for seq, _, _ in spec_seqs]
        greedy = torch.tensor([seq.sampling_params.is_greedy for seq in seqs], device=probs.device)
        outcome = verify(
            target_probs,
            draft_probs,
            draft_tokens,
            greedy,
            [contexts[seq.seq_id].generator for seq in seqs],
            num_draft_tokens=[proposal.num_drafts[row] for _, _, row in spec_seqs],
            default_generator=self.default_generator,
        )
        for i, (seq, first, row) in enumerate(spec_seqs):
            k = outcome.num_accepted[i]
            tokens = outcome.output_tokens[i]
            result.new_tokens[seq.seq_id] = tokens
            result.num_computed[seq.seq_id] += k  # t_n and the k accepted drafts are now valid KV
            result.rounds[seq.seq_id] = VerifiedRound(seq, proposal.num_drafts[row], k, tokens, proposal.origin(row))
            self._add_logprobs(result, seq, logits, list(range(first, first + len(tokens))), tokens)

    @staticmethod
    def _add_logprobs(result: StepResult, seq: Sequence, logits, rows: list[int], tokens: list[int]) -> None:
        num = seq.sampling_params.logprobs
        if num is None:
            return
        lp = compute_logprobs(logits[rows], torch.tensor(tokens, device=logits.device), num)
        entries = []
        for j, token in enumerate(tokens):
            top = None
            if lp.top_ids is not None:
                top = dict(zip(lp.top_ids[j].tolist(), lp.top_logprobs[j].tolist()))
            entries.append(TokenLogprob(token, float(lp.chosen_logprobs[j]), top))
        result.logprobs[seq.seq_id] = entries


def _completes(s: ScheduledSequence) -> bool:
    """True when this step computes all of the sequence's uncomputed tokens, so a new token follows."""
    return s.seq.num_computed_tokens + s.num_new_tokens >= s.seq.num_tokens


def _ban_tokens(logits: torch.Tensor, bans: list[tuple[int, list[int], bool]]) -> None:
    """Ban tokens (EOS below min_tokens) in (row, tokens, constrained by a grammar) rows. A grammar row keeps them
    where banning would leave it nothing (a grammar allowing only EOS wins); other rows always have tokens left."""
    for row, token_ids, constrained in bans:
        if token_ids:
            kept = logits[row, token_ids].clone() if constrained else None
            logits[row, token_ids] = float("-inf")
            if kept is not None and torch.isneginf(logits[row]).all():
                logits[row, token_ids] = kept


def _index(rows: list[int], tensor: torch.Tensor) -> torch.Tensor:
    """``rows`` as an index tensor on ``tensor``'s device."""
    return torch.tensor(rows, dtype=torch.long, device=tensor.device)
