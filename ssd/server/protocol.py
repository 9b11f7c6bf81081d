"""OpenAI request parsing for the server (the response fields are in :mod:`ssd.server.response_fields`).

Requests are validated strictly (wrong JSON types, unknown fields and unsupported options are 400 errors
that name the field) because silently ignoring an option a client relies on (``n=3``, ``tools``) gives wrong
results that are hard to trace. Options that do not change the output (``user``, ``metadata``) are accepted
and ignored. Extensions beyond OpenAI use vLLM's names (``top_k``, ``min_tokens``, ``ignore_eos``, ...).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from ssd.sampling_params import SamplingParams
from ssd.structured.spec import StructuredOutputs

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_CHOICES = 16  # the most choices (n) one request may ask for per prompt


class ApiError(Exception):
    """An error answered with OpenAI's JSON shape ``{"error": {message, type, param, code}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code

    def to_dict(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param, code)


# --------------------------------------------------------------------------------------------- models
class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None


class _Common(_Strict):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: Any = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None
    user: str | None = None
    # vLLM-style extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    # structured outputs: OpenAI's response_format, or vLLM's structured_outputs / guided_* extensions
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_choice: list[str] | None = None


class CompletionRequest(_Common):
    prompt: Any = None
    logprobs: int | None = None
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None


class ChatMessage(BaseModel):
    """Extra keys (``tool_calls: null``, ``refusal``) are allowed: clients echo whole response messages back."""

    model_config = ConfigDict(extra="allow", strict=True)
    role: str
    content: Any = None
    name: str | None = None


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    # accepted and ignored: they do not change the output
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    parallel_tool_calls: bool | None = None
    # accepted only with values that mean "not used"
    modalities: list[str] | None = None
    tool_choice: Any = None
    tools: list[Any] | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    audio: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None
    verbosity: Any = None
    moderation: Any = None
    prompt_cache_options: Any = None
    prompt_cache_retention: Any = None


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


# --------------------------------------------------------------------------------------------- parsing
def _param_path(loc: tuple[Any, ...]) -> str:
    path = ""
    for part in loc:
        path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
    return path


def _validate(model: type[BaseModel], body: Any) -> Any:
    if not isinstance(body, dict):
        raise invalid(f"the request body must be a JSON object, got {type(body).__name__}")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        error = exc.errors()[0]
        param = _param_path(tuple(error["loc"]))
        if error["type"] == "extra_forbidden":
            raise invalid(f"Unrecognized request argument supplied: {param}", param) from None
        if error["type"] == "missing":
            raise invalid(f"'{param}' is a required property", param) from None
        got = repr(error.get("input"))
        got = got if len(got) <= 80 else got[:77] + "..."
        raise invalid(f"invalid value for '{param}': {error['msg']} (got {got})", param) from None


def _unsupported(name: str, value: Any, allowed: tuple[Any, ...], what: str) -> None:
    if value is not None and value not in allowed:
        raise invalid(f"'{name}' is not supported by this server ({what}); got {value!r}", name)


def _check_common(req: _Common) -> None:
    if req.n is not None and not 1 <= req.n <= MAX_CHOICES:
        raise invalid(f"'n' must be an integer in [1, {MAX_CHOICES}], got {req.n}", "n")
    if req.stream_options is not None and not req.stream:
        raise invalid("'stream_options' is only allowed when 'stream' is true", "stream_options")


def _stop_list(value: Any) -> list[str] | None:
    if value is None:
        return None
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) and s for s in value):
        raise invalid(f"'stop' must be a non-empty string or a list of non-empty strings, got {value!r}", "stop")
    return value


def _choices(req: _Common, max_tokens: int, logprobs: int | None, max_tokens_param: str,
             constraint: StructuredOutputs | None, count: int | None = None) -> list[SamplingParams]:
    """One prompt's ``count`` (default ``n``) choices: the request's options, the seed (if any) advanced by one per
    choice so the choices are independent and each reproducible."""
    params = _sampling(req, max_tokens, logprobs, max_tokens_param, constraint)
    out = [params]
    for i in range(1, count or req.n or 1):
        choice = params.clone()
        if params.seed is not None:
            choice.seed = (params.seed + i) % 2**64
        out.append(choice)
    return out


