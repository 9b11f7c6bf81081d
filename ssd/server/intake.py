"""From an HTTP request to running request streams, and back to an HTTP error when that fails.

Reading the body (size limit, JSON), checking the model name, submitting to the
:class:`~ssd.server.async_engine.AsyncEngine`, and waiting for non-streaming results while watching for the
client leaving. Each engine-side error is mapped here to OpenAI's error shape with the status that says
whose fault it is (400 bad input, 404 unknown model, 413 body too large, 499 client gone, 503 overloaded or
engine down, 500 engine fault), so the route handlers in :mod:`ssd.server.app` stay free of error plumbing.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from fastapi import Request

from ssd.server import protocol
from ssd.server.async_engine import AsyncEngine, RequestStream
from ssd.server.messages import (
    EngineDeadError,
    EngineOverloadedError,
    GenerationRequest,
    RequestRejectedError,
    StreamDelta,
)
from ssd.server.metrics import ServerMetrics
from ssd.server.protocol import ApiError

logger = logging.getLogger(__name__)


async def read_json(request: Request, limit: int) -> Any:
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


def unknown_model(name: str) -> ApiError:
    return ApiError(404, f"The model `{name}` does not exist.", "invalid_request_error", "model", "model_not_found")


def check_model(model: str | None, accepted: set[str]) -> None:
    if model is not None and model not in accepted:
        raise unknown_model(model)


async def submit(async_engine: AsyncEngine, requests: list[GenerationRequest],
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


def abort_all(streams: list[RequestStream]) -> None:
    for stream in streams:
        stream.abort()


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def collect_or_abort(request: Request, streams: list[RequestStream]) -> list[list[StreamDelta]]:
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
        abort_all(streams)  # no-op for finished ones
    for deltas in results:
        if deltas and deltas[-1].error is not None:
            raise ApiError(500, deltas[-1].error, "server_error")
    return results
