"""The SSD fallback policy: fixed kinds, and "auto" choosing by measured throughput per batch size."""

import pytest

from ssd.config import EngineConfig, SpeculativeConfig
from ssd.resolve import resolve_config, resolve_filler_padding
from ssd.speculative.async_draft.planning.fallback_policy import FallbackPolicy

E, X = FallbackPolicy.EXPLORE_ROUNDS, FallbackPolicy.EXPLOIT_ROUNDS
CYCLES = FallbackPolicy.MIN_MEASURED_ROUNDS // E  # exploration cycles before the first exploit window
FIRST = 2 * E * CYCLES  # rounds before the first exploit window


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
    """Exploration windows alternate until each fallback has MIN_MEASURED_ROUNDS measured rounds."""
    assert CYCLES >= 2
    policy = FallbackPolicy("auto")
    chosen = _run(policy, FIRST + X, 1, {"jit": 8, "random": 11})
    assert chosen == (["jit"] * E + ["random"] * E) * CYCLES + ["random"] * X
    assert policy.rates(1) == {"jit": 8.0, "random": 11.0}
    policy = FallbackPolicy("auto")
    chosen = _run(policy, FIRST + X, 1, {"jit": 12, "random": 7})
    assert chosen[FIRST:] == ["jit"] * X


def test_rates_are_discounted_ratios_of_sums():
    """Windows count by their rounds (an exploit window weighs more than an exploration window), and older
    windows are discounted by DISCOUNT each time the fallback's next window ends."""
    policy = FallbackPolicy("auto")
    d = FallbackPolicy.DISCOUNT
    tokens = {"jit": [4, 2], "random": [1, 1]}  # jit: 4 tokens per round in cycle 1, then 2 per round
    for cycle in range(CYCLES):
        for kind in ("jit", "random"):
            for _ in range(E):
                assert policy.choose(1) == kind
                policy.observe_round(1, tokens[kind][min(cycle, 1)], 0.5)
    jit_tokens, jit_seconds = E * 4, E * 0.5
    for _ in range(1, CYCLES):
        jit_tokens, jit_seconds = d * jit_tokens + E * 2, d * jit_seconds + E * 0.5
    assert policy.rates(1)["jit"] == pytest.approx(jit_tokens / jit_seconds)
    assert policy.rates(1)["random"] == pytest.approx(2.0)


def test_auto_re_explores_and_follows_a_change():
    policy = FallbackPolicy("auto")
    _run(policy, FIRST + X, 1, {"jit": 12, "random": 7})
    # The draft got slower (say, another load on its core): the next cycles measure and switch.
    chosen = _run(policy, 2 * E + 2 * X, 1, {"jit": 4, "random": 7})
    assert chosen[: 2 * E] == ["jit"] * E + ["random"] * E
    # jit's discounted sums still hold its 72 rounds at 12 tokens/s (rate 11 after one slow window):
    # one cycle is not enough evidence, so jit wins again (for twice as long); its own window at 4 and the
    # next cycle are enough.
    assert chosen[2 * E:] == ["jit"] * 2 * X
    chosen = _run(policy, 2 * E + X, 1, {"jit": 4, "random": 7})
    assert chosen[2 * E:] == ["random"] * X  # a new winner starts from the shortest window


def test_exploit_windows_double_while_the_same_fallback_wins():
    policy = FallbackPolicy("auto")
    _run(policy, FIRST, 1, {"jit": 6, "random": 9})
    assert FallbackPolicy.MAX_EXPLOIT_ROUNDS == 8 * X
    expected = ["random"] * X
    for window in (2 * X, 4 * X, 8 * X, 8 * X):  # doubled each time random wins again, up to the cap
        expected += ["jit"] * E + ["random"] * E + ["random"] * window
    assert _run(policy, len(expected), 1, {"jit": 6, "random": 9}) == expected


def test_auto_keeps_batch_sizes_apart():
    policy = FallbackPolicy("auto")
    _run(policy, FIRST + 1, 1, {"jit": 12, "random": 7})
    _run(policy, FIRST + 1, 4, {"jit": 20, "random": 30})
    assert policy.choose(1) == "jit" and policy.choose(4) == "random"
    assert policy.rates(1) == {"jit": 12.0, "random": 7.0}
    assert policy.rates(4) == {"jit": 20.0, "random": 30.0}


def test_ties_go_to_random_and_unobserved_rounds_are_ignored():
    policy = FallbackPolicy("auto")
    _run(policy, FIRST + 1, 2, {"jit": 9, "random": 9})
    assert policy.choose(2) == "random"  # same throughput, and the draft is free sooner
    fixed = FallbackPolicy("jit")
    fixed.observe_round(1, 5, 1.0)  # no-op for a fixed policy
    assert fixed.rates(1) == {}
    FallbackPolicy("auto").observe_round(3, 5, 1.0)  # a round never chosen for: ignored


def test_filler_padding_resolves_by_the_targets_device():
    """Repeats pad random fillers where verifying a few more positions is nearly free (CUDA), not on CPU."""
    assert resolve_filler_padding("auto", "cpu") == "none"
    assert resolve_filler_padding("auto", "cuda:1") == "repeat"
    assert resolve_filler_padding("repeat", "cpu") == "repeat"
    assert resolve_filler_padding("none", "cuda") == "none"
    spec = {"method": "ssd", "model": "d"}
    assert resolve_config(EngineConfig(model="m", speculative_config=spec)).spec.filler_padding == "none"
    with pytest.raises(ValueError, match="filler_padding must be one of"):
        SpeculativeConfig(**spec, filler_padding="zeros")


def test_filler_padding_flag_reaches_the_speculative_config():
    import argparse

    from ssd.cli.common import add_engine_args, engine_kwargs

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    spec = engine_kwargs(parser.parse_args(["--model", "t", "--draft", "d", "--filler-padding", "repeat"]))
    assert spec["speculative_config"]["filler_padding"] == "repeat"
    default = engine_kwargs(parser.parse_args(["--model", "t", "--draft", "d"]))
    assert default["speculative_config"]["filler_padding"] == "auto"
