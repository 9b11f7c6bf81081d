"""The OpenAI-compatible HTTP API (FastAPI) around an :class:`~ssd.server.async_engine.AsyncEngine`.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with ``stream: true`` as server-sent
events in OpenAI's chunk format), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus).

Every error is OpenAI's JSON shape with a status that says whose fault it is: 400 for invalid parameters
(the parameter is named), 404 for an unknown model or path, 413 for an oversized body, 503 when the bounded
queue is full or the engine is down, 500 only for faults of the server itself. A client that disconnects
(or cancels a stream) aborts its request, which frees its target and draft KV blocks at the next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ssd.engine import LLMEngine
from ssd.outputs import SpecStats
from ssd.server import protocol
from ssd.server.async_engine import (
    AsyncEngine,
    EngineDeadError,
    EngineOverloadedError,
    GenerationRequest,
    RequestRejectedError,
    RequestStream,
    StreamDelta,
)
from ssd.server.metrics import CONTENT_TYPE, ServerMetrics
from ssd.server.protocol import ApiError, ParsedRequest

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
_KNOWN_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")


def create_app(
    engine: LLMEngine,
    served_model_name: str | None = None,
    max_waiting_requests: int = 256,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    own_engine: bool = True,
) -> FastAPI:
    """Build the app; the engine thread starts with the app (lifespan) and stops with it.

    ``served_model_name`` is the id clients pass as ``model`` (default: the checkpoint path); the checkpoint
    path is accepted too. ``own_engine``: shut the engine (and its draft worker) down when the app stops.
    """
    model_name = served_model_name or engine.config.model
    accepted_names = {model_name, engine.config.model}
    metrics = ServerMetrics(model_name)
    async_engine = AsyncEngine(engine, max_waiting_requests, metrics.observe_request, own_engine=own_engine)
    created = int(time.time())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        try:
            yield
        finally:
            async_engine.stop()

    app = FastAPI(title="ssd OpenAI-compatible server", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.async_engine = async_engine
    app.state.metrics = metrics
    app.state.model_name = model_name

    # ------------------------------------------------------------------ errors
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        headers = {"Retry-After": "1"} if exc.status == 503 else None
        return JSONResponse(exc.to_dict(), status_code=exc.status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        message = f"{request.method} {request.url.path}: {exc.detail}"
        return JSONResponse(ApiError(exc.status_code, message, kind).to_dict(), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _server_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        error = ApiError(500, f"internal server error: {type(exc).__name__}", "server_error")
        return JSONResponse(error.to_dict(), status_code=500)

    # ------------------------------------------------------------------ endpoints
    @app.get("/health")
    async def health() -> JSONResponse:
        if not async_engine.is_running:
            raise ApiError(503, async_engine.error or "the engine is not running", "server_error")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(async_engine.snapshot()), media_type=CONTENT_TYPE)

    def model_card() -> dict[str, Any]:
        return {
            "id": model_name,
            "object": "model",
            "created": created,
            "owned_by": "ssd",
            "root": engine.config.model,
            "max_model_len": engine.max_model_len,
        }

    @app.get("/v1/models")
    async def list_models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [model_card()]})

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> JSONResponse:
        if model_id not in accepted_names:
            raise _unknown_model(model_id)
        return JSONResponse(model_card())

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        parsed = protocol.parse_completion(await _read_json(request, max_body_bytes))
        _check_model(parsed.model, accepted_names)
        requests = [
            GenerationRequest(f"cmpl-{uuid.uuid4().hex}-{i}", params, prompt=prompt,
                              max_tokens_explicit=parsed.max_tokens_explicit)
            for i, (prompt, params) in enumerate(zip(parsed.prompts or [], parsed.params))
        ]
        streams = await _submit(async_engine, requests, metrics)
        response_id = f"cmpl-{uuid.uuid4().hex}"
        if parsed.stream:
            body = _completion_events(streams, parsed, response_id, model_name)
            return _EventStream(body, on_close=lambda: _abort_all(streams))
        deltas = await _collect_or_abort(request, streams)
        return JSONResponse(_completion_body(deltas, parsed, response_id, model_name))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        parsed = protocol.parse_chat(await _read_json(request, max_body_bytes), engine.max_model_len)
        _check_model(parsed.model, accepted_names)
        requests = [
            GenerationRequest(f"chatcmpl-{uuid.uuid4().hex}", parsed.params[0], messages=parsed.messages,
                              max_tokens_explicit=parsed.max_tokens_explicit, prompt_param="messages",
                              max_tokens_param=parsed.max_tokens_param)
        ]
        streams = await _submit(async_engine, requests, metrics)
        response_id = f"chatcmpl-{uuid.uuid4().hex}"
        if parsed.stream:
            body = _chat_events(streams[0], parsed, response_id, model_name)
            return _EventStream(body, on_close=lambda: _abort_all(streams))
        deltas = await _collect_or_abort(request, streams)
        return JSONResponse(_chat_body(deltas[0], parsed, response_id, model_name))

    app.add_middleware(_HttpMetrics, metrics=metrics)
    return app


# --------------------------------------------------------------------------------------------- helpers
class _HttpMetrics:
    """ASGI wrapper counting responses by path and status (pure ASGI: it must not buffer streams)."""

    def __init__(self, app: Callable, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = {"code": 500}

        async def send_wrapper(message: dict) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            path = scope.get("path", "")
            self.metrics.observe_http(path if path in _KNOWN_PATHS else "other", status["code"])


class _EventStream(StreamingResponse):
    """Server-sent events whose producer's requests are aborted however the response ends (disconnect too)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()


