"""The OpenAI-compatible HTTP API (FastAPI) around an :class:`~ssd.server.async_engine.AsyncEngine`.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with ``stream: true`` as server-sent
events in OpenAI's chunk format), ``GET /v1/models``, ``GET /health``, ``GET /metrics`` (Prometheus).

Every error is OpenAI's JSON shape with a status that says whose fault it is: 400 for invalid parameters
(the parameter is named), 404 for an unknown model or path, 413 for an oversized body, 503 when the bounded
queue is full or the engine is down, 500 only for faults of the server itself. A client that disconnects
(or cancels a stream) aborts its request, which frees its target and draft KV blocks at the next step.

This module holds the routes and the HTTP plumbing around them (error handlers, the metrics middleware, the
event-stream response that aborts its requests on disconnect). Request intake and error mapping live in
:mod:`ssd.server.intake`, response shapes in :mod:`ssd.server.responses`, background running in
:mod:`ssd.server.serving` (``BackgroundServer`` and ``bind_socket`` are importable from here too).
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ssd.engine import LLMEngine
from ssd.server import protocol
from ssd.server.async_engine import AsyncEngine
from ssd.server.intake import abort_all, check_model, collect_or_abort, read_json, submit, unknown_model
from ssd.server.messages import GenerationRequest
from ssd.server.metrics import CONTENT_TYPE, ServerMetrics
from ssd.server.protocol import ApiError
from ssd.server.responses import chat_body, chat_events, completion_body, completion_events
from ssd.server.serving import BackgroundServer, bind_socket

__all__ = ["BackgroundServer", "DEFAULT_MAX_BODY_BYTES", "bind_socket", "create_app"]  # serving: re-exported

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
            raise unknown_model(model_id)
        return JSONResponse(model_card())

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        parsed = protocol.parse_completion(await read_json(request, max_body_bytes))
        check_model(parsed.model, accepted_names)
        requests = [
            GenerationRequest(f"cmpl-{uuid.uuid4().hex}-{i}", params, prompt=prompt,
                              max_tokens_explicit=parsed.max_tokens_explicit,
                              structured_param=parsed.structured_param)
            for i, (prompt, params) in enumerate(zip(parsed.prompts or [], parsed.params))
        ]
        streams = await submit(async_engine, requests, metrics)
        response_id = f"cmpl-{uuid.uuid4().hex}"
        if parsed.stream:
            body = completion_events(streams, parsed, response_id, model_name)
            return _EventStream(body, on_close=lambda: abort_all(streams))
        deltas = await collect_or_abort(request, streams)
        return JSONResponse(completion_body(deltas, parsed, response_id, model_name))

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        parsed = protocol.parse_chat(await read_json(request, max_body_bytes), engine.max_model_len)
        check_model(parsed.model, accepted_names)
        requests = [
            GenerationRequest(f"chatcmpl-{uuid.uuid4().hex}-{i}", params, messages=parsed.messages,
                              max_tokens_explicit=parsed.max_tokens_explicit, prompt_param="messages",
                              max_tokens_param=parsed.max_tokens_param, structured_param=parsed.structured_param)
            for i, params in enumerate(parsed.params)  # one per choice
        ]
        streams = await submit(async_engine, requests, metrics)
        response_id = f"chatcmpl-{uuid.uuid4().hex}"
        if parsed.stream:
            body = chat_events(streams, parsed, response_id, model_name)
            return _EventStream(body, on_close=lambda: abort_all(streams))
        deltas = await collect_or_abort(request, streams)
        return JSONResponse(chat_body(deltas, parsed, response_id, model_name))

    app.add_middleware(_HttpMetrics, metrics=metrics)
    return app


# --------------------------------------------------------------------------------------------- plumbing
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
