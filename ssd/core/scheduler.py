"""Continuous-batching scheduler: which sequences run this step, and how many tokens each computes.

Prefill, chunked prefill, recompute after preemption and decode are one operation here: a sequence has
``num_uncomputed_tokens`` tokens without K/V, and a step computes some of them. Policy, in order:

1. Running sequences in arrival order, each taking ``min(uncomputed, remaining token budget)`` tokens (all or
   nothing without chunked prefill). When the KV pool runs dry, the most recently arrived running sequence is
   preempted (its blocks freed, its tokens to be recomputed) and the allocation retried; a sequence that is
   itself the latest arrival preempts itself. Earlier arrivals are never sacrificed for later ones.
2. Then, if nothing was preempted this step, waiting sequences first come first served while ``max_num_seqs``
   and the token budget allow, each reusing the longest cached prefix. The first one that does not fit stops
   admission (no skipping ahead). Preempted sequences go back to the front of the queue, so they come back
   first.

Speculative decoding asks for *lookahead* slots: a sequence whose chunk computes all its uncomputed tokens
(the decode phase) also gets KV slots for its round drafts (up to K) after its last token. Lookahead tokens
are run through the target in the verify pass, so they count against the token budget. The round drafts come
as one number for every sequence, or as a plan ``{seq_id: round drafts}`` the engine computes before scheduling
(sequences it omits get none); the scheduler only caps them (token budget, ``max_model_len``).
"""

from __future__ import annotations

import bisect
import itertools
import logging
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from ssd.core.kv_cache_manager import KVCacheManager
from ssd.core.sequence import FinishReason, Sequence, SequenceStatus

logger = logging.getLogger(__name__)

DraftPlan = int | Mapping[int, int]
"""Round drafts for every sequence, or per sequence id (a missing id: 0)."""


@dataclass
class SchedulerConfig:
    """Limits of one scheduling step; validated eagerly because a bad combination would stall the engine."""

    max_num_seqs: int = 16
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    enable_chunked_prefill: bool = True

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill a whole sequence must fit in one step: max_num_batched_tokens "
                f"({self.max_num_batched_tokens}) must be >= max_model_len ({self.max_model_len}); "
                "raise it or enable chunked prefill"
            )


