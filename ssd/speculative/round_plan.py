"""Each step's round drafts per sequence, decided by the engine before it schedules: the scheduler's plan.

A sequence that speculates gets K drafts this round, or the adaptive policy's choice for the decoding batch
(:class:`~ssd.speculative.lookahead.LookaheadPolicy`), capped so that the round's up to K + 1 tokens (the
bonus takes the last place) stay within the model length and the request's ``max_tokens``. A prompt's step
gets none unless ``prompt_step_speculation`` (it emits its first token without waiting for the draft), and
so does a sequence the engine says does not speculate now. Pure Python, no torch.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from ssd.speculative.lookahead import lookahead_policy

if TYPE_CHECKING:
    from ssd.config import SpeculativeConfig
    from ssd.core.sequence import Sequence


class RoundPlanner:
    """The plan ``{seq_id: round drafts}`` of each step, and what the adaptive policy learns from the steps."""

    def __init__(self, spec: "SpeculativeConfig", max_model_len: int) -> None:
        self.spec = spec
        self.max_model_len = max_model_len
        self.policy = lookahead_policy(spec)  # None: K is fixed
        self._step_k: int | None = None  # this step's K under the policy, chosen on first use

    def plan(self, running: "list[Sequence]", candidates: "Iterable[Sequence]",
             speculates: "Callable[[Sequence], bool]") -> dict[int, int]:
        """Round drafts of the sequences the scheduler may run this step (``candidates``; ``running``, the
        decoding batch the adaptive policy chooses for, is among them)."""
        self._step_k = None
        return {seq.seq_id: self._round_drafts(seq, running, speculates) for seq in candidates}

    def _round_drafts(self, seq: "Sequence", running: "list[Sequence]",
                      speculates: "Callable[[Sequence], bool]") -> int:
        if not speculates(seq):
            return 0
        if seq.num_output_tokens == 0 and not self.spec.prompt_step_speculation:
            return 0  # the prompt's step emits its first token without waiting for the draft
        remaining_len = self.max_model_len - seq.num_tokens - 1
        remaining_out = seq.sampling_params.max_tokens - seq.num_output_tokens - 1
        return max(0, min(self._k(running), remaining_len, remaining_out))

    def _k(self, running: "list[Sequence]") -> int:
        """K for this step: the configured one, or the policy's choice for the decoding batch."""
        if self.policy is None:
            return self.spec.num_speculative_tokens
        if self._step_k is None:
            self._step_k = self.policy.choose_for(running)
        return self._step_k

    def observe_step(self, num_new_tokens: list[int], num_drafts: int, seconds: float) -> None:
        """A step of sequences that computed ``num_new_tokens`` each and verified ``num_drafts`` drafts in all
        took ``seconds``; the policy's step-time lines learn only from pure decode steps (one new token per
        sequence, no prefill chunk), whose time depends only on the batch size and the drafts per sequence."""
        if self.policy is None or not num_new_tokens or any(n != 1 for n in num_new_tokens):
            return
        self.policy.observe_step(len(num_new_tokens), num_drafts / len(num_new_tokens), seconds)

    def observe_round(self, seq_id: int, num_drafts: int, num_accepted: int) -> None:
        """A verified round whose drafts measure the proposer (see ``DraftOrigin.informative``)."""
        if self.policy is not None:
            self.policy.observe_round(seq_id, num_drafts, num_accepted)

    def forget(self, seq_id: int) -> None:
        if self.policy is not None:
            self.policy.forget(seq_id)
