"""An asyncio front for the synchronous :class:`~ssd.engine.LLMEngine`: request queueing and streams.

The engine is not thread-safe, and its step is long blocking compute, so it gets one thread of its own
(:class:`~ssd.server.engine_loop.EngineLoop`) that does everything that touches it. This module is the
event-loop side: :class:`AsyncEngine` starts and stops that thread, queues commands for it on a thread-safe
queue, and keeps one :class:`RequestStream` per request, an asyncio queue that the thread fills with
``loop.call_soon_threadsafe``. New requests join the running batch between steps (continuous batching).

Backpressure: at most ``max_num_seqs + max_waiting_requests`` requests may be in flight; one more is refused
at once with :class:`EngineOverloadedError` (HTTP 503) rather than queued without bound.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from ssd.engine import LLMEngine
from ssd.outputs import RequestMetrics
from ssd.server.engine_loop import EngineLoop
from ssd.server.messages import (
    STOP_COMMAND,
    AbortCommand,
    AddCommand,
    Admission,
    EngineDeadError,
    EngineOverloadedError,
    EngineSnapshot,
    FinishedRequest,
    GenerationRequest,
    LogprobEntry,
    Rejection,
    RequestRejectedError,
    StreamDelta,
)

__all__ = [  # the request types and errors are part of this front's API; they live in ssd.server.messages
    "Admission",
    "AsyncEngine",
    "EngineDeadError",
    "EngineOverloadedError",
    "EngineSnapshot",
    "FinishedRequest",
    "GenerationRequest",
    "LogprobEntry",
    "RequestRejectedError",
    "RequestStream",
    "StreamDelta",
]

logger = logging.getLogger(__name__)


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
        elif isinstance(item, (Rejection, BaseException)):
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
        self._worker = EngineLoop(engine, self._post)  # runs on the engine thread
        self._commands = self._worker.commands
        self._streams: dict[str, RequestStream] = {}  # requests not yet ended
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Start the engine thread; call from the event loop that will submit requests."""
        if self._thread is not None:
            raise RuntimeError("AsyncEngine already started")
        self._loop = asyncio.get_running_loop()
        self._worker.publish_snapshot()
        self._thread = threading.Thread(target=self._worker.run, name="ssd-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the engine thread (pending requests fail with :class:`EngineDeadError`)."""
        thread, self._thread = self._thread, None
        if thread is not None:
            self._commands.put(STOP_COMMAND)
            thread.join(timeout)
            if thread.is_alive():
                logger.error("engine thread did not stop within %.0f s", timeout)
        for stream in list(self._streams.values()):
            stream._deliver(EngineDeadError("the server is shutting down"))
        if self.own_engine:
            self.engine.shutdown()

    @property
    def error(self) -> str | None:
        """Why the engine thread died, if it did."""
        return self._worker.error

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    def snapshot(self) -> EngineSnapshot:
        snap = self._worker.snapshot
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
        self._commands.put(AddCommand(request, stream))
        try:
            first = await stream._queue.get()
        except BaseException:  # cancelled while waiting (client gone): the engine may already have it
            stream.abort()
            raise
        if isinstance(first, Rejection):
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
        self._commands.put(AbortCommand(stream.request_id))

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
        """Engine thread -> loop thread (the :class:`EngineLoop`'s ``post``)."""
        loop = self._loop
        if loop is None or loop.is_closed():
            return
        try:
            loop.call_soon_threadsafe(stream._deliver, item)
        except RuntimeError:  # loop closed between the check and the call (shutdown)
            pass
