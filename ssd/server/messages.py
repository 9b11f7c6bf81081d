"""What passes between the event loop and the engine thread of the server's async engine.

Kept apart from both sides so that each imports only data: the caller-facing request and its errors, the
per-step :class:`StreamDelta` and finish record, the engine snapshot ``/metrics`` reads, and the commands the
loop queues for the engine thread.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ssd.outputs import RequestMetrics, SpecStats
from ssd.sampling_params import SamplingParams

if TYPE_CHECKING:
    from ssd.server.async_engine import RequestStream


# --------------------------------------------------------------------------------------------- errors
class RequestRejectedError(ValueError):
    """The request is invalid for this engine (prompt too long, bad token ids, no chat template, ...)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.param = param
        self.code = code


class EngineOverloadedError(RuntimeError):
    """Too many requests in flight; the client should retry later."""


class EngineDeadError(RuntimeError):
    """The engine thread has stopped (shutdown or a fatal error)."""


# --------------------------------------------------------------------------------------------- data
@dataclass
class GenerationRequest:
    """One prompt to generate for. Exactly one of ``prompt`` and ``messages`` is set.

    ``params.max_tokens`` is the caller's explicit limit when ``max_tokens_explicit``; otherwise it is a
    default that the engine thread lowers to the room the prompt leaves (the prompt length is only known
    after tokenizing there). ``prompt_param``, ``max_tokens_param`` and ``structured_param`` name the request
    fields the prompt, the limit and the output constraint came from, for errors.
    """

    request_id: str
    params: SamplingParams
    prompt: str | list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    max_tokens_explicit: bool = True
    prompt_param: str = "prompt"
    max_tokens_param: str = "max_tokens"
    structured_param: str | None = None  # the field an output constraint came from


@dataclass
class Admission:
    """Sent once the engine has accepted the request."""

    num_prompt_tokens: int
    max_tokens: int


@dataclass
class LogprobEntry:
    token_id: int
    token: str
    logprob: float
    top: list[tuple[int, str, float]] = field(default_factory=list)  # (id, text, logprob), best first


@dataclass
class StreamDelta:
    """What one engine step added to one request (``text``/``token_ids`` are the new part only)."""

    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    logprobs: list[LogprobEntry] | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_prompt_tokens: int = 0
    error: str | None = None
    # set on the final delta only
    metrics: RequestMetrics | None = None
    spec_stats: SpecStats | None = None
    speculation: str = "off"


@dataclass
class FinishedRequest:
    """Per-request figures for the metrics callback, measured on the server side of the queue."""

    request_id: str
    finish_reason: str  # stop | length | abort | error
    num_prompt_tokens: int
    num_output_tokens: int
    e2e_latency_s: float
    time_to_first_token_s: float | None
    time_per_output_token_s: float | None
    queue_time_s: float | None


@dataclass
class EngineSnapshot:
    """Engine state for ``/metrics`` and ``/health``, taken by the engine thread after each step."""

    num_running: int = 0
    num_waiting: int = 0
    num_pending: int = 0
    kv_usage: float = 0.0
    kv_free_blocks: int = 0
    kv_total_blocks: int = 0
    prefix_cache_hit_rate: float = 0.0
    draft_kv_free_blocks: int | None = None
    draft_kv_total_blocks: int | None = None
    draft_num_sequences: int | None = None
    spec_stats: SpecStats | None = None
    num_steps: int = 0


# --------------------------------------------------------------------------------------------- commands
@dataclass
class Rejection:
    """Engine thread -> stream: the request was refused before it started (the first item of its stream)."""

    error: RequestRejectedError


@dataclass
class AddCommand:
    """Loop -> engine thread: start serving ``request``, reporting to ``stream``."""

    request: GenerationRequest
    stream: RequestStream


@dataclass
class AbortCommand:
    """Loop -> engine thread: stop serving a request and free its KV blocks."""

    request_id: str


STOP_COMMAND = object()
"""Loop -> engine thread: abort everything and leave the thread loop."""
