"""Online estimates of SSD's acceptance rate a, miss exponent r and cache hit rate (the inputs of the
``auto`` fan-out and fallback policies in :mod:`ssd.speculative.async_draft.planning.fanout`). Pure Python, no torch."""

from __future__ import annotations

import math

from ssd.options import is_int


def check_rate(name: str, value: object, lo: float = 0.0, hi: float = 1.0) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (lo <= value <= hi):
        raise ValueError(f"{name} must be a number in [{lo}, {hi}], got {value!r}")
    return float(value)


def check_budget(budget: object, name: str = "fan-out budget") -> int:
    """`budget` as an int, or ValueError unless it is an integer >= 1 (branches per sequence)."""
    if not is_int(budget) or budget < 1:  # type: ignore[operator]
        raise ValueError(f"{name} must be an integer >= 1 (branches per sequence), got {budget!r}")
    return int(budget)  # type: ignore[call-overload]


class AcceptanceEstimator:
    """Online estimates of the acceptance rate a, the miss exponent r and the overall cache hit rate.

    Acceptance rate: every drafted position that verification looked at is a Bernoulli(a) trial. A round
    with n drafts and k accepted attempted k + 1 positions if k < n (the (k+1)-th was rejected) and n if
    k = n, so a = accepted / attempted is the maximum-likelihood estimate under the truncated geometric
    model. Counts start from a prior (`prior_acceptance` with weight `prior_weight` pseudo-positions) and
    decay by `decay` per attempted position (not per round, so a long run of fully accepted rounds does
    not outweigh the short rounds that follow it), giving a memory of roughly 1 / (1 - decay) positions:
    the estimate follows drifts in the text and the sampling options.

    Miss exponent: per fan-out F, decayed counts of lookups and hits. Under 1 - hit(F) = F^(-r),
    log miss(F) = -r log F, a line through the origin, so r is the weighted least-squares slope
    r = -sum n_F x_F y_F / sum n_F x_F^2 with x_F = log F, y_F = log of the smoothed miss rate
    (misses + 1/2) / (lookups + 1), weights n_F = lookups. F = 0 (nothing prepared) and F = 1 (x = 0)
    carry no information about r. With fewer than `min_lookups` (decayed) lookups at F >= 2, r is
    `default_r`; the fit is clamped to `r_bounds`.
    """

    def __init__(
        self,
        prior_acceptance: float = 0.6,
        prior_weight: float = 4.0,
        decay: float = 0.998,
        default_r: float = 1.0,
        r_bounds: tuple[float, float] = (0.05, 5.0),
        min_lookups: float = 32.0,
        lookup_decay: float = 0.999,
        prior_hit_rate: float = 0.5,
    ) -> None:
        prior_acceptance = check_rate("prior_acceptance", prior_acceptance)
        self.decay = check_rate("decay", decay)
        self.lookup_decay = check_rate("lookup_decay", lookup_decay)
        prior_hit_rate = check_rate("prior_hit_rate", prior_hit_rate)
        if isinstance(prior_weight, bool) or not isinstance(prior_weight, (int, float)) or not (
            0.0 < prior_weight < math.inf
        ):
            raise ValueError(f"prior_weight must be a finite number > 0, got {prior_weight!r}")
        lo, hi = r_bounds
        if not (0.0 <= lo <= hi < math.inf):
            raise ValueError(f"r_bounds must be (lo, hi) with 0 <= lo <= hi < inf, got {r_bounds!r}")
        if not (lo <= default_r <= hi):
            raise ValueError(f"default_r must lie within r_bounds {r_bounds}, got {default_r!r}")
        if not (0.0 <= min_lookups < math.inf):
            raise ValueError(f"min_lookups must be a finite number >= 0, got {min_lookups!r}")
        self.default_r = float(default_r)
        self.r_bounds = (float(lo), float(hi))
        self.min_lookups = float(min_lookups)
        self._accepted = prior_acceptance * prior_weight
        self._attempted = float(prior_weight)
        self._lookups = 1.0  # one pseudo-lookup at prior_hit_rate
        self._hits = prior_hit_rate
        self._per_fan_out: dict[int, list[float]] = {}  # F -> [lookups, hits], decayed
        self._r_cache: tuple[int, float] | None = None
        self.version = 0  # bumped on every observation, so callers can cache what they derive

    def observe_round(self, num_drafts: int, num_accepted: int) -> None:
        """Record one sequence's verified round: `num_accepted` of `num_drafts` drafts were accepted."""
        if not is_int(num_drafts) or num_drafts < 0:
            raise ValueError(f"num_drafts must be an integer >= 0, got {num_drafts!r}")
        if not is_int(num_accepted) or not (0 <= num_accepted <= num_drafts):
            raise ValueError(
                f"num_accepted must be an integer in [0, num_drafts={num_drafts}], got {num_accepted!r}"
            )
        if num_drafts == 0:
            return  # nothing was proposed, so nothing was tested
        attempted = num_accepted + (1 if num_accepted < num_drafts else 0)
        forget = self.decay**attempted
        self._accepted = forget * self._accepted + num_accepted
        self._attempted = forget * self._attempted + attempted
        self.version += 1

    def observe_lookup(self, fan_out_k: int, hit: bool) -> None:
        """Record one cache lookup at acceptance length k, for which F_k = `fan_out_k` were prepared."""
        if not is_int(fan_out_k) or fan_out_k < 0:
            raise ValueError(f"fan_out_k must be an integer >= 0, got {fan_out_k!r}")
        if hit and fan_out_k == 0:
            raise ValueError("a cache hit is impossible with fan_out_k = 0 (no candidate was prepared)")
        d = self.lookup_decay
        self._lookups = d * self._lookups + 1.0
        self._hits = d * self._hits + (1.0 if hit else 0.0)
        for counts in self._per_fan_out.values():
            counts[0] *= d
            counts[1] *= d
        counts = self._per_fan_out.setdefault(fan_out_k, [0.0, 0.0])
        counts[0] += 1.0
        counts[1] += 1.0 if hit else 0.0
        self.version += 1

    @property
    def acceptance_rate(self) -> float:
        return self._accepted / self._attempted

    @property
    def hit_rate(self) -> float:
        """Fraction of lookups that hit, over all fan-outs (decayed, starting from `prior_hit_rate`)."""
        return self._hits / self._lookups

    @property
    def miss_exponent(self) -> float:
        """r in 1 - hit(F) = F^(-r); see the class docstring for the fit."""
        if self._r_cache is not None and self._r_cache[0] == self.version:
            return self._r_cache[1]
        r = self._fit_r()
        self._r_cache = (self.version, r)
        return r

    def _fit_r(self) -> float:
        num = 0.0
        den = 0.0
        informative = 0.0
        for fan_out, (lookups, hits) in self._per_fan_out.items():
            if fan_out < 2 or lookups <= 0.0:
                continue
            informative += lookups
            miss = (lookups - hits + 0.5) / (lookups + 1.0)
            x = math.log(fan_out)
            num += lookups * x * math.log(miss)
            den += lookups * x * x
        if informative < self.min_lookups or den <= 0.0:
            return self.default_r
        lo, hi = self.r_bounds
        return min(hi, max(lo, -num / den))
