"""Fan-out planning for SSD: how many candidate outcomes to prepare per acceptance length (docs/design.md, "SSD").

While the target verifies a round, the draft prepares the next speculation for F_k likely recovery/bonus
tokens at each acceptance length k in 0..K. The budget M = sum F_k is the number of tree branches per
sequence, so it is paid for in draft compute every round; how it is split decides the cache hit rate.

Model (from the SSD paper): acceptance length is geometric with truncation, P(k) = (1 - a) a^k for k < K and
P(K) = a^K; with F candidates at one k the miss rate is 1 - hit(F) = F^(-r). Minimising the expected miss
rate sum_k P(k) F_k^(-r) under sum_k F_k = M gives F_k proportional to P(k)^(1/(1+r)). Both a and r drift
with the prompt and the sampling options, so "auto" re-estimates them online from the engine's own
counters (`AcceptanceEstimator`). Unless the user fixes M, "auto" also steers M itself from the draft's own
timing (`BudgetController`): as many branches as fit before the target's verification ends.

"dynamic" drops the population model and plans every sequence's round on its own from the draft's
probabilities (``dynamic_fanout.py``); its budget M is steered by the same `BudgetController`.

Everything here is pure Python (no torch): it runs on the critical path of every round and is unit tested
with exact values.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

from ssd.options import FanOutChoice, FanOutKind, is_int
from ssd.speculative.async_draft.planning.dynamic_fanout import DynamicFanOut
from ssd.speculative.async_draft.planning.estimator import AcceptanceEstimator, check_budget, check_rate

logger = logging.getLogger(__name__)

# Quotas within this distance below an integer are taken as that integer (floating-point noise in
# budget * w_k / sum(w) must not move a candidate between rows).
_SNAP_EPS = 1e-9
# Remainders are compared after rounding to this many decimals, so mathematically equal remainders that
# differ by rounding error tie, and the documented tie-break (smaller k first) decides.
_TIE_DECIMALS = 9


def _check_k(K: object) -> int:
    if not is_int(K) or K < 1:  # type: ignore[operator]
        raise ValueError(f"K must be an integer >= 1, got {K!r}")
    return int(K)  # type: ignore[call-overload]


@dataclass(frozen=True)
class FanOut:
    """F_0..F_K: candidates prepared per acceptance length k (index k), so len(values) == K + 1."""

    values: tuple[int, ...]

    def __post_init__(self) -> None:
        values = tuple(self.values)
        if len(values) < 2:
            raise ValueError(
                f"a fan-out needs K + 1 >= 2 entries (F_0..F_K for K >= 1), got {list(values)}"
            )
        for k, f in enumerate(values):
            if not is_int(f) or f < 0:
                raise ValueError(f"fan-out entries must be integers >= 0, got F_{k} = {f!r}")
        if sum(values) == 0:
            raise ValueError(f"at least one fan-out entry must be > 0, got {list(values)}")
        object.__setattr__(self, "values", values)

    @property
    def K(self) -> int:
        return len(self.values) - 1

    @property
    def budget(self) -> int:
        return sum(self.values)

    def as_list(self) -> list[int]:
        return list(self.values)


FanOutPlan = list[int] | DynamicFanOut  # what one sequence's cache build is given


def per_k_counts(branches: Sequence[tuple[int, ...]], K: int) -> list[int]:
    """F_0..F_K of a set of branches (k, c) or outcomes (k, c, weight)."""
    counts = [0] * (K + 1)
    for branch in branches:
        counts[branch[0]] += 1
    return counts


def acceptance_length_probs(a: float, K: int) -> list[float]:
    """P(k) for k = 0..K under the truncated geometric model; a = 0 puts all mass on k = 0, a = 1 on k = K."""
    a = check_rate("acceptance rate a", a)
    K = _check_k(K)
    probs = [(1.0 - a) * a**k for k in range(K)]  # 0.0 ** 0 == 1.0, so a = 0 gives P(0) = 1
    probs.append(a**K)
    return probs


def largest_remainder(weights: Sequence[float], total: int) -> list[int]:
    """Integers >= 0 proportional to `weights` that sum exactly to `total` (Hamilton's method).

    Each entry first gets floor(total * w_k / sum(w)); the units left over go one each to the entries with
    the largest fractional remainders. Ties (equal remainders up to 1e-9) go to the smaller index, so the
    result is deterministic and, for a geometric allocation, favours shorter acceptance lengths (which
    are the more likely ones whenever their weights are equal).
    """
    if not is_int(total) or total < 0:
        raise ValueError(f"total must be an integer >= 0, got {total!r}")
    if not weights or any(not math.isfinite(w) or w < 0 for w in weights):
        raise ValueError(f"weights must be a non-empty list of finite numbers >= 0, got {list(weights)}")
    weight_sum = math.fsum(weights)
    if weight_sum <= 0:
        raise ValueError(f"at least one weight must be > 0, got {list(weights)}")
    quotas = [total * w / weight_sum for w in weights]
    counts = [math.floor(q + _SNAP_EPS) for q in quotas]
    left = total - sum(counts)  # >= 0: each floor is <= its quota + eps and the quotas sum to total
    order = sorted(range(len(weights)), key=lambda k: (-round(quotas[k] - counts[k], _TIE_DECIMALS), k))
    for k in order[:left]:
        counts[k] += 1
    return counts


def geometric_fan_out(a: float, r: float, K: int, budget: int) -> list[int]:
    """The budget-optimal fan-out F_0..F_K for acceptance rate `a` and miss exponent `r`.

    F_k is proportional to P(k)^(1/(1+r)) (see the module docstring), rounded by `largest_remainder` so
    the entries are integers >= 0 summing exactly to `budget`; ties go to the smaller k. Edge cases:
    a = 0 gives [budget, 0, ..., 0] (every round rejects the first draft), a = 1 gives [0, ..., 0, budget]
    (every round accepts everything). r = 0 allocates in proportion to P(k); larger r flattens the
    allocation, because extra candidates at a likely k then buy little.
    """
    a = check_rate("acceptance rate a", a)
    if isinstance(r, bool) or not isinstance(r, (int, float)) or not (0.0 <= r < math.inf):
        raise ValueError(f"miss exponent r must be a finite number >= 0, got {r!r}")
    K = _check_k(K)
    budget = check_budget(budget)
    exponent = 1.0 / (1.0 + float(r))
    weights = [p**exponent for p in acceptance_length_probs(a, K)]  # 0 ** x == 0 for x > 0
    return largest_remainder(weights, budget)


def fold_fan_out(fan_out: Sequence[int], num_drafts: int) -> list[int]:
    """F_0..F_K for a speculation of only `num_drafts` < K drafts (a fallback filler): acceptance lengths past
    `num_drafts` cannot occur, so their candidates go to k = `num_drafts` (all drafts accepted, where the
    bonus token is drawn). The length and the budget stay the same; longer speculations keep `fan_out`."""
    if not is_int(num_drafts) or num_drafts < 0:
        raise ValueError(f"num_drafts must be an integer >= 0, got {num_drafts!r}")
    values = list(fan_out)
    if num_drafts >= len(values) - 1:
        return values
    tail = len(values) - num_drafts - 1
    return values[:num_drafts] + [sum(values[num_drafts:])] + [0] * tail


def expected_tokens_per_round(a: float, K: int) -> float:
    """E[k + 1] under the truncated geometric model: sum_{i=0..K} a^i (= K + 1 when a = 1)."""
    a = check_rate("acceptance rate a", a)
    K = _check_k(K)
    return math.fsum(a**i for i in range(K + 1))


class FanOutPolicy:
    """The fan-out to use now: fixed, "auto" (geometric allocation from an `AcceptanceEstimator`) or
    "dynamic" (per sequence, by the fork: `DynamicFanOut`).

    Every policy owns an estimator; only "auto" reads it. Keep separate policies for rounds whose speculation
    came from the cache (hits) and rounds served by the fallback (misses): their acceptance rates differ (a
    random fallback is almost always rejected, so its auto allocation puts nearly everything on k = 0). Feed
    an auto policy's estimator with the rounds it planned: `observe_round` for the verified round, and
    `observe_lookup(F_k, hit)` for the lookup of the cache that policy's allocation built.
    """

    def __init__(
        self,
        K: int,
        fixed: FanOut | None = None,
        budget: int | None = None,
        estimator: AcceptanceEstimator | None = None,
        dynamic: bool = False,
    ) -> None:
        self.K = _check_k(K)
        if fixed is not None and dynamic:
            raise ValueError("a fan-out is either fixed or dynamic, not both")
        self.dynamic = dynamic
        if fixed is not None:
            if fixed.K != self.K:
                raise ValueError(f"fan-out has F_0..F_{fixed.K} but K = {self.K}")
            if budget is not None and budget != fixed.budget:
                raise ValueError(
                    f"budget {budget!r} disagrees with the fixed fan-out {fixed.as_list()} "
                    f"(sum {fixed.budget}); the budget is only chosen freely for 'auto'"
                )
            self.budget = fixed.budget
        else:
            self.budget = check_budget((self.K + 1) * 2 if budget is None else budget)
        self.fixed = fixed
        self.estimator = estimator if estimator is not None else AcceptanceEstimator()
        self._cache: tuple[int, int, list[int]] | None = None  # (estimator version, budget, fan-out)

    @property
    def is_auto(self) -> bool:
        """The geometric allocation from online estimates ("auto")."""
        return self.fixed is None and not self.dynamic

    @property
    def adjustable(self) -> bool:
        """Whether the branch budget may change ("auto" and "dynamic"; fixed fan-outs keep their sum)."""
        return self.fixed is None

    def current(self) -> list[int]:
        """F_0..F_K for the next cache build (a fresh list; callers may keep or modify it); a dynamic policy
        has none (its plans are per sequence: `plan`)."""
        if self.dynamic:
            raise ValueError("a dynamic fan-out has no fixed F_0..F_K: the fork plans each sequence (plan())")
        if self.fixed is not None:
            return self.fixed.as_list()
        version = self.estimator.version
        if self._cache is None or self._cache[:2] != (version, self.budget):
            est = self.estimator
            fan_out = geometric_fan_out(est.acceptance_rate, est.miss_exponent, self.K, self.budget)
            self._cache = (version, self.budget, fan_out)
            logger.debug(
                "auto fan-out a=%.3f r=%.3f budget=%d -> %s",
                est.acceptance_rate, est.miss_exponent, self.budget, fan_out,
            )
        return list(self._cache[2])

    def plan(self, num_drafts: int) -> FanOutPlan:
        """The plan for the cache build after a speculation of `num_drafts` drafts: the per-sequence
        `DynamicFanOut`, or F_0..F_K with the lengths past `num_drafts` folded onto it (`fold_fan_out`)."""
        if self.dynamic:
            return DynamicFanOut(self.budget)
        return fold_fan_out(self.current(), num_drafts)

    def set_budget(self, budget: int) -> None:
        """A new branch budget for an "auto" or "dynamic" policy (see `BudgetController`); fixed fan-outs keep
        theirs."""
        if self.fixed is not None:
            raise ValueError(f"the fixed fan-out {self.fixed.as_list()} has no adjustable budget")
        self.budget = check_budget(budget)

    def __repr__(self) -> str:
        kind = "dynamic" if self.dynamic else "auto" if self.is_auto else self.fixed.as_list()  # type: ignore[union-attr]
        return f"FanOutPolicy(K={self.K}, {kind}, budget={self.budget})"


class BudgetController:
    """Steers the branch budget of "auto" fan-outs so the cache build ends before the next request arrives.

    Branches are nearly free while a draft step is bound by reading its weights (a CPU core, or a GPU at
    small batch) and cost in proportion once it is compute bound; where that turns depends on the hardware,
    the batch size and the draft. So the budget follows the one quantity that matters: whether the target
    had to wait for the draft. After every cache build the worker reports how long the build took and how
    long the draft then sat idle until the next SPECULATE request (`observe`):

    - idle < `LATE_S`: the request was already waiting, so the build was on the critical path: the budget
      shrinks by an eighth (at least one branch);
    - idle > `GROW_SHARE` x build time: there is room, the budget grows by one branch;
    - otherwise it holds.

    The budget stays within [K + 1, `maximum`] (default `ADAPTIVE_BUDGET_PER_K` x (K + 1), which also sizes
    the draft's scratch KV) and starts at 2 (K + 1), the default fixed budget.
    """

    LATE_S = 2e-4
    GROW_SHARE = 0.1
    ADAPTIVE_BUDGET_PER_K = 6

    def __init__(self, K: int, maximum: int | None = None) -> None:
        K = _check_k(K)
        self.minimum = K + 1
        self.maximum = check_budget(maximum) if maximum is not None else self.max_budget(K)
        if self.maximum < self.minimum:
            raise ValueError(f"maximum budget {self.maximum} is below K + 1 = {self.minimum}")
        self.budget = min(2 * (K + 1), self.maximum)

    @classmethod
    def max_budget(cls, K: int) -> int:
        return cls.ADAPTIVE_BUDGET_PER_K * (_check_k(K) + 1)

    def observe(self, build_s: float, idle_s: float) -> int:
        """Update from one round's cache-build time and the idle time that followed; returns the budget."""
        if idle_s < self.LATE_S:
            self.budget = max(self.minimum, self.budget - max(1, self.budget // 8))
        elif idle_s > self.GROW_SHARE * build_s:
            self.budget = min(self.maximum, self.budget + 1)
        return self.budget


def max_fan_out_budget(fan_out: FanOutChoice, K: int, budget: int | None) -> int:
    """The most branches per sequence a fan-out choice can ever ask for (sizes the draft's scratch KV):
    its sum when fixed, `budget` for "auto" or "dynamic" with a fixed budget, else the adaptive maximum."""
    policy = fan_out_policy(fan_out, K, budget)
    if policy.adjustable and budget is None:
        return BudgetController.max_budget(K)
    return policy.budget


def fan_out_policy(
    fan_out: FanOutChoice, K: int, budget: int | None = None, estimator: AcceptanceEstimator | None = None
) -> FanOutPolicy:
    """The policy of a fan-out choice (``ssd/options.py: FanOutChoice``) for K: F_k = F for every k
    (uniform), the given F_0..F_K, "auto" (geometric allocation from online estimates) or "dynamic" (each
    sequence's likeliest outcomes). `budget` is the branch budget of "auto" and "dynamic" (default
    (K + 1) * 2); a fixed choice ignores it (its sum is its budget)."""
    K = _check_k(K)
    if fan_out.adjustable:
        return FanOutPolicy(K, budget=budget, estimator=estimator, dynamic=fan_out.kind is FanOutKind.DYNAMIC)
    return FanOutPolicy(K, fixed=FanOut(tuple(fan_out.per_k(K))), estimator=estimator)