_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_grammar": "grammar", "guided_choice": "choice"}


def structured_outputs(req: _Common) -> tuple[StructuredOutputs | None, str | None]:
    """The request's output constraint and the field it came from (errors name it): ``response_format``
    (``json_object``, ``json_schema``; ``text`` means none), ``structured_outputs`` or one ``guided_*`` field."""
    given: list[tuple[str, dict[str, Any]]] = []
    fmt = req.response_format
    if fmt is not None:
        kind = fmt.get("type")
        if kind == "json_object":
            given.append(("response_format", {"json_object": True}))
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
                raise invalid("'response_format' of type 'json_schema' needs 'json_schema': {'name': ..., "
                              "'schema': {...}}", "response_format.json_schema")
            given.append(("response_format", {"json": spec["schema"]}))
        elif kind != "text":
            raise invalid(f"'response_format.type' must be 'text', 'json_object' or 'json_schema', got {kind!r}",
                          "response_format.type")
    if req.structured_outputs is not None:
        given.append(("structured_outputs", req.structured_outputs))
    for name, kind in _GUIDED.items():
        value = getattr(req, name)
        if value is not None:
            given.append((name, {kind: value}))
    if not given:
        return None, None
    if len(given) > 1:
        names = [name for name, _ in given]
        raise invalid(f"give one output constraint, not several: {', '.join(names)}", names[1])
    param, value = given[0]
    try:
        return StructuredOutputs.from_value(value), param
    except ValueError as exc:
        raise invalid(str(exc), param) from None


def _sampling(req: _Common, max_tokens: int, logprobs: int | None, max_tokens_param: str,
              constraint: StructuredOutputs | None) -> SamplingParams:
    options: dict[str, Any] = dict(
        max_tokens=max_tokens,
        temperature=1.0 if req.temperature is None else req.temperature,
        top_p=1.0 if req.top_p is None else req.top_p,
        top_k=0 if req.top_k is None else req.top_k,
        min_p=0.0 if req.min_p is None else req.min_p,
        presence_penalty=0.0 if req.presence_penalty is None else req.presence_penalty,
        frequency_penalty=0.0 if req.frequency_penalty is None else req.frequency_penalty,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        logit_bias=req.logit_bias,
        seed=req.seed,
        min_tokens=req.min_tokens or 0,
        stop=_stop_list(req.stop),
        stop_token_ids=req.stop_token_ids or [],
        ignore_eos=bool(req.ignore_eos),
        logprobs=logprobs,
        include_stop_str_in_output=bool(req.include_stop_str_in_output),
        skip_special_tokens=True if req.skip_special_tokens is None else req.skip_special_tokens,
        structured_outputs=constraint,
    )
    try:
        return SamplingParams(**options)
    except ValueError as exc:
        message = str(exc)
        field = message.split(" ", 1)[0]
        param = max_tokens_param if field == "max_tokens" else (field if field in options else None)
        raise invalid(message, param) from None


@dataclass
class ParsedRequest:
    """What the endpoint needs after validation: prompts (one per choice) and their sampling options."""

    model: str | None
    prompts: list[str | list[int]] | None  # completions
    messages: list[dict[str, Any]] | None  # chat
    params: list[SamplingParams]  # one per choice (each request needs its own, the engine adjusts it)
    max_tokens_explicit: bool
    max_tokens_param: str
    stream: bool
    include_usage: bool
    logprobs: bool
    best_of: int = 1  # candidates per prompt (params holds them all); the n = len(params) / prompts / best_of
    n: int = 1  # ... with the highest cumulative logprob are returned
    structured_param: str | None = None  # the field the output constraint came from (errors compiling it name it)


