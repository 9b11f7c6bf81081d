"""An asyncio front for the synchronous :class:`~ssd.engine.LLMEngine`.

The engine is not thread-safe, and its step is long blocking compute, so it gets one thread of its own that
does everything that touches it: tokenizing and validating prompts, adding and aborting requests, stepping,
detokenizing logprob tokens, and taking the snapshot that ``/metrics`` reads. The event loop talks to that
thread through a thread-safe command queue; each request has an asyncio queue that the thread fills with
``loop.call_soon_threadsafe``. New requests join the running batch between steps (continuous batching).

Backpressure: at most ``max_num_seqs + max_waiting_requests`` requests may be in flight; one more is refused
at once with :class:`EngineOverloadedError` (HTTP 503) rather than queued without bound.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from ssd.engine import EncodedPrompt, LLMEngine
from ssd.outputs import RequestMetrics, RequestOutput, SpecStats
from ssd.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


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


class RequestFailedError(RuntimeError):
    """The engine could not finish an admitted request (an engine fault, not the caller's mistake)."""


# --------------------------------------------------------------------------------------------- data
@dataclass
class GenerationRequest:
    """One prompt to generate for. Exactly one of ``prompt`` and ``messages`` is set.

    ``params.max_tokens`` is the caller's explicit limit when ``max_tokens_explicit``; otherwise it is a
    default that the engine thread lowers to the room the prompt leaves (the prompt length is only known
    after tokenizing there). ``prompt_param`` and ``max_tokens_param`` name the request fields the prompt
    and the limit came from, for errors.
    """

    request_id: str
    params: SamplingParams
    prompt: str | list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    max_tokens_explicit: bool = True
    prompt_param: str = "prompt"
    max_tokens_param: str = "max_tokens"


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


@dataclass
class _Rejection:
    error: RequestRejectedError


@dataclass
class _Add:
    request: GenerationRequest
    stream: "RequestStream"


@dataclass
class _Abort:
    request_id: str


_STOP = object()


# --------------------------------------------------------------------------------------------- streams
class RequestStream:
    """The caller's end of one request: iterate it for :class:`StreamDelta` items; :meth:`abort` to cancel."""

    def __init__(self, owner: "AsyncEngine", request_id: str) -> None:
        self.request_id = request_id
        self.admission: Admission | None = None
        self._owner = owner
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._closed = False
        self._arrival = time.monotonic()
        self._first_token: float | None = None
        self._num_prompt_tokens = 0
        self._num_output_tokens = 0

    @property
    def finished(self) -> bool:
        return self._closed

    def __aiter__(self) -> AsyncIterator[StreamDelta]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[StreamDelta]:
        while True:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            if item.finished:
                return

    async def collect(self) -> list[StreamDelta]:
        """All deltas until the request finishes (non-streaming responses)."""
        return [delta async for delta in self]

    def abort(self) -> None:
        """Cancel the request and free its KV blocks; a no-op once it has finished."""
        if self._closed:
            return
        self._owner._abort(self)

    # ---- called on the loop thread only
    def _deliver(self, item: Any) -> None:
        if self._closed:
            return  # aborted meanwhile: late outputs are dropped
        if isinstance(item, StreamDelta):
            self._num_prompt_tokens = item.num_prompt_tokens or self._num_prompt_tokens
            self._num_output_tokens = item.num_output_tokens
            if item.token_ids and self._first_token is None:
                self._first_token = time.monotonic()
            if item.finished:
                self._owner._finish(self, item.finish_reason or "error", item.metrics)
        elif isinstance(item, Admission):
            self.admission = item
            self._num_prompt_tokens = item.num_prompt_tokens
        elif isinstance(item, (_Rejection, BaseException)):
            self._owner._finish(self, None, None)
        self._queue.put_nowait(item)

    def _finished_record(self, reason: str, metrics: RequestMetrics | None) -> FinishedRequest:
        now = time.monotonic()
        ttft = None if self._first_token is None else self._first_token - self._arrival
        tpot = None
        if self._first_token is not None and self._num_output_tokens > 1:
            tpot = (now - self._first_token) / (self._num_output_tokens - 1)
        queue_time = None
        if metrics is not None and metrics.first_scheduled_time is not None:
            queue_time = metrics.first_scheduled_time - metrics.arrival_time
        return FinishedRequest(
            self.request_id, reason, self._num_prompt_tokens, self._num_output_tokens, now - self._arrival,
            ttft, tpot, queue_time,
        )


# --------------------------------------------------------------------------------------------- engine
class AsyncEngine:
    """Runs an :class:`LLMEngine` in a background thread and serves requests to asyncio code.

    ``on_request_done`` is called on the event-loop thread for every admitted request that ends (finished,
    failed or aborted). ``own_engine``: :meth:`stop` also shuts the engine down (draft worker included).
    """

    def __init__(
        self,
        engine: LLMEngine,
        max_waiting_requests: int = 256,
        on_request_done: Callable[[FinishedRequest], None] | None = None,
        own_engine: bool = True,
    ) -> None:
        if not isinstance(max_waiting_requests, int) or max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests must be an integer >= 0, got {max_waiting_requests!r}")
        self.engine = engine
        self.max_in_flight = engine.config.max_num_seqs + max_waiting_requests
        self.on_request_done = on_request_done
        self.own_engine = own_engine
        self.max_model_len = engine.max_model_len
        self._commands: queue.Queue[Any] = queue.Queue()
        self._streams: dict[str, RequestStream] = {}  # loop thread: requests not yet ended
        self._engine_streams: dict[str, RequestStream] = {}  # engine thread: requests it is serving
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._snapshot = EngineSnapshot()
        self._num_steps = 0
        self.error: str | None = None  # why the engine thread died, if it did

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the engine thread; call from the event loop that will submit requests."""
        if self._thread is not None:
            raise RuntimeError("AsyncEngine already started")
        self._loop = asyncio.get_running_loop()
        self._publish_snapshot()
        self._thread = threading.Thread(target=self._run, name="ssd-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the engine thread (pending requests fail with :class:`EngineDeadError`)."""
        thread, self._thread = self._thread, None
        if thread is not None:
            self._commands.put(_STOP)
            thread.join(timeout)
            if thread.is_alive():
                logger.error("engine thread did not stop within %.0f s", timeout)
        for stream in list(self._streams.values()):
            stream._deliver(EngineDeadError("the server is shutting down"))
        if self.own_engine:
            self.engine.shutdown()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def snapshot(self) -> EngineSnapshot:
        snap = self._snapshot
        snap.num_pending = len(self._streams)
        return snap

    # ------------------------------------------------------------------ loop-thread API
    async def submit(self, request: GenerationRequest) -> RequestStream:
        """Queue a request; returns once the engine accepted it.

        Raises :class:`EngineOverloadedError` when the in-flight bound is reached, :class:`RequestRejectedError`
        when the engine finds the request invalid, :class:`EngineDeadError` when the engine is gone.
        """
        if not self.is_running:
            raise EngineDeadError(self.error or "the engine is not running")
        if len(self._streams) >= self.max_in_flight:
            raise EngineOverloadedError(
                f"the server is overloaded ({len(self._streams)} requests in flight, at most {self.max_in_flight}); "
                "retry later"
            )
        if request.request_id in self._streams:
            raise ValueError(f"request id {request.request_id!r} is already in flight")
        stream = RequestStream(self, request.request_id)
        self._streams[request.request_id] = stream
        self._commands.put(_Add(request, stream))
        try:
            first = await stream._queue.get()
        except BaseException:  # cancelled while waiting (client gone): the engine may already have it
            stream.abort()
            raise
        if isinstance(first, _Rejection):
            raise first.error
        if isinstance(first, BaseException):
            raise first
        return stream

    async def submit_all(self, requests: list[GenerationRequest]) -> list[RequestStream]:
        """Submit several prompts of one API call; if one is refused, the others are aborted."""
        if len(self._streams) + len(requests) > self.max_in_flight:
            raise EngineOverloadedError(
                f"the server is overloaded ({len(self._streams)} requests in flight, at most {self.max_in_flight}, "
                f"this call needs {len(requests)}); retry later"
            )
        streams: list[RequestStream] = []
        try:
            for request in requests:
                streams.append(await self.submit(request))
        except BaseException:
            for stream in streams:
                stream.abort()
            raise
        return streams

    def _abort(self, stream: RequestStream) -> None:
        self._finish(stream, "abort", None)
        self._commands.put(_Abort(stream.request_id))

    def _finish(self, stream: RequestStream, reason: str | None, metrics: RequestMetrics | None) -> None:
        """Mark a stream ended; ``reason`` None means it was never admitted (nothing to record)."""
        if stream._closed:
            return
        stream._closed = True
        self._streams.pop(stream.request_id, None)
        if reason is not None and self.on_request_done is not None:
            try:
                self.on_request_done(stream._finished_record(reason, metrics))
            except Exception:  # metrics must never break serving
                logger.exception("request-done callback failed")

    def _post(self, stream: RequestStream, item: Any) -> None:
        """Engine thread -> loop thread."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(stream._deliver, item)
        except RuntimeError:  # loop closed between the check and the call (shutdown)
            pass

    # ------------------------------------------------------------------ engine thread
    def _run(self) -> None:
        try:
            while True:
                if not self._drain_commands(block=not self.engine.has_unfinished()):
                    break
                if self.engine.has_unfinished():
                    self._step()
                self._publish_snapshot()
        except BaseException as exc:  # a bug in the loop itself: fail everyone, report unhealthy
            logger.exception("engine thread died")
            self.error = f"engine thread died: {type(exc).__name__}: {exc}"
            doomed = list(self._engine_streams.values())
            self._engine_streams.clear()
            while True:  # requests still queued would otherwise wait forever for their admission
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    break
                if isinstance(command, _Add):
                    doomed.append(command.stream)
            for stream in doomed:
                self._post(stream, EngineDeadError(self.error))

    def _drain_commands(self, block: bool) -> bool:
        """Apply queued commands; False once asked to stop."""
        while True:
            try:
                command = self._commands.get(block=block)
            except queue.Empty:
                return True
            block = False
            if command is _STOP:
                for request_id in list(self._engine_streams):
                    self.engine.abort(request_id)
                self._engine_streams.clear()
                return False
            if isinstance(command, _Add):
                self._add(command.request, command.stream)
            elif isinstance(command, _Abort):
                if self._engine_streams.pop(command.request_id, None) is not None:
                    self.engine.abort(command.request_id)

    def _add(self, request: GenerationRequest, stream: RequestStream) -> None:
        if stream._closed:  # aborted before it reached the engine
            return
        try:
            encoded = self._encode(request)
            self._fit_max_tokens(request, len(encoded.token_ids))
            self.engine.add_request(encoded, request.params, request.request_id)
        except RequestRejectedError as exc:
            self._post(stream, _Rejection(exc))
            return
        except ValueError as exc:
            self._post(stream, _Rejection(RequestRejectedError(str(exc), _param_of(str(exc), request.prompt_param))))
            return
        except Exception as exc:  # e.g. a chat template that raises on this conversation: the input's fault
            logger.warning("request %s could not be prepared: %s", request.request_id, exc, exc_info=True)
            message = f"cannot prepare the {request.prompt_param}: {type(exc).__name__}: {exc}"
            self._post(stream, _Rejection(RequestRejectedError(message, request.prompt_param)))
            return
        self._engine_streams[request.request_id] = stream
        self._post(stream, Admission(len(encoded.token_ids), request.params.max_tokens))

    def _encode(self, request: GenerationRequest) -> EncodedPrompt:
        tokenizer = self.engine.tokenizer
        if request.messages is not None:
            text, ids = None, tokenizer.apply_chat_template(request.messages)
        elif isinstance(request.prompt, str):
            if not request.prompt:
                raise RequestRejectedError("prompt is empty; give at least one character", request.prompt_param)
            text, ids = request.prompt, tokenizer.encode(request.prompt)
        else:
            text, ids = None, request.prompt
        if isinstance(ids, list) and len(ids) >= self.max_model_len:
            raise RequestRejectedError(
                f"this model's maximum context length is {self.max_model_len} tokens, but the prompt has "
                f"{len(ids)} tokens; at most {self.max_model_len - 1} prompt tokens leave room for one generated "
                "token",
                request.prompt_param,
                "context_length_exceeded",
            )
        validated = self.engine.encode_prompt(ids)  # empty list, out-of-vocabulary ids
        return EncodedPrompt(text, validated.token_ids)

    def _fit_max_tokens(self, request: GenerationRequest, num_prompt_tokens: int) -> None:
        """Explicit max_tokens must fit in the context and KV pool; a default is lowered to what fits."""
        kv = self.engine.kv_manager
        capacity = min(self.max_model_len, kv.num_total_blocks * kv.block_size)
        if num_prompt_tokens >= capacity:
            raise RequestRejectedError(
                f"the prompt has {num_prompt_tokens} tokens but the server's KV cache holds at most {capacity} "
                "tokens per request",
                request.prompt_param,
                "context_length_exceeded",
            )
        room = capacity - num_prompt_tokens
        params = request.params
        if not request.max_tokens_explicit:
            params.max_tokens = max(1, min(params.max_tokens, room))
        elif params.max_tokens > room:
            raise RequestRejectedError(
                f"this model's maximum context length is {capacity} tokens; the request has {num_prompt_tokens} "
                f"prompt tokens and asks for {request.max_tokens_param}={params.max_tokens}, so "
                f"{request.max_tokens_param} must be at most {room}",
                request.max_tokens_param,
                "context_length_exceeded",
            )
        if params.min_tokens > params.max_tokens:
            raise RequestRejectedError(
                f"min_tokens={params.min_tokens} is more than the {params.max_tokens} tokens this prompt leaves room "
                "for",
                "min_tokens",
            )

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:  # an engine fault: fail the requests in it, keep serving new ones
            logger.exception("engine step failed; failing the %d requests in flight", len(self._engine_streams))
            message = f"engine step failed: {type(exc).__name__}: {exc}"
            for request_id, stream in list(self._engine_streams.items()):
                try:
                    self.engine.abort(request_id)
                except Exception:
                    logger.exception("abort of %s failed after a step error", request_id)
                self._post(stream, StreamDelta("", [], True, "error", error=message))
            self._engine_streams.clear()
            return
        self._num_steps += 1
        for output in outputs:
            stream = self._engine_streams.get(output.request_id)
            if stream is None:
                continue
            delta = self._delta(output, stream)
            if output.finished:
                del self._engine_streams[output.request_id]
            self._post(stream, delta)

    def _delta(self, output: RequestOutput, stream: RequestStream) -> StreamDelta:
        metrics = output.metrics
        delta = StreamDelta(
            text=output.new_text,
            token_ids=list(output.new_token_ids),
            finished=output.finished,
            finish_reason=output.finish_reason,
            num_prompt_tokens=len(output.prompt_token_ids),
            num_output_tokens=len(output.token_ids),
            num_cached_prompt_tokens=metrics.num_cached_prompt_tokens if metrics is not None else 0,
            error=output.error,
            speculation=output.speculation,
        )
        if output.logprobs is not None:
            new = output.logprobs[len(output.logprobs) - len(output.new_token_ids) :] if output.new_token_ids else []
            delta.logprobs = [self._logprob_entry(lp) for lp in new]
        if output.finished:
            delta.metrics = copy.copy(metrics)
            delta.spec_stats = copy.deepcopy(output.spec_stats)
        return delta

    def _logprob_entry(self, lp) -> LogprobEntry:
        decode = self.engine.tokenizer.decode
        top = [(t, decode([t], skip_special_tokens=False), v) for t, v in (lp.top or {}).items()]
        top.sort(key=lambda item: -item[2])
        return LogprobEntry(lp.token_id, decode([lp.token_id], skip_special_tokens=False), lp.logprob, top)

    def _publish_snapshot(self) -> None:
        engine = self.engine
        kv = engine.kv_manager
        snap = EngineSnapshot(
            num_running=engine.scheduler.num_running,
            num_waiting=engine.scheduler.num_waiting,
            kv_usage=kv.usage,
            kv_free_blocks=kv.num_free_blocks,
            kv_total_blocks=kv.num_total_blocks,
            prefix_cache_hit_rate=kv.prefix_cache_hit_rate,
            num_steps=self._num_steps,
        )
        proposer = engine.proposer
        if engine.spec is not None:
            snap.spec_stats = copy.deepcopy(engine.spec_stats)
        if proposer is not None:
            draft_kv = getattr(proposer, "kv_manager", None)
            if draft_kv is not None:
                snap.draft_kv_free_blocks = draft_kv.num_free_blocks
                snap.draft_kv_total_blocks = draft_kv.num_total_blocks
            snap.draft_num_sequences = _draft_sequences(proposer)
        self._snapshot = snap  # one reference swap: readers see a whole snapshot


def _draft_sequences(proposer: Any) -> int | None:
    """Sequences the draft keeps KV for: the in-process draft's mirrors, or those the SSD worker was told of."""
    for name in ("mirrors", "_told"):
        tracked = getattr(proposer, name, None)
        if isinstance(tracked, dict):
            return len(tracked)
    return None


_PARAM_NAMES = (
    "max_tokens", "min_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "stop", "logprobs",
)


def _param_of(message: str, default: str) -> str:
    """The request field a ValueError from the engine names (its messages start with the field name)."""
    first = message.split(" ", 1)[0]
    return first if first in _PARAM_NAMES else default
