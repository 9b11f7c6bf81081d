"""The SSD fallback policy: fixed kinds, and "auto" choosing by measured throughput per batch size."""

import pytest

from ssd.spec.ssd.fallback_policy import FallbackPolicy

E, X = FallbackPolicy.EXPLORE_ROUNDS, FallbackPolicy.EXPLOIT_ROUNDS


def _run(policy: FallbackPolicy, rounds: int, batch_size: int, speed: dict[str, float]) -> list[str]:
    """`rounds` rounds in which each fallback emits `speed[kind]` tokens per second (1 s per round)."""
    chosen = []
    for _ in range(rounds):
        kind = policy.choose(batch_size)
        chosen.append(kind)
        policy.observe_round(batch_size, round(speed[kind]), 1.0)
    return chosen


def test_fixed_kinds_and_validation():
    assert FallbackPolicy("jit").choose(8) == "jit"
    assert FallbackPolicy("random").choose(1) == "random"
    with pytest.raises(ValueError, match="fallback must be one of"):
        FallbackPolicy("neural")


def test_auto_explores_both_then_exploits_the_faster():
    policy = FallbackPolicy("auto")
    chosen = _run(policy, 2 * E + X, 1, {"jit": 8, "random": 11})
    assert chosen == ["jit"] * E + ["random"] * E + ["random"] * X
    assert policy.rates(1) == {"jit": 8.0, "random": 11.0}
    policy = FallbackPolicy("auto")
    chosen = _run(policy, 2 * E + X, 1, {"jit": 12, "random": 7})
    assert chosen[2 * E:] == ["jit"] * X


def test_auto_re_explores_and_follows_a_change():
    policy = FallbackPolicy("auto")
    _run(policy, 2 * E + X, 1, {"jit": 12, "random": 7})
    # The draft got slower (say, another load on its core): the next cycle measures and switches.
    chosen = _run(policy, 2 * E + X, 1, {"jit": 4, "random": 7})
    assert chosen[: 2 * E] == ["jit"] * E + ["random"] * E
    # jit's mean is 0.5 * 12 + 0.5 * 4 = 8 > 7: one cycle is not enough evidence, the next one is.
    assert chosen[2 * E:] == ["jit"] * X
    chosen = _run(policy, 2 * E + X, 1, {"jit": 4, "random": 7})
    assert chosen[2 * E:] == ["random"] * X


def test_auto_keeps_batch_sizes_apart():
    policy = FallbackPolicy("auto")
    _run(policy, 2 * E + 1, 1, {"jit": 12, "random": 7})
    _run(policy, 2 * E + 1, 4, {"jit": 20, "random": 30})
    assert policy.choose(1) == "jit" and policy.choose(4) == "random"
    assert policy.rates(1) == {"jit": 12.0, "random": 7.0}
    assert policy.rates(4) == {"jit": 20.0, "random": 30.0}


def test_ties_go_to_random_and_unobserved_rounds_are_ignored():
    policy = FallbackPolicy("auto")
    _run(policy, 2 * E + 1, 2, {"jit": 9, "random": 9})
    assert policy.choose(2) == "random"  # same throughput, and the draft is free sooner
    fixed = FallbackPolicy("jit")
    fixed.observe_round(1, 5, 1.0)  # no-op for a fixed policy
    assert fixed.rates(1) == {}
    FallbackPolicy("auto").observe_round(3, 5, 1.0)  # a round never chosen for: ignored