def parse_completion(body: Any) -> ParsedRequest:
    req: CompletionRequest = _validate(CompletionRequest, body)
    _check_common(req)
    _unsupported("echo", req.echo, (False,), "echo=false only")
    _unsupported("suffix", req.suffix, ("",), "no suffix")
    n = req.n or 1
    best_of = n if req.best_of is None else req.best_of
    if not n <= best_of <= MAX_CHOICES:
        raise invalid(f"'best_of' must be an integer in [n = {n}, {MAX_CHOICES}], got {best_of}", "best_of")
    if best_of > n and req.stream:
        raise invalid("'best_of' greater than 'n' cannot be streamed (the best are known at the end)", "best_of")
    prompts = _prompts(req.prompt)
    explicit = req.max_tokens is not None
    max_tokens = req.max_tokens if explicit else COMPLETION_DEFAULT_MAX_TOKENS
    # candidates are ranked by their tokens' logprobs: ask for them (they are dropped unless the request wants them)
    logprobs = req.logprobs if best_of == n or req.logprobs is not None else 0
    constraint, constraint_param = structured_outputs(req)
    params = [choice for _ in prompts
              for choice in _choices(req, max_tokens, logprobs, "max_tokens", constraint, best_of)]
    prompts = [prompt for prompt in prompts for _ in range(best_of)]  # choice i*n + j: prompt i's j-th
    return ParsedRequest(
        req.model, prompts, None, params, explicit, "max_tokens", bool(req.stream), _include_usage(req),
        req.logprobs is not None, best_of, n, constraint_param,
    )


def _prompts(prompt: Any) -> list[str | list[int]]:
    message = "'prompt' must be a string, a list of strings, a list of token ids, or a list of token id lists"
    if prompt is None:
        raise invalid("'prompt' is a required property", "prompt")
    if isinstance(prompt, str):
        return [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise invalid(f"{message}, and not empty; got {prompt!r}"[:300], "prompt")
    if all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return [prompt]
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if all(isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p) for p in prompt):
        return list(prompt)
    raise invalid(f"{message}; got {prompt!r}"[:300], "prompt")


def parse_chat(body: Any, max_model_len: int) -> ParsedRequest:
    """``max_model_len`` caps the default limit (the engine lowers it to the room the prompt leaves)."""
    req: ChatCompletionRequest = _validate(ChatCompletionRequest, body)
    _check_common(req)
    _unsupported("tools", req.tools, ([],), "no tool calling")
    _unsupported("functions", req.functions, ([],), "no function calling")
    _unsupported("tool_choice", req.tool_choice, ("none",), "no tool calling")
    _unsupported("function_call", req.function_call, ("none",), "no function calling")
    _unsupported("modalities", req.modalities, (["text"],), "text only")
    for name in ("audio", "prediction", "reasoning_effort", "web_search_options", "verbosity", "moderation",
                 "prompt_cache_options", "prompt_cache_retention"):
        _unsupported(name, getattr(req, name), (), "not implemented")
    if req.top_logprobs is not None and not req.logprobs:
        raise invalid("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    messages = [_message(i, m) for i, m in enumerate(req.messages)]
    if not messages:
        raise invalid("'messages' must hold at least one message", "messages")
    limit = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    limit_param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    explicit = limit is not None
    constraint, constraint_param = structured_outputs(req)
    params = _choices(req, limit if explicit else max_model_len, logprobs, limit_param, constraint)
    return ParsedRequest(req.model, None, messages, params, explicit, limit_param, bool(req.stream),
                         _include_usage(req), logprobs is not None, structured_param=constraint_param)


def _message(index: int, message: ChatMessage) -> dict[str, Any]:
    where = f"messages[{index}]"
    if message.role not in CHAT_ROLES:
        raise invalid(f"{where}.role must be one of {list(CHAT_ROLES)}, got {message.role!r}", f"{where}.role")
    content = message.content
    if content is None and message.role == "assistant":
        content = ""
    if isinstance(content, list):  # content parts: only text ones
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise invalid(
                    f"{where}.content[{j}] must be a text part {{'type': 'text', 'text': ...}}; this server has no "
                    f"image or audio input, got {part!r}"[:300],
                    f"{where}.content[{j}]",
                )
            texts.append(part["text"])
        content = "".join(texts)
    if not isinstance(content, str):
        raise invalid(f"{where}.content must be a string or a list of text parts, got {content!r}"[:300],
                      f"{where}.content")
    out: dict[str, Any] = {"role": message.role, "content": content}
    if message.name is not None:
        out["name"] = message.name
    return out


def _include_usage(req: _Common) -> bool:
    return bool(req.stream_options is not None and req.stream_options.include_usage)
