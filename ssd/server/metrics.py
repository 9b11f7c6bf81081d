"""Prometheus metrics of the server, written in the text exposition format (version 0.0.4).

Hand-written rather than via ``prometheus_client``: the server needs a handful of counters, gauges and
histograms, one registry and one render function, and the format is small and stable. Names follow vLLM
with the ``ssd:`` prefix (``vllm:spec_decode_num_drafts_total`` -> ``ssd:spec_decode_num_drafts_total``) so
existing dashboards work after a prefix change; SSD adds its own cache lookup/hit and fallback counters.

Request-level metrics (latency histograms, token counts, finish reasons) are updated on the event-loop
thread as requests end; engine-level ones (KV cache, queue lengths, speculative counters) are read from the
:class:`~ssd.server.async_engine.EngineSnapshot` the engine thread publishes, so rendering never touches the
engine itself (it is not thread-safe).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from ssd.server.async_engine import EngineSnapshot, FinishedRequest

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIX = "ssd:"

# Buckets in seconds and tokens, close to vLLM's so that quantiles compare across engines.
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000)

Labels = tuple[tuple[str, str], ...]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _format_labels(labels: Labels) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in labels) + "}"


def _format_value(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if math.isnan(value):
        return "NaN"
    if float(value).is_integer() and abs(value) < 2**53:
        return str(int(value))
    return repr(float(value))


@dataclass
class _Family:
    """One metric family: a name, a type, and samples keyed by their label sets."""

    name: str
    kind: str  # "counter" | "gauge" | "histogram"
    help: str

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]


@dataclass
class Counter(_Family):
    values: dict[Labels, float] = field(default_factory=dict)

    def inc(self, labels: Labels = (), amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError(f"counter {self.name} can only increase, got {amount}")
        self.values[labels] = self.values.get(labels, 0.0) + amount

    def render(self) -> list[str]:
        return self.header() + [f"{self.name}{_format_labels(k)} {_format_value(v)}" for k, v in self.values.items()]


@dataclass
class Histogram(_Family):
    buckets: Sequence[float] = ()
    counts: dict[Labels, list[int]] = field(default_factory=dict)  # per bucket, not cumulative; last is +Inf
    sums: dict[Labels, float] = field(default_factory=dict)

    def observe(self, value: float, labels: Labels = ()) -> None:
        counts = self.counts.setdefault(labels, [0] * (len(self.buckets) + 1))
        counts[bisect.bisect_left(self.buckets, value)] += 1  # le is inclusive: value == bound goes in it
        self.sums[labels] = self.sums.get(labels, 0.0) + value

    def render(self) -> list[str]:
        lines = self.header()
        base = self.name
        for labels, counts in self.counts.items():
            cumulative = 0
            for bound, count in zip([*self.buckets, math.inf], counts):
                cumulative += count
                le = (("le", _format_value(float(bound))),)
                lines.append(f"{base}_bucket{_format_labels(labels + le)} {cumulative}")
            lines.append(f"{base}_sum{_format_labels(labels)} {_format_value(self.sums[labels])}")
            lines.append(f"{base}_count{_format_labels(labels)} {cumulative}")
        return lines


def _gauge(name: str, help: str, samples: Iterable[tuple[Labels, float]]) -> list[str]:
    family = _Family(name, "gauge", help)
    return family.header() + [f"{name}{_format_labels(k)} {_format_value(v)}" for k, v in samples]


def _counter(name: str, help: str, samples: Iterable[tuple[Labels, float]]) -> list[str]:
    """A counter whose value is kept elsewhere (the engine's cumulative statistics)."""
    family = _Family(name, "counter", help)
    return family.header() + [f"{name}{_format_labels(k)} {_format_value(v)}" for k, v in samples]


class ServerMetrics:
    """All metrics of one server process; :meth:`observe_request` is the async engine's finish callback."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        self._base: Labels = (("model_name", model_name),)
        p = PREFIX
        self.request_success = Counter(
            f"{p}request_success_total", "counter", "Finished requests by finish reason (stop, length, abort, error)."
        )
        self.prompt_tokens = Counter(f"{p}prompt_tokens_total", "counter", "Prompt tokens of admitted requests.")
        self.generation_tokens = Counter(f"{p}generation_tokens_total", "counter", "Generated tokens.")
        self.http_requests = Counter(
            f"{p}http_requests_total", "counter", "HTTP requests by endpoint and status code."
        )
        self.e2e_latency = Histogram(
            f"{p}e2e_request_latency_seconds", "histogram", "Time from arrival to the last token.", LATENCY_BUCKETS
        )
        self.ttft = Histogram(
            f"{p}time_to_first_token_seconds", "histogram", "Time from arrival to the first token.", TTFT_BUCKETS
        )
        self.tpot = Histogram(
            f"{p}time_per_output_token_seconds",
            "histogram",
            "Mean time per output token after the first, per request.",
            TPOT_BUCKETS,
        )
        self.queue_time = Histogram(
            f"{p}request_queue_time_seconds",
            "histogram",
            "Time a request waited before it was first scheduled.",
            LATENCY_BUCKETS,
        )
        self.prompt_tokens_hist = Histogram(
            f"{p}request_prompt_tokens", "histogram", "Prompt tokens per request.", TOKEN_BUCKETS
        )
        self.generation_tokens_hist = Histogram(
            f"{p}request_generation_tokens", "histogram", "Generated tokens per request.", TOKEN_BUCKETS
        )
        self.overloaded = Counter(
            f"{p}request_rejected_overloaded_total", "counter", "Requests refused because the queue was full."
        )

    # ------------------------------------------------------------------ recording
    def observe_request(self, done: FinishedRequest) -> None:
        labels = self._base
        self.request_success.inc(labels + (("finished_reason", done.finish_reason),))
        self.prompt_tokens.inc(labels, done.num_prompt_tokens)
        self.generation_tokens.inc(labels, done.num_output_tokens)
        self.prompt_tokens_hist.observe(done.num_prompt_tokens, labels)
        self.generation_tokens_hist.observe(done.num_output_tokens, labels)
        self.e2e_latency.observe(done.e2e_latency_s, labels)
        if done.time_to_first_token_s is not None:
            self.ttft.observe(done.time_to_first_token_s, labels)
        if done.time_per_output_token_s is not None:
            self.tpot.observe(done.time_per_output_token_s, labels)
        if done.queue_time_s is not None:
            self.queue_time.observe(done.queue_time_s, labels)

    def observe_http(self, path: str, status: int) -> None:
        self.http_requests.inc(self._base + (("path", path), ("status", str(status))))

    def observe_overloaded(self) -> None:
        self.overloaded.inc(self._base)

    # ------------------------------------------------------------------ rendering
    def render(self, snapshot: EngineSnapshot) -> str:
        lines: list[str] = []
        for family in (
            self.request_success,
            self.prompt_tokens,
            self.generation_tokens,
            self.http_requests,
            self.overloaded,
        ):
            lines += family.render()
        for hist in (
            self.e2e_latency,
            self.ttft,
            self.tpot,
            self.queue_time,
            self.prompt_tokens_hist,
            self.generation_tokens_hist,
        ):
            lines += hist.render()
        lines += self._render_engine(snapshot)
        return "\n".join(lines) + "\n"

    def _render_engine(self, s: EngineSnapshot) -> list[str]:
        p, b = PREFIX, self._base
        lines = []
        lines += _gauge(f"{p}num_requests_running", "Requests in the running batch.", [(b, s.num_running)])
        lines += _gauge(f"{p}num_requests_waiting", "Requests waiting to be scheduled.", [(b, s.num_waiting)])
        lines += _gauge(f"{p}num_requests_pending", "Requests accepted by the server and not finished.",
                        [(b, s.num_pending)])
        lines += _gauge(f"{p}kv_cache_usage_perc", "Fraction of target KV cache blocks in use (0-1).",
                        [(b, s.kv_usage)])
        lines += _gauge(f"{p}kv_cache_num_free_blocks", "Free target KV cache blocks.", [(b, s.kv_free_blocks)])
        lines += _gauge(f"{p}kv_cache_num_total_blocks", "Target KV cache blocks.", [(b, s.kv_total_blocks)])
        lines += _gauge(f"{p}prefix_cache_hit_rate", "Fraction of prompt blocks served from the prefix cache.",
                        [(b, s.prefix_cache_hit_rate)])
        lines += _gauge(f"{p}engine_steps", "Engine steps run since start.", [(b, s.num_steps)])
        if s.draft_kv_total_blocks is not None:
            lines += _gauge(f"{p}draft_kv_cache_num_free_blocks", "Free draft KV cache blocks (in-process draft).",
                            [(b, s.draft_kv_free_blocks or 0)])
            lines += _gauge(f"{p}draft_kv_cache_num_total_blocks", "Draft KV cache blocks (in-process draft).",
                            [(b, s.draft_kv_total_blocks)])
        if s.draft_num_sequences is not None:
            lines += _gauge(f"{p}draft_num_sequences", "Sequences whose KV the draft holds.",
                            [(b, s.draft_num_sequences)])
        spec = s.spec_stats
        if spec is None:
            return lines
        lines += _counter(f"{p}spec_decode_num_drafts_total", "Speculative verification rounds.",
                          [(b, spec.num_drafts)])
        lines += _counter(f"{p}spec_decode_num_draft_tokens_total", "Draft tokens proposed.",
                          [(b, spec.num_draft_tokens)])
        lines += _counter(f"{p}spec_decode_num_accepted_tokens_total", "Draft tokens accepted.",
                          [(b, spec.num_accepted_tokens)])
        lines += _counter(f"{p}spec_decode_num_emitted_tokens_total", "Tokens emitted by speculative rounds.",
                          [(b, spec.num_emitted_tokens)])
        lines += _counter(
            f"{p}spec_decode_num_accepted_tokens_per_pos_total",
            "Accepted draft tokens by position in the speculation.",
            [(b + (("position", str(i)),), v) for i, v in enumerate(spec.num_accepted_tokens_per_pos)],
        )
        lines += _counter(f"{p}spec_decode_cache_lookups_total", "SSD speculation cache lookups.",
                          [(b, spec.cache_lookups)])
        lines += _counter(f"{p}spec_decode_cache_hits_total", "SSD speculation cache hits.",
                          [(b, spec.cache_hits)])
        lines += _counter(
            f"{p}spec_decode_fallbacks_total",
            "SSD cache misses served by a fallback, by fallback kind.",
            [(b + (("kind", kind),), v) for kind, v in sorted(spec.fallbacks.items())],
        )
        return lines


def parse_samples(text: str) -> dict[str, float]:
    """``{'name{labels}': value}`` for every sample line; for tests and tools reading ``/metrics``."""
    samples = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        key, _, value = line.rpartition(" ")
        samples[key] = float(value)
    return samples
