"""Prometheus metrics of the server, written in the text exposition format (version 0.0.4).

Hand-written rather than via ``prometheus_client``: the server needs a handful of counters, gauges and
histograms, one registry and one render function, and the format is small and stable. Names follow vLLM
with the ``ssd:`` prefix (``vllm:spec_decode_num_drafts_total`` -> ``ssd:spec_decode_num_drafts_total``) so
existing dashboards work after a prefix change; SSD adds its own cache lookup/hit and fallback counters.

Request-level metrics (latency histograms, token counts, finish reasons) are updated on the event-loop
thread as requests end; engine-level ones (KV cache, queue lengths, speculative counters) are read from the
:class:`~ssd.server.messages.EngineSnapshot` the engine thread publishes, so rendering never touches the
engine itself (it is not thread-safe).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from ssd.server.messages import EngineSnapshot, FinishedRequest

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


def _family_lines(name: str, kind: str, help: str, samples: Iterable[tuple[Labels, float]]) -> list[str]:
    """A counter or gauge family: header, then one line per label set."""
    return _Family(name, kind, help).header() + [f"{name}{_format_labels(k)} {_format_value(v)}" for k, v in samples]


@dataclass
class Counter(_Family):
    values: dict[Labels, float] = field(default_factory=dict)

    def inc(self, labels: Labels = (), amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError(f"counter {self.name} can only increase, got {amount}")
        self.values[labels] = self.values.get(labels, 0.0) + amount

    def render(self) -> list[str]:
        return _family_lines(self.name, self.kind, self.help, self.values.items())


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


@dataclass(frozen=True)
class _RequestHistogram:
    """A per-request histogram: its family, and the figure of a finished request it records (None: skip)."""

    name: str
    help: str
    buckets: Sequence[float]
    value: Callable[[FinishedRequest], float | None]


# In /metrics order. One table instead of a constructor call and an observe call per histogram.
_REQUEST_HISTOGRAMS = (
    _RequestHistogram("e2e_request_latency_seconds", "Time from arrival to the last token.", LATENCY_BUCKETS,
                      lambda done: done.e2e_latency_s),
    _RequestHistogram("time_to_first_token_seconds", "Time from arrival to the first token.", TTFT_BUCKETS,
                      lambda done: done.time_to_first_token_s),
    _RequestHistogram("time_per_output_token_seconds", "Mean time per output token after the first, per request.",
                      TPOT_BUCKETS, lambda done: done.time_per_output_token_s),
    _RequestHistogram("request_queue_time_seconds", "Time a request waited before it was first scheduled.",
                      LATENCY_BUCKETS, lambda done: done.queue_time_s),
    _RequestHistogram("request_prompt_tokens", "Prompt tokens per request.", TOKEN_BUCKETS,
                      lambda done: done.num_prompt_tokens),
    _RequestHistogram("request_generation_tokens", "Generated tokens per request.", TOKEN_BUCKETS,
                      lambda done: done.num_output_tokens),
)


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
        self.overloaded = Counter(
            f"{p}request_rejected_overloaded_total", "counter", "Requests refused because the queue was full."
        )
        self.request_histograms: list[tuple[Histogram, _RequestHistogram]] = [
            (Histogram(f"{p}{spec.name}", "histogram", spec.help, spec.buckets), spec) for spec in _REQUEST_HISTOGRAMS
        ]

    # ------------------------------------------------------------------ recording
    def observe_request(self, done: FinishedRequest) -> None:
        labels = self._base
        self.request_success.inc(labels + (("finished_reason", done.finish_reason),))
        self.prompt_tokens.inc(labels, done.num_prompt_tokens)
        self.generation_tokens.inc(labels, done.num_output_tokens)
        for histogram, spec in self.request_histograms:
            value = spec.value(done)
            if value is not None:
                histogram.observe(value, labels)

    def observe_http(self, path: str, status: int) -> None:
        self.http_requests.inc(self._base + (("path", path), ("status", str(status))))

    def observe_overloaded(self) -> None:
        self.overloaded.inc(self._base)

    # ------------------------------------------------------------------ rendering
    def render(self, snapshot: EngineSnapshot) -> str:
        counters = (self.request_success, self.prompt_tokens, self.generation_tokens, self.http_requests,
                    self.overloaded)
        families: list[Counter | Histogram] = [*counters, *(histogram for histogram, _ in self.request_histograms)]
        lines = [line for family in families for line in family.render()]
        lines += self._render_engine(snapshot)
        return "\n".join(lines) + "\n"

    def _render_engine(self, s: EngineSnapshot) -> list[str]:
        p, b = PREFIX, self._base
        gauges: list[tuple[str, str, float]] = [
            ("num_requests_running", "Requests in the running batch.", s.num_running),
            ("num_requests_waiting", "Requests waiting to be scheduled.", s.num_waiting),
            ("num_requests_pending", "Requests accepted by the server and not finished.", s.num_pending),
            ("kv_cache_usage_perc", "Fraction of target KV cache blocks in use (0-1).", s.kv_usage),
            ("kv_cache_num_free_blocks", "Free target KV cache blocks.", s.kv_free_blocks),
            ("kv_cache_num_total_blocks", "Target KV cache blocks.", s.kv_total_blocks),
            ("prefix_cache_hit_rate", "Fraction of prompt blocks served from the prefix cache.",
             s.prefix_cache_hit_rate),
            ("engine_steps", "Engine steps run since start.", s.num_steps),
        ]
        if s.draft_kv_total_blocks is not None:
            gauges += [
                ("draft_kv_cache_num_free_blocks", "Free draft KV cache blocks (in-process draft).",
                 s.draft_kv_free_blocks or 0),
                ("draft_kv_cache_num_total_blocks", "Draft KV cache blocks (in-process draft).",
                 s.draft_kv_total_blocks),
            ]
        if s.draft_num_sequences is not None:
            gauges.append(("draft_num_sequences", "Sequences whose KV the draft holds.", s.draft_num_sequences))
        lines = []
        for name, help, value in gauges:
            lines += _family_lines(f"{p}{name}", "gauge", help, [(b, value)])
        spec = s.spec_stats
        if spec is None:
            return lines
        # Counters whose values the engine keeps (its cumulative speculative statistics).
        counters: list[tuple[str, str, list[tuple[Labels, float]]]] = [
            ("spec_decode_num_drafts_total", "Speculative verification rounds.", [(b, spec.num_drafts)]),
            ("spec_decode_num_draft_tokens_total", "Draft tokens proposed.", [(b, spec.num_draft_tokens)]),
            ("spec_decode_num_accepted_tokens_total", "Draft tokens accepted.", [(b, spec.num_accepted_tokens)]),
            ("spec_decode_num_emitted_tokens_total", "Tokens emitted by speculative rounds.",
             [(b, spec.num_emitted_tokens)]),
            ("spec_decode_num_accepted_tokens_per_pos_total", "Accepted draft tokens by position in the speculation.",
             [(b + (("position", str(i)),), v) for i, v in enumerate(spec.num_accepted_tokens_per_pos)]),
            ("spec_decode_num_copied_tokens_total", "Draft tokens copied from the context by prompt lookup.",
             [(b, spec.num_copied_tokens)]),
            ("spec_decode_num_accepted_copied_tokens_total", "Copied draft tokens accepted.",
             [(b, spec.num_accepted_copied_tokens)]),
            ("spec_decode_cache_lookups_total", "SSD speculation cache lookups.", [(b, spec.cache_lookups)]),
            ("spec_decode_cache_hits_total", "SSD speculation cache hits.", [(b, spec.cache_hits)]),
            ("spec_decode_fallbacks_total", "SSD cache misses served by a fallback, by fallback kind.",
             [(b + (("kind", kind),), v) for kind, v in sorted(spec.fallbacks.items())]),
            ("spec_decode_draft_rounds_total", "SSD requests the draft answered.", [(b, spec.draft_rounds)]),
            ("spec_decode_draft_reply_wait_seconds_total", "SSD: time from each request to the draft's reply.",
             [(b, spec.draft_reply_wait_s)]),
            ("spec_decode_draft_serve_seconds_total", "SSD: the draft's own time serving those requests (the "
             "rest of the wait is the link and any build step a request queued behind).", [(b, spec.draft_serve_s)]),
            ("spec_decode_draft_bytes_total", "SSD: bytes of the messages to and from the draft.",
             [(b + (("direction", "sent"),), spec.draft_bytes_sent),
              (b + (("direction", "received"),), spec.draft_bytes_received)]),
        ]
        for name, help, samples in counters:
            lines += _family_lines(f"{p}{name}", "counter", help, samples)
        if spec.draft_link_rtt_s is not None:
            lines += _family_lines(f"{p}spec_decode_draft_link_rtt_seconds", "gauge",
                                   "SSD: the draft server's network round trip, measured as its session started.",
                                   [(b, spec.draft_link_rtt_s)])
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
