"""Adaptive lookahead for ordinary speculative decoding: how many draft tokens a round should propose.

A round with n drafts emits E(n) = 1 + sum_{j=1..n} c_1 c_2 ... c_j tokens per sequence on average, where c_j
is the probability that draft j is accepted given drafts 1..j-1 were (conditional rates, so runs of copied
tokens, which are accepted together, are modelled as they occur rather than as independent trials). It costs
one draft step per token plus the target's verification of n + 1 positions per sequence. On hardware where
every verified position and every draft step costs time (a CPU), a weak draft loses to plain decoding at
K = 4 while K = 1 or 2 still wins, and a strong one wants K as large as allowed; the best K depends on the
text, the draft and the batch size. So the engine measures both sides and picks, each step, the round drafts
n in 0..K (K: ``num_speculative_tokens``) that maximise sum_i E_i(n) / t_B(n) over the B decoding sequences
(tokens per second):

- c_j: decayed counts over verified rounds (a round with n drafts and k accepted tried depths 1..min(k+1, n)
  and passed depths 1..k), engine-wide from a prior, and per sequence on a prior of its own
  (`SEQ_PRIOR_WEIGHT` pseudo-attempts per depth): code that copies its prompt and chat in one batch keep
  their own rates. The per-sequence prior is the engine-wide rates shifted by one offset delta in logit
  space, c_j' = sigmoid(logit c_j + delta), delta the posterior mode given all of the sequence's rounds
  (Gaussian prior, sd `SEQ_SHIFT_SD`): a sequence that passes every shallow depth is expected to pass the
  deeper ones more often than the engine-wide rates say, before it has been tried there (a request that
  starts on K = 1 because the batch's other requests lowered the engine-wide rates would otherwise have
  to wait for exploration steps to earn more round drafts);
- t_B(n): the measured wall time of pure decode steps (no prefill in the batch) at batch size B, fitted as a
  line in the mean number of drafts per sequence by decayed least squares. n = 0 is a plain decode step.

While a batch size has no line yet (fewer than two distinct n measured), steps use K, the configured
maximum. Exploration steps use the next n of a round robin over 0..K instead of the best one, so the
line stays measured at several points and every depth keeps being tested: the first comes `EXPLORE_EVERY`
steps into a batch size, and each next one twice as many steps after the last (up to `MAX_EXPLORE_EVERY`)
while the best n stays the same; a new best n brings the gap back to `EXPLORE_EVERY`. An exploration step
can cost far more than its n suggests (``bench/RESULTS.md``), so a settled choice is re-checked rarely.
Pure Python, no torch; unit tested with exact values.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from ssd.options import AdaptiveMode, SpecMethod

if TYPE_CHECKING:
    from ssd.config import SpeculativeConfig
    from ssd.sampling_params import SamplingParams


class DecodingSequence(Protocol):
    """What the policy reads of a decoding sequence (``ssd.core.sequence.Sequence``)."""

    seq_id: int
    sampling_params: "SamplingParams"


@dataclass
class _Line:
    """Decayed least squares of t = alpha + beta x."""

    n: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0

    def add(self, x: float, y: float, decay: float) -> None:
        self.n = decay * self.n + 1.0
        self.sx = decay * self.sx + x
        self.sy = decay * self.sy + y
        self.sxx = decay * self.sxx + x * x
        self.sxy = decay * self.sxy + x * y

    def fit(self) -> tuple[float, float] | None:
        """(alpha, beta), or None while x has (numerically) not varied."""
        var = self.n * self.sxx - self.sx * self.sx
        if var <= 1e-9 * max(1.0, self.n * self.sxx):
            return None
        beta = (self.n * self.sxy - self.sx * self.sy) / var
        alpha = (self.sy - beta * self.sx) / self.n
        return alpha, beta


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


def _logit(p: float, eps: float = 1e-4) -> float:
    p = min(max(p, eps), 1.0 - eps)
    return math.log(p / (1.0 - p))


def logit_shift(rates: list[float], passed: list[float], tried: list[float], sd: float, steps: int = 8) -> float:
    """The mode of delta's posterior when depth j passes with probability sigmoid(logit rates[j] + delta),
    `passed[j]` of `tried[j]` times, under a N(0, sd^2) prior (Newton's method on a concave log-posterior)."""
    logits = [_logit(c) for c in rates]
    delta, precision = 0.0, 1.0 / (sd * sd)
    for _ in range(steps):
        grad, curv = -delta * precision, precision
        for z, p, t in zip(logits, passed, tried):
            q = _sigmoid(z + delta)
            grad += p - t * q
            curv += t * q * (1.0 - q)
        step = grad / curv
        delta += max(-2.0, min(2.0, step))  # damped: the first steps from 0 can overshoot at extreme rates
        if abs(step) < 1e-9:
            break
    return delta



def lookahead_policy(spec: "SpeculativeConfig") -> "LookaheadPolicy | None":
    """The policy ``spec.adaptive_lookahead`` asks for: None for a fixed K, else one that chooses from the
    smallest batch size the setting adapts (1 for "on", ``auto_min_batch_size`` for "auto")."""
    if spec.adaptive_lookahead is AdaptiveMode.OFF:
        return None
    auto = spec.adaptive_lookahead is AdaptiveMode.AUTO
    return LookaheadPolicy(spec.num_speculative_tokens, min_batch_size=auto_min_batch_size(spec.method) if auto else 1)


def auto_min_batch_size(method: SpecMethod) -> int:
    """The smallest decoding batch whose K the ``"auto"`` setting lets the policy choose. SSD's drafts cost the
    target nothing, and for one sequence the choice measured within noise; SD's drafts cost it their steps, and
    the choice never lost; at batch 4 both gained (``bench/RESULTS.md``)."""
    return 2 if method == SpecMethod.SSD else 1


class LookaheadPolicy:
    """Per-depth acceptance counts and per-batch-size step-time lines; `choose` gives each step's round drafts.

    ``min_batch_size``: smaller decoding batches always get K (no choice, no exploration); see
    ``auto_min_batch_size`` for the ``"auto"`` setting."""

    EXPLORE_EVERY = 8
    MAX_EXPLORE_EVERY = 64
    SEQ_PRIOR_WEIGHT = 4.0
    SEQ_SHIFT_SD = 1.5

    def __init__(
        self,
        num_speculative_tokens: int,
        prior_acceptance: float = 0.6,
        prior_weight: float = 2.0,
        acceptance_decay: float = 0.99,
        time_decay: float = 0.97,
        min_batch_size: int = 1,
    ) -> None:
        K = num_speculative_tokens
        if not isinstance(K, int) or isinstance(K, bool) or K < 1:
            raise ValueError(f"num_speculative_tokens must be an integer >= 1, got {num_speculative_tokens!r}")
        for name, value in (("acceptance_decay", acceptance_decay), ("time_decay", time_decay)):
            if not (0.0 < value <= 1.0):
                raise ValueError(f"{name} must be in (0, 1], got {value!r}")
        if not (0.0 <= prior_acceptance <= 1.0) or not (prior_weight > 0.0):
            raise ValueError("prior_acceptance must be in [0, 1] and prior_weight > 0")
        if not isinstance(min_batch_size, int) or min_batch_size < 1:
            raise ValueError(f"min_batch_size must be an integer >= 1, got {min_batch_size!r}")
        self.num_speculative_tokens = num_speculative_tokens
        self.min_batch_size = min_batch_size
        self.acceptance_decay = acceptance_decay
        self.time_decay = time_decay
        self._passed = [prior_acceptance * prior_weight] * K  # depth j+1: decayed accepted count
        self._tried = [prior_weight] * K  # depth j+1: decayed attempts
        self._seq_counts: dict[int, tuple[list[float], list[float]]] = {}  # seq_id -> (passed, tried), own rounds
        self._lines: dict[int, _Line] = {}
        self._since: dict[int, int] = {}  # batch size -> steps since its last exploration step
        self._gap: dict[int, int] = {}  # batch size -> steps from one exploration step to the next
        self._best: dict[int, int] = {}  # batch size -> the best round drafts of its last non-exploring step
        self._explored: dict[int, int] = {}  # batch size -> exploration steps so far

    # ------------------------------------------------------------------ estimates
    def conditional_acceptance(self, seq_id: int | None = None) -> list[float]:
        """c_1..c_K, engine-wide or of one sequence (its own rounds on top of the engine-wide prior)."""
        engine = [p / t for p, t in zip(self._passed, self._tried)]
        own = self._seq_counts.get(seq_id) if seq_id is not None else None
        if own is None:
            return engine
        delta = logit_shift(engine, *own, sd=self.SEQ_SHIFT_SD)
        w = self.SEQ_PRIOR_WEIGHT
        return [(p + w * _sigmoid(_logit(c) + delta)) / (t + w) for p, t, c in zip(*own, engine)]

    def expected_tokens_all(self, seq_id: int | None = None) -> list[float]:
        """E(0)..E(K), E(k) = 1 + sum_{j<=k} prod_{i<=j} c_i, in one pass over the rates."""
        totals, run = [1.0], 1.0
        for c in self.conditional_acceptance(seq_id):
            run *= c
            totals.append(totals[-1] + run)
        return totals

    def expected_tokens(self, k: int, seq_id: int | None = None) -> float:
        return self.expected_tokens_all(seq_id)[k]

    def _fit(self, batch_size: int) -> tuple[float, float] | None:
        line = self._lines.get(batch_size)
        return None if line is None else line.fit()

    def step_time(self, batch_size: int, k: int) -> float | None:
        fit = self._fit(batch_size)
        return None if fit is None else fit[0] + fit[1] * k

    def best(self, seq_ids: list[int]) -> int:
        """The round drafts maximising tokens per second for these decoding sequences (K while the cost line of
        their batch size is unknown)."""
        fit = self._fit(len(seq_ids))
        if fit is None:
            return self.num_speculative_tokens
        alpha, beta = fit
        tokens = [sum(col) for col in zip(*(self.expected_tokens_all(s) for s in seq_ids))]  # [K + 1]
        best_k, best_rate = self.num_speculative_tokens, -math.inf
        for k in range(self.num_speculative_tokens + 1):
            t = alpha + beta * k
            rate = tokens[k] / t if t > 0 else -math.inf
            if rate > best_rate + 1e-12:
                best_k, best_rate = k, rate
        return best_k

    # ------------------------------------------------------------------ choosing and learning
    def choose(self, seq_ids: list[int]) -> int:
        """The round drafts for the next step of these decoding sequences."""
        batch_size = max(1, len(seq_ids))
        if batch_size < self.min_batch_size:
            return self.num_speculative_tokens
        since = self._since.get(batch_size, 0) + 1
        gap = self._gap.get(batch_size, self.EXPLORE_EVERY)
        if since >= gap:
            self._since[batch_size] = 0
            self._gap[batch_size] = min(2 * gap, self.MAX_EXPLORE_EVERY)
            n = self._explored.get(batch_size, 0)
            self._explored[batch_size] = n + 1
            return n % (self.num_speculative_tokens + 1)
        self._since[batch_size] = since
        k = self.best(seq_ids) if seq_ids else self.num_speculative_tokens
        if self._best.get(batch_size, k) != k:
            self._gap[batch_size] = self.EXPLORE_EVERY  # a new best: look at the others again soon
        self._best[batch_size] = k
        return k

    def choose_for(self, seqs: "Sequence[DecodingSequence]") -> int:
        """`choose` for these decoding sequences, except that while a seeded sampled request decodes, every
        step keeps K: such a request draws one uniform per verified position, so its tokens repeat from
        run to run only if its rounds do."""
        if any(s.sampling_params.seed is not None and not s.sampling_params.is_greedy for s in seqs):
            return self.num_speculative_tokens
        return self.choose([s.seq_id for s in seqs])

    def observe_round(self, seq_id: int, num_drafts: int, num_accepted: int) -> None:
        """A verified round of sequence `seq_id`: `num_accepted` of its `num_drafts` drafts were accepted."""
        K = self.num_speculative_tokens
        if not (0 <= num_accepted <= num_drafts <= K):
            raise ValueError(f"need 0 <= num_accepted <= num_drafts <= {K}, got {num_accepted}, {num_drafts}")
        d = self.acceptance_decay
        own = self._seq_counts.setdefault(seq_id, ([0.0] * K, [0.0] * K))
        for passed, tried in ((self._passed, self._tried), own):
            for j in range(min(num_accepted + 1, num_drafts)):
                tried[j] = d * tried[j] + 1.0
                passed[j] = d * passed[j] + (1.0 if j < num_accepted else 0.0)

    def forget(self, seq_id: int) -> None:
        """The sequence finished (or was aborted): drop its own counts."""
        self._seq_counts.pop(seq_id, None)

    def observe_step(self, batch_size: int, mean_drafts: float, seconds: float) -> None:
        """A pure decode step of `batch_size` sequences with `mean_drafts` drafts per sequence took `seconds`."""
        if batch_size < 1 or mean_drafts < 0 or not (seconds >= 0.0):
            raise ValueError(f"invalid step observation ({batch_size}, {mean_drafts}, {seconds})")
        self._lines.setdefault(batch_size, _Line()).add(float(mean_drafts), float(seconds), self.time_decay)
