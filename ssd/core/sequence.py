"""Per-request sequence state.

A sequence holds token ids ``t_1..t_n`` (prompt then generated). ``num_computed_tokens`` of them have their
K/V in the target's cache; the rest are scheduled in later steps. In steady decoding exactly one token, the
*pending* token ``t_n``, is uncomputed. A prefill (or a recompute after preemption) is simply a step with
many uncomputed tokens, so prefill, chunked prefill and decode are the same operation.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"  # cancelled by the caller
    ERROR = "error"  # the engine could not serve it (message in Sequence.error)


@dataclass(eq=False)
class Sequence:
    seq_id: int
    prompt_token_ids: list[int]
    sampling_params: Any  # ssd.sampling_params.SamplingParams (kept loose: core stays import-light)
    arrival_time: float = 0.0
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_table: list[int] = field(default_factory=list)
    num_cached_prompt_tokens: int = 0  # prefix-cache hit length at the last admission (statistics)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    error: str | None = None
    num_preemptions: int = 0

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    def append_tokens(self, token_ids: list[int]) -> None:
        self.token_ids.extend(token_ids)
