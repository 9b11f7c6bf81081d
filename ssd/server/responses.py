"""OpenAI response bodies built from the :class:`~ssd.server.messages.StreamDelta` items of finished requests,
and the server-sent-event streams of ``stream: true`` requests (OpenAI's chunk format, ending in ``[DONE]``).

Separate from the route handlers because these are pure shape conversions (no HTTP, no engine): the usage
block (speculative statistics merged over the choices), logprobs, finish reasons, and error events that end
a stream whose request failed midway.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from ssd.outputs import SpecStats
from ssd.server import response_fields
from ssd.server.async_engine import RequestStream
from ssd.server.messages import EngineDeadError, StreamDelta
from ssd.server.protocol import ApiError, ParsedRequest


def _merged_stats(finals: list[StreamDelta]) -> SpecStats | None:
    stats = [d.spec_stats for d in finals if d.spec_stats is not None]
    if not stats:
        return None
    total = SpecStats()
    for s in stats:
        total.merge(s)
    return total


def _metrics(finals: list[StreamDelta]) -> dict[str, Any] | None:
    return response_fields.response_metrics(_merged_stats(finals), len(finals))


def _usage(finals: list[StreamDelta]) -> dict[str, Any]:
    return response_fields.usage_dict(
        sum(d.num_prompt_tokens for d in finals),
        sum(d.num_output_tokens for d in finals),
        sum(d.num_cached_prompt_tokens for d in finals),
        _merged_stats(finals),
        finals[0].speculation if finals else "off",
        sum(d.metrics.num_first_step_tokens for d in finals if d.metrics is not None),
    )


def best_choices(results: list[list[StreamDelta]], parsed: ParsedRequest) -> list[list[StreamDelta]]:
    """Of each prompt's ``best_of`` candidates, the ``n`` with the highest cumulative logprob (by that, then in
    candidate order)."""
    if parsed.best_of == parsed.n:
        return results
    kept = []
    for start in range(0, len(results), parsed.best_of):
        candidates = results[start : start + parsed.best_of]
        score = [sum(e.logprob for d in deltas for e in (d.logprobs or [])) for deltas in candidates]
        best = sorted(range(len(candidates)), key=lambda i: -score[i])[: parsed.n]
        kept.extend(candidates[i] for i in sorted(best))
    return kept


def completion_body(results: list[list[StreamDelta]], parsed: ParsedRequest, response_id: str,
                     model: str) -> dict[str, Any]:
    """``results`` holds every candidate (all of them count in usage); the choices are the best (``best_of``)."""
    choices = []
    for index, deltas in enumerate(best_choices(results, parsed)):
        text = "".join(d.text for d in deltas)
        logprobs = None
        if parsed.logprobs:
            logprobs = response_fields.completion_logprobs([e for d in deltas for e in (d.logprobs or [])], 0)
        choices.append({"index": index, "text": text, "logprobs": logprobs, "finish_reason": deltas[-1].finish_reason})
    return {
        "id": response_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": _usage([deltas[-1] for deltas in results]),
        "metrics": _metrics([deltas[-1] for deltas in results]),
    }


def chat_body(results: list[list[StreamDelta]], parsed: ParsedRequest, response_id: str,
              model: str) -> dict[str, Any]:
    choices = []
    for index, deltas in enumerate(results):
        logprobs = None
        if parsed.logprobs:
            logprobs = response_fields.chat_logprobs([e for d in deltas for e in (d.logprobs or [])])
        choices.append({
            "index": index,
            "message": {"role": "assistant", "content": "".join(d.text for d in deltas)},
            "logprobs": logprobs,
            "finish_reason": deltas[-1].finish_reason,
        })
    return {
        "id": response_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
        "usage": _usage([deltas[-1] for deltas in results]),
        "metrics": _metrics([deltas[-1] for deltas in results]),
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


async def completion_events(streams: list[RequestStream], parsed: ParsedRequest, response_id: str,
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
                logprobs = response_fields.completion_logprobs(delta.logprobs or [], offsets[index])
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
                              "choices": [], "usage": _usage(finals), "metrics": _metrics(finals)})
    except EngineDeadError as exc:
        yield _stream_error(None, exc)
    yield _event("[DONE]")


async def chat_events(streams: list[RequestStream], parsed: ParsedRequest, response_id: str,
                       model: str) -> AsyncIterator[str]:
    created = int(time.time())
    base = {"id": response_id, "object": "chat.completion.chunk", "created": created, "model": model}

    def chunk(index: int, delta: dict[str, Any], finish_reason: str | None = None, logprobs: Any = None) -> str:
        data: dict[str, Any] = dict(base)
        data["choices"] = [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]
        if parsed.include_usage:
            data["usage"] = None
        return _event(data)

    for index in range(len(streams)):
        yield chunk(index, {"role": "assistant", "content": ""})
    finals: list[StreamDelta] = []
    try:
        async for index, delta in _merge(streams):
            if delta.error is not None:
                yield _stream_error(delta)
                break
            logprobs = response_fields.chat_logprobs(delta.logprobs or []) if parsed.logprobs else None
            if delta.text or delta.logprobs:
                yield chunk(index, {"content": delta.text}, None, logprobs)
            if delta.finished:
                finals.append(delta)
                yield chunk(index, {}, delta.finish_reason)
        else:
            if parsed.include_usage and finals:
                yield _event(dict(base, choices=[], usage=_usage(finals), metrics=_metrics(finals)))
    except EngineDeadError as exc:
        yield _stream_error(None, exc)
    yield _event("[DONE]")
