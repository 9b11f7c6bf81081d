"""Data returned to callers: per-request outputs, timings and speculative statistics."""

from __future__ import annotations

from dataclasses import dataclass, field

from ssd.options import Fallback


@dataclass
class SpecStats:
    """Speculative-decoding counters (vLLM's names where a counterpart exists), per request or per engine."""

    num_drafts: int = 0  # verification rounds (spec_decode_num_drafts)
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0  # accepted + recovery/bonus tokens
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    acceptance_histogram: list[int] = field(default_factory=list)  # rounds that accepted exactly k drafts
    num_copied_tokens: int = 0  # drafts that prompt lookup copied from the context instead of the draft model
    num_accepted_copied_tokens: int = 0
    # SSD
    cache_lookups: int = 0
    cache_hits: int = 0
    cache_hits_per_k: list[int] = field(default_factory=list)
    cache_lookups_per_k: list[int] = field(default_factory=list)
    fallbacks: dict[str, int] = field(default_factory=dict)  # misses served, by Fallback value
    accepted_on_hit: int = 0
    rounds_on_hit: int = 0
    accepted_on_miss: int = 0
    rounds_on_miss: int = 0
    draft_build_time_s: float = 0.0
    draft_build_branches: int = 0  # SSD tree branches built (all sequences, all rounds)
    draft_builds: int = 0  # SSD cache builds reported by the draft worker
    draft_builds_cut_short: int = 0  # builds stopped early (fewer tokens per branch): a request waiting or due
    draft_feature_bytes: int = 0  # SSD with an EAGLE-3 head: target features sent to the draft worker
    draft_rounds: int = 0  # SSD requests answered by the draft (engine-wide; the timings below are theirs)
    draft_reply_wait_s: float = 0.0  # from sending each request to its reply
    draft_serve_s: float = 0.0  # the draft's own time serving them (reported by the worker)
    draft_bytes_sent: int = 0  # every message to the draft
    draft_bytes_received: int = 0  # every message from it
    draft_link_rtt_s: float | None = None  # a draft server's network round trip, measured at the session's start
    verify_time_s: float = 0.0
    draft_critical_time_s: float = 0.0  # time the target waited for the draft

    def record_round(self, num_draft: int, num_accepted: int, copied: list[bool] | None = None) -> None:
        """One verification round; ``copied[j]`` says whether draft j came from prompt lookup."""
        if copied:
            self.num_copied_tokens += sum(copied[:num_draft])
            self.num_accepted_copied_tokens += sum(copied[:num_accepted])
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        self.num_emitted_tokens += num_accepted + 1
        _grow(self.num_accepted_tokens_per_pos, num_draft)
        for pos in range(num_accepted):
            self.num_accepted_tokens_per_pos[pos] += 1
        _grow(self.acceptance_histogram, num_draft + 1)
        self.acceptance_histogram[num_accepted] += 1

    def record_lookup(self, k: int, hit: bool, num_accepted: int, fallback: Fallback | None) -> None:
        """One SSD cache lookup keyed by the previous round's k; ``num_accepted`` is this round's result."""
        self.cache_lookups += 1
        _grow(self.cache_lookups_per_k, k + 1)
        _grow(self.cache_hits_per_k, k + 1)
        self.cache_lookups_per_k[k] += 1
        if hit:
            self.cache_hits += 1
            self.cache_hits_per_k[k] += 1
            self.rounds_on_hit += 1
            self.accepted_on_hit += num_accepted
        else:
            self.rounds_on_miss += 1
            self.accepted_on_miss += num_accepted
            if fallback:
                self.fallbacks[fallback.value] = self.fallbacks.get(fallback.value, 0) + 1

    def merge(self, other: "SpecStats") -> None:
        for name, value in vars(other).items():
            mine = getattr(self, name)
            if isinstance(value, list):
                _grow(mine, len(value))
                for i, v in enumerate(value):
                    mine[i] += v
            elif isinstance(value, dict):
                for key, v in value.items():
                    mine[key] = mine.get(key, 0) + v
            elif value is None or mine is None:  # a measurement, not a count: keep the one that was taken
                setattr(self, name, mine if value is None else value)
            else:
                setattr(self, name, mine + value)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verification round (accepted + 1), vLLM's convention."""
        return self.num_emitted_tokens / self.num_drafts if self.num_drafts else 0.0

    @property
    def draft_link_time_s(self) -> float:
        """Of the waits for the draft's replies, the part the draft did not spend serving: the link both ways
        (a remote draft's network) and any build step a request queued behind."""
        return max(0.0, self.draft_reply_wait_s - self.draft_serve_s)

    @property
    def cache_hit_rate(self) -> float:
        return self.cache_hits / self.cache_lookups if self.cache_lookups else 0.0

    def to_dict(self) -> dict:
        data = dict(vars(self))
        data.update(
            acceptance_rate=self.acceptance_rate,
            mean_acceptance_length=self.mean_acceptance_length,
            cache_hit_rate=self.cache_hit_rate,
        )
        return data


def _grow(values: list[int], size: int) -> None:
    values.extend([0] * (size - len(values)))


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_cached_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_first_step_tokens: int = 0  # tokens emitted by the first emitting step (up to K + 1 with speculation)
    num_preemptions: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Output tokens emitted after the first emitting step, per second after it. The first step's tokens
        are excluded with their time (with speculation it can emit K + 1 at once; counting them would
        flatter SD/SSD)."""
        if self.first_token_time is None or self.finished_time is None:
            return None
        later = self.num_output_tokens - self.num_first_step_tokens
        elapsed = self.finished_time - self.first_token_time
        return later / elapsed if later > 0 and elapsed > 0 else None


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: dict[int, float] | None = None


@dataclass
class RequestOutput:
    """State of one request. When streaming, ``new_token_ids``/``new_text`` hold what this step added."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    logprobs: list[TokenLogprob] | None = None
    metrics: RequestMetrics | None = None
    spec_stats: SpecStats | None = None
    speculation: str = "off"  # "off", "draft_model", "ssd", or "disabled: <reason>" for a per-request fallback
    error: str | None = None
