"""PREFILL: new sequences for the draft worker (a message of :mod:`the wire protocol
<ssd.speculative.async_draft.wire.protocol>`, which re-exports it)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from ssd.speculative.async_draft.wire.frames import Command, ProtocolError
from ssd.speculative.async_draft.wire.message_base import (
    BOOL,
    F32,
    I32,
    I64,
    U8,
    U64,
    WireMessage,
    check_ragged,
    check_rows,
    pack_ragged,
    split_ragged,
)

@dataclass(eq=False)
class PrefillMsg(WireMessage):
    """New sequences for the worker: their tokens so far and the sampling options drafts must follow.

    first_round_drafts > 0 asks the worker to build, right after the prefill, the cache for the sequence's
    first round with that many drafts per branch: candidates for the token the target's prompt step emits on
    its own (the engine then sends that round with num_accepted = 0). 0: no such build.

    Seeds are uint64 with a `has_seed` mask rather than int64 with -1 = none, because requests may use
    any seed in [0, 2**64 - 1] (SamplingParams allows it).

    A sequence with structured outputs sends its constraint as JSON (``StructuredOutputs.to_json``) in
    `constraints` (UTF-8, ragged by `constraint_lengths`, 0 = none) and how many of its tokens are the prompt's
    (`num_prompt_tokens`): the worker's grammar follows the output tokens, so its drafts keep to the grammar.
    """

    COMMAND: ClassVar[Command] = Command.PREFILL
    ARRAYS: ClassVar[dict[str, tuple[np.dtype, int]]] = {
        "seq_ids": (I64, 1),
        "token_ids": (I64, 1),
        "lengths": (I64, 1),
        "temperature": (F32, 1),
        "top_k": (I32, 1),
        "top_p": (F32, 1),
        "greedy": (BOOL, 1),
        "seed": (U64, 1),
        "has_seed": (BOOL, 1),
        "first_round_drafts": (I32, 1),
        "num_prompt_tokens": (I64, 1),
        "constraints": (U8, 1),
        "constraint_lengths": (I64, 1),
    }

    seq_ids: np.ndarray  # [B] int64
    token_ids: np.ndarray  # [N] int64, every sequence's tokens back to back
    lengths: np.ndarray  # [B] int64, sum == N
    temperature: np.ndarray  # [B] float32
    top_k: np.ndarray  # [B] int32, 0 = disabled
    top_p: np.ndarray  # [B] float32, 1 = disabled
    greedy: np.ndarray  # [B] bool
    seed: np.ndarray  # [B] uint64, meaningful where has_seed
    has_seed: np.ndarray  # [B] bool
    first_round_drafts: np.ndarray  # [B] int32, 0 = no cache build after the prefill
    num_prompt_tokens: np.ndarray  # [B] int64, <= lengths
    constraints: np.ndarray  # [C] uint8, every constrained sequence's constraint as JSON, back to back
    constraint_lengths: np.ndarray  # [B] int64, sum == C, 0 = unconstrained

    def _validate(self) -> None:
        per_row = ("lengths", "temperature", "top_k", "top_p", "greedy", "seed", "has_seed", "first_round_drafts",
                   "num_prompt_tokens", "constraint_lengths")
        check_rows("PrefillMsg", self.seq_ids.shape[0], self, per_row)
        check_ragged("PrefillMsg", "token_ids", "lengths", self)
        check_ragged("PrefillMsg", "constraints", "constraint_lengths", self)
        if ((self.num_prompt_tokens < 0) | (self.num_prompt_tokens > self.lengths)).any():
            raise ProtocolError("PrefillMsg.num_prompt_tokens must be in [0, lengths]")
        if (self.first_round_drafts < 0).any():
            raise ProtocolError("PrefillMsg.first_round_drafts must be >= 0")

    @classmethod
    def from_lists(
        cls,
        seq_ids: Sequence[int],
        token_ids: Sequence[Sequence[int]],
        temperature: Sequence[float],
        top_k: Sequence[int],
        top_p: Sequence[float],
        greedy: Sequence[bool],
        seeds: Sequence[int | None],
        first_round_drafts: Sequence[int] | None = None,
        num_prompt_tokens: Sequence[int] | None = None,
        constraints: Sequence[str | None] | None = None,
    ) -> PrefillMsg:
        flat, lengths = pack_ragged(token_ids)
        texts = [(c or "").encode() for c in (constraints or [None] * len(seq_ids))]
        constraint_bytes = np.frombuffer(b"".join(texts), dtype=np.uint8).copy()  # [C]
        seed = np.array([0 if s is None else s for s in seeds], dtype=np.uint64)  # [B]
        has_seed = np.array([s is not None for s in seeds], dtype=np.bool_)  # [B]
        if first_round_drafts is None:
            first_round_drafts = [0] * len(seq_ids)
        return cls(
            seq_ids=np.asarray(seq_ids, dtype=np.int64), token_ids=flat, lengths=lengths,
            temperature=np.asarray(temperature, dtype=np.float32), top_k=np.asarray(top_k, dtype=np.int32),
            top_p=np.asarray(top_p, dtype=np.float32), greedy=np.asarray(greedy, dtype=np.bool_),
            seed=seed, has_seed=has_seed, first_round_drafts=np.asarray(first_round_drafts, dtype=np.int32),
            num_prompt_tokens=np.asarray(lengths if num_prompt_tokens is None else num_prompt_tokens, dtype=np.int64),
            constraints=constraint_bytes, constraint_lengths=np.array([len(t) for t in texts], dtype=np.int64),
        )

    @property
    def batch_size(self) -> int:
        return int(self.seq_ids.shape[0])

    def token_lists(self) -> list[np.ndarray]:
        return split_ragged(self.token_ids, self.lengths)

    def constraint_texts(self) -> list[str | None]:
        """Each sequence's constraint as the JSON it was sent as, None where it has none."""
        texts = split_ragged(self.constraints, self.constraint_lengths)
        return [bytes(t).decode() if len(t) else None for t in texts] if texts else [None] * self.batch_size

    def seed_of(self, row: int) -> int | None:
        return int(self.seed[row]) if self.has_seed[row] else None