async def _read_json(request: Request, limit: int) -> Any:
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise ApiError(413, f"request body of {length} bytes is larger than the limit of {limit} bytes",
                       code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"request body is larger than the limit of {limit} bytes", code="request_too_large")
        chunks.append(chunk)
    body = b"".join(chunks)
    if not body:
        raise protocol.invalid("the request body is empty; send a JSON object")
    try:
        return json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise protocol.invalid(f"the request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise protocol.invalid("the request body is nested too deeply") from None


def _unknown_model(name: str) -> ApiError:
    return ApiError(404, f"The model `{name}` does not exist.", "invalid_request_error", "model", "model_not_found")


def _check_model(model: str | None, accepted: set[str]) -> None:
    if model is not None and model not in accepted:
        raise _unknown_model(model)


async def _submit(async_engine: AsyncEngine, requests: list[GenerationRequest],
                  metrics: ServerMetrics) -> list[RequestStream]:
    try:
        return await async_engine.submit_all(requests)
    except EngineOverloadedError as exc:
        metrics.observe_overloaded()
        raise ApiError(503, str(exc), "server_overloaded", code="overloaded") from None
    except EngineDeadError as exc:
        raise ApiError(503, str(exc), "server_error", code="engine_unavailable") from None
    except RequestRejectedError as exc:
        raise protocol.invalid(str(exc), exc.param, exc.code) from None


def _abort_all(streams: list[RequestStream]) -> None:
    for stream in streams:
        stream.abort()


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _collect_or_abort(request: Request, streams: list[RequestStream]) -> list[list[StreamDelta]]:
    """Wait for every stream to finish, unless the client leaves first (then abort them all)."""
    work = asyncio.ensure_future(asyncio.gather(*(s.collect() for s in streams)))
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if work not in done:
            work.cancel()
            logger.info("client disconnected; aborted %d request(s)", len(streams))
            raise ApiError(499, "client disconnected", "client_closed_request")
        try:
            results = work.result()
        except EngineDeadError as exc:
            raise ApiError(503, str(exc), "server_error", code="engine_unavailable") from None
    finally:
        watcher.cancel()
        _abort_all(streams)  # no-op for finished ones
    for deltas in results:
        if deltas and deltas[-1].error is not None:
            raise ApiError(500, deltas[-1].error, "server_error")
    return results


def _merged_stats(finals: list[StreamDelta]) -> SpecStats | None:
    stats = [d.spec_stats for d in finals if d.spec_stats is not None]
    if not stats:
        return None
    total = SpecStats()
    for s in stats:
        total.merge(s)
    return total


def _usage(finals: list[StreamDelta]) -> dict[str, Any]:
    return protocol.usage_dict(
        sum(d.num_prompt_tokens for d in finals),
        sum(d.num_output_tokens for d in finals),
        sum(d.num_cached_prompt_tokens for d in finals),
        _merged_stats(finals),
        finals[0].speculation if finals else "off",
    )


def _completion_body(results: list[list[StreamDelta]], parsed: ParsedRequest, response_id: str,
                     model: str) -> dict[str, Any]:
    choices = []
    for index, deltas in enumerate(results):
        text = "".join(d.text for d in deltas)
        logprobs = None
        if parsed.logprobs:
            logprobs = protocol.completion_logprobs([e for d in deltas for e in (d.logprobs or [])], 0)
        choices.append({"index": index, "text": text, "logprobs": logprobs, "finish_reason": deltas[-1].finish_reason})
    return {
        "id": response_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": _usage([deltas[-1] for deltas in results]),
    }


def _chat_body(deltas: list[StreamDelta], parsed: ParsedRequest, response_id: str, model: str) -> dict[str, Any]:
    logprobs = None
    if parsed.logprobs:
        logprobs = protocol.chat_logprobs([e for d in deltas for e in (d.logprobs or [])])
    return {
        "id": response_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "".join(d.text for d in deltas)},
                "logprobs": logprobs,
                "finish_reason": deltas[-1].finish_reason,
            }
        ],
        "usage": _usage([deltas[-1]]),
    }


