"""Which fallback serves an SSD cache miss: a fixed one ("jit", "random") or "auto", chosen every round
from the engine's own measurements (pure Python, unit tested).

"auto" compares expected tokens per second (`fanout.choose_fallback`) using:
- the cache hit rate (lookups so far);
- the acceptance rate a of the truncated geometric model (`AcceptanceEstimator`), from which a neural
  draft's expected tokens per round follow, learnt only from rounds whose draft was neural (a cache hit or
  jit); a random filler yields ~1 token, and counting its rounds would drag a down, so that "auto", once on
  random, would keep choosing it;
- exponentially weighted means of the target's verification time and of the draft's serve time on rounds
  that really used the jit fallback (a random filler's serve time says nothing about the jit cost).
Until it has seen `WARMUP_LOOKUPS` lookups, a verification and a jit round, "auto" uses jit to measure.
"""

from __future__ import annotations

from typing import Literal

from ssd.spec.ssd.estimator import AcceptanceEstimator
from ssd.spec.ssd.fanout import choose_fallback, expected_tokens_per_round

JIT, RANDOM, AUTO = "jit", "random", "auto"
FALLBACKS = (JIT, RANDOM, AUTO)


class FallbackPolicy:
    WARMUP_LOOKUPS = 8
    EWMA_ALPHA = 0.2

    def __init__(self, kind: str, K: int) -> None:
        if kind not in FALLBACKS:
            raise ValueError(f"fallback must be one of {FALLBACKS}, got {kind!r}")
        self.kind = kind
        self.K = K
        self.acceptance = AcceptanceEstimator()
        self.lookups = 0
        self.hits = 0
        self.verify_s = 0.0  # EWMA of one verification round
        self.jit_s = 0.0  # EWMA of the draft's serve time on rounds that drafted a miss with jit

    def observe_verify(self, seconds: float) -> None:
        self.verify_s = self._ewma(self.verify_s, seconds)

    def observe_reply(self, hits: list[bool], fallbacks: list[str | None], serve_s: float) -> None:
        """One SPECULATION reply: per-row cache hits and fallbacks, and how long the worker took to serve it."""
        self.lookups += len(hits)
        self.hits += sum(hits)
        if JIT in fallbacks:
            self.jit_s = self._ewma(self.jit_s, serve_s)

    def observe_round(self, num_drafts: int, num_accepted: int, neural: bool = True) -> None:
        """A verified round; `neural` is False when its draft was a random filler (ignored)."""
        if neural:
            self.acceptance.observe_round(num_drafts, num_accepted)

    def choose(self, batch_size: int) -> Literal["jit", "random"]:
        if self.kind != AUTO:
            return self.kind  # type: ignore[return-value]
        if self.lookups < self.WARMUP_LOOKUPS or self.verify_s == 0.0 or self.jit_s == 0.0:
            return JIT  # measure first
        return choose_fallback(
            batch_size,
            self.hits / self.lookups,
            expected_tokens_per_round(self.acceptance.acceptance_rate, self.K),
            1.0,
            self.verify_s,
            self.jit_s,
        )

    def _ewma(self, old: float, value: float) -> float:
        return value if old == 0.0 else (1 - self.EWMA_ALPHA) * old + self.EWMA_ALPHA * value