@dataclass
class ScheduledSequence:
    """One sequence's share of a step.

    The step computes tokens ``seq.num_computed_tokens .. + num_new_tokens`` (read the start before the update)
    plus ``num_lookahead_tokens`` draft slots after them. ``computes_all_tokens`` says the chunk reaches the
    end of ``token_ids``, i.e. the step yields the distribution for the next token.
    """

    seq: Sequence
    num_new_tokens: int
    num_lookahead_tokens: int = 0
    computes_all_tokens: bool = False


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    num_batched_tokens: int = 0  # new + lookahead tokens over all scheduled sequences

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class SequenceTooLongError(ValueError):
    """A sequence needs more KV blocks than the whole pool has; it can never run. ``seq`` is still waiting."""

    def __init__(self, message: str, seq: Sequence) -> None:
        super().__init__(message)
        self.seq = seq


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_manager: KVCacheManager) -> None:
        self.config = config
        self.kv = kv_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # kept in arrival order
        self._seqs: dict[int, Sequence] = {}  # unfinished sequences by id
        self._arrival: dict[int, int] = {}  # seq_id -> arrival rank (add() order)
        self._next_arrival = 0

    # ------------------------------------------------------------------ queue management
    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished(self) -> bool:
        return bool(self._seqs)

    def candidates(self) -> list[Sequence]:
        """The sequences the next step may run: every running one, then the waiting ones that admission could
        reach (at most ``max_num_seqs`` in all), so a plan for them never walks a long queue."""
        room = max(0, self.config.max_num_seqs - len(self.running))
        return [*self.running, *itertools.islice(self.waiting, room)]

    def add(self, seq: Sequence) -> None:
        if seq.seq_id in self._seqs:
            raise ValueError(f"sequence id {seq.seq_id} is already scheduled; ids must be unique")
        if seq.num_tokens < 1:
            raise ValueError(f"sequence {seq.seq_id} has no tokens; a prompt needs at least one token")
        if seq.num_tokens > self.config.max_model_len:
            raise ValueError(
                f"sequence {seq.seq_id} has {seq.num_tokens} tokens, more than max_model_len "
                f"({self.config.max_model_len})"
            )
        if seq.block_table or seq.num_computed_tokens or seq.status is not SequenceStatus.WAITING:
            raise ValueError(f"sequence {seq.seq_id} must be new (waiting, no KV) when added")
        self._seqs[seq.seq_id] = seq
        self._arrival[seq.seq_id] = self._next_arrival
        self._next_arrival += 1
        self.waiting.append(seq)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Take a sequence out of scheduling for good and release its KV blocks."""
        if self._seqs.get(seq.seq_id) is not seq:
            raise ValueError(f"sequence {seq.seq_id} is not an unfinished sequence of this scheduler")
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self.kv.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        del self._seqs[seq.seq_id]
        del self._arrival[seq.seq_id]

    def abort(self, seq_id: int) -> Sequence | None:
        seq = self._seqs.get(seq_id)
        if seq is None:
            return None
        self.finish(seq, FinishReason.ABORT)
        return seq

    # ------------------------------------------------------------------ scheduling
    def schedule(self, num_drafts: DraftPlan = 0) -> SchedulerOutput:
        """Plan one step. ``num_drafts``: the round drafts of every sequence, or of each by id (:data:`DraftPlan`)."""
        if isinstance(num_drafts, Mapping):
            for seq_id, k in num_drafts.items():
                self._check_num_drafts(k, seq_id)
        else:
            self._check_num_drafts(num_drafts, None)
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            self._check_length(seq)
            num_new = min(seq.num_uncomputed_tokens, budget)
            if num_new == 0 or (num_new < seq.num_uncomputed_tokens and not self.config.enable_chunked_prefill):
                i += 1
                continue
            computes_all = num_new == seq.num_uncomputed_tokens
            num_la = self._lookahead_slots(seq, num_drafts, computes_all, budget - num_new)
            while not self.kv.can_allocate(seq, num_new, num_la):
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            else:
                self._allocate(seq, num_new, num_la)
                out.scheduled.append(ScheduledSequence(seq, num_new, num_la, computes_all))
                budget -= num_new + num_la
                i += 1

        # After a preemption memory is tight; admitting now would only thrash.
        while not out.preempted and self.waiting and len(self.running) < self.config.max_num_seqs and budget > 0:
            seq = self.waiting[0]
            self._check_length(seq)
            self._check_fits_pool(seq)
            num_remaining = seq.num_tokens - self.kv.find_cached_prefix(seq)
            num_new = min(num_remaining, budget)
            if num_new < num_remaining and not self.config.enable_chunked_prefill:
                break
            computes_all = num_new == num_remaining
            num_la = self._lookahead_slots(seq, num_drafts, computes_all, budget - num_new)
            if not self.kv.can_admit(seq, num_new, num_la):
                if not self.running and self.kv.num_free_blocks == self.kv.num_total_blocks:
                    raise SequenceTooLongError(
                        f"sequence {seq.seq_id} needs {num_new} new + {num_la} lookahead tokens of KV "
                        f"but the whole pool ({self.kv.num_total_blocks} blocks of {self.kv.block_size}) "
                        "cannot hold them",
                        seq,
                    )
                break
            self.waiting.popleft()
            self.kv.allocate_prefix(seq)
            self._allocate(seq, num_new, num_la)
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=lambda s: self._arrival[s.seq_id])
            out.scheduled.append(ScheduledSequence(seq, num_new, num_la, computes_all))
            budget -= num_new + num_la

        out.num_batched_tokens = self.config.max_num_batched_tokens - budget
        return out

    # ------------------------------------------------------------------ internals
    def _lookahead_slots(self, seq: Sequence, num_drafts: DraftPlan, computes_all: bool, budget_left: int) -> int:
        """This sequence's round drafts, capped by the token budget and by max_model_len (draft positions count)."""
        if not computes_all:
            return 0
        k = num_drafts.get(seq.seq_id, 0) if isinstance(num_drafts, Mapping) else num_drafts
        return max(0, min(k, budget_left, self.config.max_model_len - seq.num_tokens))

    @staticmethod
    def _check_num_drafts(k: object, seq_id: int | None) -> None:
        if not isinstance(k, int) or isinstance(k, bool) or k < 0:
            where = "" if seq_id is None else f" for sequence {seq_id}"
            raise ValueError(f"num_drafts must be a non-negative integer{where}, got {k!r}")

    def _allocate(self, seq: Sequence, num_new: int, num_la: int) -> None:
        if not self.kv.allocate_slots(seq, num_new, num_la):
            raise RuntimeError(f"KV allocation for sequence {seq.seq_id} failed after a successful check")

    def _preempt(self, seq: Sequence) -> None:
        """Drop the sequence's KV and requeue it at the front; it will recompute (the prefix cache helps)."""
        if self.running[-1] is not seq:
            raise RuntimeError("only the most recently arrived running sequence may be preempted")
        self.running.pop()
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)
        logger.debug("preempted sequence %d (%d tokens)", seq.seq_id, seq.num_tokens)

    def _check_length(self, seq: Sequence) -> None:
        if seq.num_tokens > self.config.max_model_len:
            raise RuntimeError(
                f"sequence {seq.seq_id} has {seq.num_tokens} tokens > max_model_len {self.config.max_model_len}; "
                "the engine must finish it before scheduling"
            )

    def _check_fits_pool(self, seq: Sequence) -> None:
        needed = self.kv.num_blocks_for_tokens(seq.num_tokens)
        if needed > self.kv.num_total_blocks:
            raise SequenceTooLongError(
                f"sequence {seq.seq_id} has {seq.num_tokens} tokens and needs {needed} KV blocks, but the pool "
                f"only has {self.kv.num_total_blocks} blocks of {self.kv.block_size} tokens",
                seq,
            )
