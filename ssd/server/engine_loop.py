"""The engine thread of the server's async engine: everything that touches the :class:`~ssd.engine.LLMEngine`.

The engine is not thread-safe and its step is long blocking compute, so one thread does all of it:
tokenizing and validating prompts (a request the engine refuses becomes a :class:`Rejection`, with the field
at fault named), adding and aborting requests, stepping, turning outputs into :class:`StreamDelta` items
(logprob tokens detokenized here), and taking the :class:`EngineSnapshot` that ``/metrics`` reads. It learns
of work through :attr:`EngineLoop.commands` and answers through the ``post`` callable it is given, which
hands each item to the event loop. Kept apart from :mod:`ssd.server.async_engine`, the event-loop side, so
that which thread runs which code is visible from the module alone.
"""

from __future__ import annotations

import copy
import logging
import queue
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ssd.engine import LLMEngine
from ssd.request import EncodedPrompt
from ssd.outputs import RequestOutput, TokenLogprob
from ssd.server.messages import (
    STOP_COMMAND,
    AbortCommand,
    AddCommand,
    Admission,
    EngineDeadError,
    EngineSnapshot,
    GenerationRequest,
    LogprobEntry,
    Rejection,
    RequestRejectedError,
    StreamDelta,
)

if TYPE_CHECKING:
    from ssd.server.async_engine import RequestStream

logger = logging.getLogger(__name__)


class EngineLoop:
    """The engine thread's state and loop; :meth:`run` is the thread's target.

    ``post(stream, item)`` delivers an item (:class:`Admission`, :class:`Rejection`, :class:`StreamDelta` or an
    exception) to a stream on the event loop; it must be safe to call from this thread.
    """

    def __init__(self, engine: LLMEngine, post: Callable[[RequestStream, Any], None]) -> None:
        self.engine = engine
        self.max_model_len = engine.max_model_len
        self.commands: queue.Queue[Any] = queue.Queue()
        self.snapshot = EngineSnapshot()  # replaced whole after each step; read from the event loop
        self.error: str | None = None  # why the thread died, if it did
        self._post = post
        self._streams: dict[str, RequestStream] = {}  # requests it is serving
        self._num_steps = 0

    def run(self) -> None:
        """The thread's body: apply commands, step while anything is unfinished, publish a snapshot."""
        try:
            while True:
                if not self._drain_commands(block=not self.engine.has_unfinished()):
                    break
                if self.engine.has_unfinished():
                    self._step()
                self.publish_snapshot()
        except BaseException as exc:  # a bug in the loop itself: fail everyone, report unhealthy
            logger.exception("engine thread died")
            self.error = f"engine thread died: {type(exc).__name__}: {exc}"
            doomed = list(self._streams.values())
            self._streams.clear()
            while True:  # requests still queued would otherwise wait forever for their admission
                try:
                    command = self.commands.get_nowait()
                except queue.Empty:
                    break
                if isinstance(command, AddCommand):
                    doomed.append(command.stream)
            for stream in doomed:
                self._post(stream, EngineDeadError(self.error))

    def _drain_commands(self, block: bool) -> bool:
        """Apply queued commands; False once asked to stop."""
        while True:
            try:
                command = self.commands.get(block=block)
            except queue.Empty:
                return True
            block = False
            if command is STOP_COMMAND:
                for request_id in list(self._streams):
                    self.engine.abort(request_id)
                self._streams.clear()
                return False
            if isinstance(command, AddCommand):
                self._add(command.request, command.stream)
            elif isinstance(command, AbortCommand):
                if self._streams.pop(command.request_id, None) is not None:
                    self.engine.abort(command.request_id)

    def _add(self, request: GenerationRequest, stream: RequestStream) -> None:
        if stream.finished:  # aborted before it reached the engine
            return
        try:
            encoded = self._encode(request)
            self._fit_max_tokens(request, len(encoded.token_ids))
            self.engine.add_request(encoded, request.params, request.request_id)
        except RequestRejectedError as exc:
            self._post(stream, Rejection(exc))
            return
        except ValueError as exc:
            message = str(exc)
            param = request.structured_param if message.startswith("structured outputs") else None
            self._post(stream, Rejection(RequestRejectedError(message, param or _param_of(message,
                                                                                          request.prompt_param))))
            return
        except Exception as exc:  # e.g. a chat template that raises on this conversation: the input's fault
            logger.warning("request %s could not be prepared: %s", request.request_id, exc, exc_info=True)
            message = f"cannot prepare the {request.prompt_param}: {type(exc).__name__}: {exc}"
            self._post(stream, Rejection(RequestRejectedError(message, request.prompt_param)))
            return
        self._streams[request.request_id] = stream
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
            logger.exception("engine step failed; failing the %d requests in flight", len(self._streams))
            message = f"engine step failed: {type(exc).__name__}: {exc}"
            for request_id, stream in list(self._streams.items()):
                try:
                    self.engine.abort(request_id)
                except Exception:
                    logger.exception("abort of %s failed after a step error", request_id)
                self._post(stream, StreamDelta("", [], True, "error", error=message))
            self._streams.clear()
            return
        self._num_steps += 1
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            delta = self._delta(output, stream)
            if output.finished:
                del self._streams[output.request_id]
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

    def _logprob_entry(self, lp: TokenLogprob) -> LogprobEntry:
        decode = self.engine.tokenizer.decode
        top = [(t, decode([t], skip_special_tokens=False), v) for t, v in (lp.top or {}).items()]
        top.sort(key=lambda item: -item[2])
        return LogprobEntry(lp.token_id, decode([lp.token_id], skip_special_tokens=False), lp.logprob, top)

    def publish_snapshot(self) -> None:
        """Take the state ``/metrics`` and ``/health`` read (engine thread, or before it starts)."""
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
        self.snapshot = snap  # one reference swap: readers see a whole snapshot


def _draft_sequences(proposer: Any) -> int | None:
    """Sequences the draft keeps KV for: the in-process draft's mirrors, or those the SSD worker was told of."""
    for name in ("mirrors", "_told"):
        tracked = getattr(proposer, name, None)
        if isinstance(tracked, dict):
            return len(tracked)
    return None


_PARAM_NAMES = (
    "max_tokens", "min_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "stop", "logprobs",
    "logit_bias",
)


def _param_of(message: str, default: str) -> str:
    """The request field a ValueError from the engine names (its messages start with the field name)."""
    first = message.split(" ", 1)[0]
    return first if first in _PARAM_NAMES else default
