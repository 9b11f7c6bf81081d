"""One generation request as the engine tracks it: its sequence, sampling state, detokenizer and counters."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from ssd.core.sequence import Sequence
from ssd.outputs import RequestMetrics, SpecStats, TokenLogprob
from ssd.sampling_params import SamplingParams
from ssd.structured.grammar import Grammar
from ssd.tokenizer import IncrementalDetokenizer


class EncodedPrompt(NamedTuple):
    text: str | None
    token_ids: list[int]


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: str | None
    seq: Sequence
    params: SamplingParams
    generator: torch.Generator | None
    detokenizer: IncrementalDetokenizer
    metrics: RequestMetrics
    stop_token_ids: set[int]
    spec_stats: SpecStats = field(default_factory=SpecStats)
    logprobs: list[TokenLogprob] | None = None
    speculation: str = "off"
    num_reported_tokens: int = 0
    last_accepted: int = -1  # k of this request's previous verification round (SSD cache key)
    num_reported_chars: int = 0
    grammar: Grammar | None = None  # structured outputs: the grammar state after the emitted tokens
