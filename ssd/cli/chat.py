"""``ssd chat``: an interactive terminal chat that streams replies and keeps the conversation.

It talks to an in-process engine (engine flags as for ``ssd generate``) or, with ``--url``, to a running
OpenAI-compatible server (``ssd serve`` or any other). Lines typed are user turns; ``/reset`` clears the
history, ``/exit`` (or end of input) leaves. ``--metrics`` prints after each reply: tokens, decode tok/s,
time to first token, and with speculation the acceptance rate, mean acceptance length and SSD cache hits.
Ctrl-C during a reply stops it (the request is aborted, the partial reply is not kept).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TextIO

from ssd.cli.common import add_engine_args, engine_kwargs, sampling_from_args
from ssd.sampling_params import SamplingParams

Message = dict[str, str]


@dataclass
class ReplyStats:
    """Figures of one reply, timed on the client side so both backends report the same thing."""

    num_tokens: int
    elapsed_s: float
    ttft_s: float | None
    finish_reason: str | None = None
    acceptance_rate: float | None = None
    mean_acceptance_length: float | None = None
    cache_hits: int = 0
    cache_lookups: int = 0
    num_first_tokens: int = 1  # tokens that arrived with the first chunk (up to K + 1 with speculation)

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Tokens after the first chunk per second after it (the first chunk's tokens go with the TTFT)."""
        later = self.num_tokens - self.num_first_tokens
        if self.ttft_s is None or later < 1 or self.elapsed_s <= self.ttft_s:
            return None
        return later / (self.elapsed_s - self.ttft_s)

    def summary(self) -> str:
        parts = [f"{self.num_tokens} tokens"]
        rate = self.decode_tokens_per_s
        parts.append(f"{rate:.1f} tok/s" if rate is not None else "- tok/s")
        parts.append(f"TTFT {self.ttft_s * 1000:.0f} ms" if self.ttft_s is not None else "TTFT -")
        if self.acceptance_rate is not None:
            parts.append(f"acceptance {self.acceptance_rate:.1%} (mean length {self.mean_acceptance_length:.2f})")
        if self.cache_lookups:
            parts.append(f"SSD cache hits {self.cache_hits}/{self.cache_lookups} "
                         f"({self.cache_hits / self.cache_lookups:.1%})")
        return "[" + ", ".join(parts) + "]"


class ChatBackend(Protocol):
    def reply(self, messages: list[Message], on_text: Callable[[str], None]) -> ReplyStats: ...

    def close(self) -> None: ...


class _Clock:
    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.first: float | None = None

    def token(self) -> None:
        if self.first is None:
            self.first = time.perf_counter() - self.start

    def elapsed(self) -> float:
        return time.perf_counter() - self.start


class LocalBackend:
    """An engine in this process."""

    def __init__(self, engine_options: dict[str, Any], params: SamplingParams) -> None:
        from ssd.llm import LLM

        self.llm = LLM(**engine_options)
        self.params = params

    def reply(self, messages: list[Message], on_text: Callable[[str], None]) -> ReplyStats:
        prompt = self.llm.tokenizer.apply_chat_template(messages)
        clock = _Clock()
        final = None
        num_first = 0
        for output in self.llm.stream(prompt, self.params):
            if output.new_token_ids and clock.first is None:
                clock.token()
                num_first = len(output.new_token_ids)
            if output.new_text:
                on_text(output.new_text)
            if output.finished:
                final = output
        stats = ReplyStats(len(final.token_ids) if final else 0, clock.elapsed(), clock.first,
                           final.finish_reason if final else None, num_first_tokens=num_first)
        spec = final.spec_stats if final is not None else None
        if spec is not None:
            stats.acceptance_rate = spec.acceptance_rate
            stats.mean_acceptance_length = spec.mean_acceptance_length
            stats.cache_hits, stats.cache_lookups = spec.cache_hits, spec.cache_lookups
        return stats

    def close(self) -> None:
        self.llm.shutdown()