def _event(data: dict[str, Any] | str) -> str:
    payload = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
    return f"data: {payload}\n\n"


def _stream_error(delta: StreamDelta | None, exc: BaseException | None = None) -> str:
    message = (delta.error if delta is not None else None) or f"{type(exc).__name__}: {exc}"
    return _event(ApiError(500, message, "server_error").to_dict())


async def _merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, StreamDelta]]:
    """Deltas of several streams as they come, tagged with the stream's index."""
    if len(streams) == 1:
        async for delta in streams[0]:
            yield 0, delta
        return
    queue: asyncio.Queue[Any] = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for delta in stream:
                await queue.put((index, delta))
        except Exception as exc:  # handed to the consumer
            await queue.put(exc)

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            item = await queue.get()
            if isinstance(item, Exception):
                raise item
            if item[1].finished:
                remaining -= 1
            yield item
    finally:
        for task in tasks:
            task.cancel()


async def _completion_events(streams: list[RequestStream], parsed: ParsedRequest, response_id: str,
                             model: str) -> AsyncIterator[str]:
    created = int(time.time())
    finals: list[StreamDelta] = []
    offsets = [0] * len(streams)
    try:
        async for index, delta in _merge(streams):
            if delta.error is not None:
                yield _stream_error(delta)
                break
            if not (delta.text or delta.finished or delta.logprobs):
                continue
            logprobs = None
            if parsed.logprobs:
                logprobs = protocol.completion_logprobs(delta.logprobs or [], offsets[index])
            offsets[index] += len(delta.text)
            chunk: dict[str, Any] = {
                "id": response_id,
                "object": "text_completion",
                "created": created,
                "model": model,
                "choices": [{"index": index, "text": delta.text, "logprobs": logprobs,
                             "finish_reason": delta.finish_reason if delta.finished else None}],
            }
            if parsed.include_usage:
                chunk["usage"] = None
            yield _event(chunk)
            if delta.finished:
                finals.append(delta)
        else:
            if parsed.include_usage:
                yield _event({"id": response_id, "object": "text_completion", "created": created, "model": model,
                              "choices": [], "usage": _usage(finals)})
    except EngineDeadError as exc:
        yield _stream_error(None, exc)
    yield _event("[DONE]")


async def _chat_events(stream: RequestStream, parsed: ParsedRequest, response_id: str,
                       model: str) -> AsyncIterator[str]:
    created = int(time.time())
    base = {"id": response_id, "object": "chat.completion.chunk", "created": created, "model": model}

    def chunk(delta: dict[str, Any], finish_reason: str | None = None, logprobs: Any = None) -> str:
        data: dict[str, Any] = dict(base)
        data["choices"] = [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]
        if parsed.include_usage:
            data["usage"] = None
        return _event(data)

    yield chunk({"role": "assistant", "content": ""})
    final: StreamDelta | None = None
    try:
        async for delta in stream:
            if delta.error is not None:
                yield _stream_error(delta)
                break
            logprobs = protocol.chat_logprobs(delta.logprobs or []) if parsed.logprobs else None
            if delta.text or delta.logprobs:
                yield chunk({"content": delta.text}, None, logprobs)
            if delta.finished:
                final = delta
                yield chunk({}, delta.finish_reason)
        else:
            if parsed.include_usage and final is not None:
                yield _event(dict(base, choices=[], usage=_usage([final])))
    except EngineDeadError as exc:
        yield _stream_error(None, exc)
    yield _event("[DONE]")


# --------------------------------------------------------------------------------------------- running
def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket; port 0 picks a free one (read it back with ``getsockname``)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {exc}") from exc
    sock.listen(2048)
    sock.setblocking(False)
    return sock


class BackgroundServer:
    """Runs an app under uvicorn in a background thread (tests, benchmarks, ``ssd chat`` with a local server)."""

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning") -> None:
        import uvicorn

        self._sock = bind_socket(host, port)
        self.host = host
        self.port = self._sock.getsockname()[1]
        self._server = uvicorn.Server(uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=5))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]},
                                        name="ssd-http", daemon=True)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self, timeout: float = 60.0) -> "BackgroundServer":
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the HTTP server did not start")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        self._server.should_exit = True
        self._thread.join(timeout)
        self._sock.close()

    def __enter__(self) -> "BackgroundServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
