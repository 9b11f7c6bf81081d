"""The SSD fallback policy: fixed kinds, the auto choice from measured rates, and what it learns from."""

import pytest

from ssd.spec.ssd.fallback_policy import FallbackPolicy
from ssd.spec.ssd.fanout import choose_fallback, expected_tokens_per_round


def _warm(policy: FallbackPolicy, verify_s: float, jit_s: float, hit_rate: float, rounds: list[tuple[int, int]]):
    hits = round(16 * hit_rate)
    policy.observe_reply([True] * hits + [False] * (16 - hits), [None] * hits + ["jit"] * (16 - hits), jit_s)
    policy.observe_verify(verify_s)
    for n, k in rounds:
        policy.observe_round(n, k)


def test_fixed_kinds_and_validation():
    assert FallbackPolicy("jit", 4).choose(8) == "jit"
    assert FallbackPolicy("random", 4).choose(1) == "random"
    with pytest.raises(ValueError, match="fallback must be one of"):
        FallbackPolicy("neural", 4)


def test_auto_measures_with_jit_first():
    policy = FallbackPolicy("auto", 4)
    assert policy.choose(1) == "jit"
    policy.observe_reply([False] * 10, ["random"] * 10, 0.001)
    policy.observe_verify(0.05)
    assert policy.choose(1) == "jit"  # no jit round measured yet


def test_auto_picks_the_faster_fallback():
    # A weak draft (rounds accept 0 of 4) and a jit as long as the verification: random wins.
    weak = FallbackPolicy("auto", 4)
    _warm(weak, verify_s=0.05, jit_s=0.05, hit_rate=0.5, rounds=[(4, 0)] * 200)
    assert weak.choose(1) == "random"
    # A strong draft (every round accepts everything) and a cheap jit: jit wins.
    strong = FallbackPolicy("auto", 4)
    _warm(strong, verify_s=0.05, jit_s=0.005, hit_rate=0.5, rounds=[(4, 4)] * 200)
    assert strong.choose(1) == "jit"
    # The choice is exactly choose_fallback's on the policy's own estimates.
    a = strong.acceptance.acceptance_rate
    assert strong.choose(4) == choose_fallback(4, 0.5, expected_tokens_per_round(a, 4), 1.0, 0.05, 0.005)


def test_acceptance_is_the_geometric_rate_not_accepted_per_draft():
    """Rounds that accept 1 of 4 drafts: 1 accepted per 2 attempted positions (a = 0.5 in the limit),
    while accepted / drafted would be 0.25 and undervalue the jit draft."""
    policy = FallbackPolicy("auto", 4)
    for _ in range(5000):
        policy.observe_round(4, 1)
    assert policy.acceptance.acceptance_rate == pytest.approx(0.5, abs=0.01)


def test_random_filler_rounds_do_not_touch_the_jit_cost():
    policy = FallbackPolicy("auto", 4)
    policy.observe_reply([False], ["jit"], 0.030)
    for _ in range(50):
        policy.observe_reply([False, True], ["random", None], 0.0005)  # a filler is served at once
    assert policy.jit_s == 0.030
    assert policy.lookups == 101 and policy.hits == 50
    policy.observe_reply([False], ["jit"], 0.040)
    assert policy.jit_s == pytest.approx(0.8 * 0.030 + 0.2 * 0.040)


def test_random_filler_rounds_do_not_touch_the_acceptance_rate():
    """A filler is almost always rejected; learning a from its rounds would make "auto" prefer random
    ever more once it had chosen it."""
    policy = FallbackPolicy("auto", 4)
    for _ in range(200):
        policy.observe_round(4, 4)
    a = policy.acceptance.acceptance_rate
    for _ in range(200):
        policy.observe_round(4, 0, neural=False)
    assert policy.acceptance.acceptance_rate == a
    policy.observe_round(4, 0)
    assert policy.acceptance.acceptance_rate < a