class RemoteBackend:
    """A running OpenAI-compatible server; the ``usage.speculative`` extension fills the speculation figures."""

    def __init__(self, url: str, params: SamplingParams, model: str | None = None, api_key: str | None = None,
                 timeout_s: float = 600.0) -> None:
        import httpx

        base = url.rstrip("/")
        self.base = base[: -len("/v1")] if base.endswith("/v1") else base
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(base_url=self.base, headers=headers, timeout=timeout_s)
        self.params = params
        try:
            self.model = model or self._first_model()
        except httpx.HTTPError as exc:
            self.client.close()
            raise ValueError(f"cannot reach an OpenAI-compatible server at {self.base}: {exc}") from exc

    def _first_model(self) -> str:
        response = self.client.get("/v1/models")
        response.raise_for_status()
        data = response.json().get("data") or []
        if not data:
            raise ValueError(f"the server at {self.base} lists no models")
        return data[0]["id"]

    def _body(self, messages: list[Message]) -> dict[str, Any]:
        p = self.params
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "stream": True,
            "stream_options": {"include_usage": True},
            "max_tokens": p.max_tokens,
            "temperature": p.temperature,
            "top_p": p.top_p,
        }
        if p.top_k:
            body["top_k"] = p.top_k
        for name, off in (("min_p", 0.0), ("presence_penalty", 0.0), ("frequency_penalty", 0.0),
                          ("repetition_penalty", 1.0)):
            if getattr(p, name) != off:
                body[name] = getattr(p, name)
        if p.seed is not None:
            body["seed"] = p.seed
        if p.ignore_eos:
            body["ignore_eos"] = True
        if p.structured_outputs is not None:
            body["structured_outputs"] = json.loads(p.structured_outputs.to_json())
        return body

    def reply(self, messages: list[Message], on_text: Callable[[str], None]) -> ReplyStats:
        clock = _Clock()
        usage: dict[str, Any] | None = None
        finish_reason = None
        with self.client.stream("POST", "/v1/chat/completions", json=self._body(messages)) as response:
            if response.status_code != 200:
                response.read()
                raise ValueError(f"server answered {response.status_code}: {_error_message(response.text)}")
            for line in response.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:") :].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    raise RuntimeError(f"server error: {event['error'].get('message')}")
                usage = event.get("usage") or usage
                for choice in event.get("choices") or []:
                    text = (choice.get("delta") or {}).get("content")
                    if text:
                        clock.token()
                        on_text(text)
                    finish_reason = choice.get("finish_reason") or finish_reason
        stats = ReplyStats((usage or {}).get("completion_tokens", 0), clock.elapsed(), clock.first, finish_reason)
        spec = (usage or {}).get("speculative")
        if spec:
            stats.acceptance_rate = spec.get("acceptance_rate")
            stats.mean_acceptance_length = spec.get("mean_acceptance_length")
            stats.cache_hits, stats.cache_lookups = spec.get("cache_hits", 0), spec.get("cache_lookups", 0)
            stats.num_first_tokens = spec.get("num_first_step_tokens") or 1
        return stats

    def close(self) -> None:
        self.client.close()


def _error_message(text: str) -> str:
    try:
        return json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return text[:500]


HELP = "commands: /reset clears the conversation, /exit leaves (so does end of input)"


def run_chat(
    backend: ChatBackend,
    stdin: TextIO,
    stdout: TextIO,
    stderr: TextIO,
    system: str | None = None,
    show_metrics: bool = False,
) -> int:
    """The read-reply loop. Prompts are shown only on a terminal, so piped output is just the replies."""
    interactive = stdin.isatty()
    history: list[Message] = [{"role": "system", "content": system}] if system else []
    if interactive:
        print(HELP, file=stderr)
    while True:
        try:
            line = _read_turn(stdin, stdout, interactive)
        except KeyboardInterrupt:
            stdout.write("\n")
            return 0
        if not line:  # end of input
            return 0
        text = line.rstrip("\n")
        command = text.strip()
        if not command:
            continue
        if command in ("/exit", "/quit"):
            return 0
        if command == "/reset":
            history = history[:1] if system else []
            print("[conversation cleared]", file=stderr)
            continue
        if command == "/help":
            print(HELP, file=stderr)
            continue
        turn = history + [{"role": "user", "content": text}]
        parts: list[str] = []
        try:
            stats = backend.reply(turn, lambda delta, parts=parts: _emit(delta, parts, stdout))
        except KeyboardInterrupt:
            stdout.write("\n")
            print("[interrupted; this reply is not kept]", file=stderr)
            continue
        stdout.write("\n")
        stdout.flush()
        history = turn + [{"role": "assistant", "content": "".join(parts)}]
        if show_metrics:
            print(stats.summary(), file=stderr, flush=True)


def _emit(delta: str, parts: list[str], stdout: TextIO) -> None:
    parts.append(delta)
    stdout.write(delta)
    stdout.flush()


def _read_turn(stdin: TextIO, stdout: TextIO, interactive: bool) -> str:
    """One line ('' at end of input); on a terminal ``input`` gives line editing and history."""
    if not interactive:
        return stdin.readline()
    if stdin is sys.stdin and stdout is sys.stdout:
        try:
            return input(">>> ") + "\n"
        except EOFError:
            stdout.write("\n")
            return ""
    stdout.write(">>> ")
    stdout.flush()
    return stdin.readline()


def add_chat_args(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser)
    g = parser.add_argument_group("chat")
    g.add_argument("--url", default=None,
                   help="base URL of a running OpenAI-compatible server (e.g. http://127.0.0.1:8000); "
                        "engine flags are then ignored and --model names the served model")
    g.add_argument("--api-key", default=None, help="bearer token for --url servers that need one")
    g.add_argument("--system", default=None, help="system message that starts the conversation")
    g.add_argument("--metrics", action="store_true",
                   help="after each reply print tokens, tok/s, TTFT, acceptance and SSD cache hits (stderr)")


def cmd_chat(args: argparse.Namespace) -> int:
    params = sampling_from_args(args)
    backend: ChatBackend
    if args.url:
        backend = RemoteBackend(args.url, params, model=args.model, api_key=args.api_key)
    else:
        backend = LocalBackend(engine_kwargs(args), params)
    try:
        return run_chat(backend, sys.stdin, sys.stdout, sys.stderr, args.system, args.metrics)
    finally:
        backend.close()
