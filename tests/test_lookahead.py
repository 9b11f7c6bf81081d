"""Adaptive lookahead (ssd/speculative/lookahead.py): exact estimates, the choice of K, exploration, validation."""

import math

import pytest

from ssd.config import SpeculativeConfig
from ssd.options import AdaptiveMode
from ssd.speculative.lookahead import LookaheadPolicy, _Line, logit_shift


def test_line_fit_is_exact_and_needs_two_x_values():
    line = _Line()
    line.add(4.0, 0.070, decay=1.0)
    assert line.fit() is None  # one x value: no slope
    line.add(4.0, 0.070, decay=1.0)
    assert line.fit() is None
    line.add(0.0, 0.030, decay=1.0)
    alpha, beta = line.fit()
    assert alpha == pytest.approx(0.030) and beta == pytest.approx(0.010)


def test_conditional_acceptance_per_depth_exact():
    policy = LookaheadPolicy(3, prior_acceptance=0.5, prior_weight=2.0, acceptance_decay=1.0)
    assert policy.conditional_acceptance() == [0.5, 0.5, 0.5]
    policy.observe_round(7, 3, 3)  # all three accepted: depths 1-3 tried and passed
    policy.observe_round(7, 3, 1)  # depth 1 passed, depth 2 rejected, depth 3 never tried
    policy.observe_round(7, 2, 0)  # depth 1 rejected
    # depth 1: (1 + 2 passed) / (2 + 3 tried); depth 2: (1 + 1) / (2 + 2); depth 3: (1 + 1) / (2 + 1)
    assert policy.conditional_acceptance() == pytest.approx([3 / 5, 2 / 4, 2 / 3])
    assert policy.expected_tokens(0) == 1.0
    assert policy.expected_tokens(2) == pytest.approx(1 + 0.6 + 0.6 * 0.5)
    assert policy.expected_tokens(3) == pytest.approx(1 + 0.6 + 0.3 + 0.3 * 2 / 3)


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def _shift_by_bisection(rates, passed, tried, sd) -> float:
    """The root of the log-posterior's derivative in delta, found independently of the policy's Newton."""
    logits = [math.log(c / (1 - c)) for c in rates]

    def grad(d):
        return sum(p - t * _sigmoid(z + d) for z, p, t in zip(logits, passed, tried)) - d / sd**2

    lo, hi = -20.0, 20.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if grad(mid) > 0 else (lo, mid)
    return (lo + hi) / 2


def test_logit_shift_is_the_posterior_mode():
    rates = [0.35, 0.5, 0.7]
    for passed, tried in (([3, 0, 0], [3, 0, 0]), ([0, 0, 0], [4, 0, 0]), ([5, 3, 1], [6, 5, 3]), ([0, 0, 0], [0, 0, 0])):
        expected = _shift_by_bisection(rates, passed, tried, 1.5)
        assert logit_shift(rates, passed, tried, sd=1.5) == pytest.approx(expected, abs=1e-9)
    assert logit_shift(rates, [0, 0, 0], [0, 0, 0], sd=1.5) == 0.0  # no evidence: the prior's mode


def test_sequences_keep_their_own_rates_on_a_shifted_engine_prior():
    policy = LookaheadPolicy(2, prior_acceptance=0.5, prior_weight=2.0, acceptance_decay=1.0)
    for _ in range(4):
        policy.observe_round(1, 2, 2)
        policy.observe_round(2, 2, 0)
    engine = policy.conditional_acceptance()
    assert engine == pytest.approx([(1 + 4) / (2 + 8), (1 + 4) / (2 + 4)])
    w, sd = LookaheadPolicy.SEQ_PRIOR_WEIGHT, LookaheadPolicy.SEQ_SHIFT_SD
    logits = [math.log(c / (1 - c)) for c in engine]
    up = _shift_by_bisection(engine, [4, 4], [4, 4], sd)
    down = _shift_by_bisection(engine, [0, 0], [4, 0], sd)
    assert up > 0 > down
    assert policy.conditional_acceptance(1) == pytest.approx(
        [(4 + w * _sigmoid(logits[0] + up)) / (4 + w), (4 + w * _sigmoid(logits[1] + up)) / (4 + w)])
    # sequence 2 never reached depth 2: its rate there is the engine's, shifted down by its depth-1 failures
    assert policy.conditional_acceptance(2) == pytest.approx(
        [(0 + w * _sigmoid(logits[0] + down)) / (4 + w), _sigmoid(logits[1] + down)])
    policy.forget(1)
    assert policy.conditional_acceptance(1) == engine  # an unknown sequence gets the engine-wide rates


def test_a_sequence_that_passes_shallow_depths_earns_a_longer_lookahead():
    # Chat-like sequences lowered the engine-wide rates so far that K = 1 is best for a new sequence;
    # a code sequence that passes depth 1 every time is then expected to pass deeper depths more often too,
    # and gets a longer lookahead before any exploration step tried it there.
    policy = _policy_with_line(0.35, weight=50.0)  # as if after many chat rounds
    assert policy.best([1]) == 1  # E = 1, 1.35, 1.47, ... over 30, 40, 50, ... ms
    for _ in range(4):
        policy.observe_round(1, 1, 1)
    assert policy.conditional_acceptance(1)[2] > 0.7 > 0.35 == policy.conditional_acceptance()[2]
    assert policy.best([1]) == 3  # c = 0.90, 0.76, 0.76, 0.76 (the old per-depth prior: 0.90, 0.35, ...: K = 1)


def _policy_with_line(acceptance: float, alpha: float = 0.030, beta: float = 0.010, weight: float = 1.0) -> LookaheadPolicy:
    policy = LookaheadPolicy(4, prior_acceptance=acceptance, prior_weight=weight)
    policy.observe_step(1, 4.0, alpha + 4 * beta)
    policy.observe_step(1, 0.0, alpha)
    return policy


def test_best_k_maximises_tokens_per_second():
    # c = 0.9 at every depth: E(K)/t(K) grows with K up to K = 4 at these costs
    assert _policy_with_line(0.9).best([0]) == 4
    # a draft that is never right: speculation only costs, plain decoding wins
    assert _policy_with_line(0.0).best([0]) == 0
    # c = 0.4: E = 1, 1.4, 1.56, 1.624, 1.65 over t = 30, 40, 50, 60, 70 ms: K = 1 (0.0350 vs 0.0333 at K = 0)
    assert _policy_with_line(0.4).best([0]) == 1
    # a batch sums the sequences' expected tokens; the line of another batch size is unknown: K
    assert _policy_with_line(0.4).best([0, 1]) == 4


def test_choose_starts_at_k_max_and_explores_round_robin_ever_more_rarely():
    policy = LookaheadPolicy(3, prior_acceptance=0.0)  # once the line is known, the best K is 0
    every, most = LookaheadPolicy.EXPLORE_EVERY, LookaheadPolicy.MAX_EXPLORE_EVERY
    assert (every, most) == (8, 64)
    chosen, explore_steps = [], []
    for step in range(1, 401):
        explored = policy._explored.get(1, 0)
        k = policy.choose([5])
        chosen.append(k)
        if policy._explored.get(1, 0) > explored:
            explore_steps.append(step)
        policy.observe_step(1, float(k), 0.030 + 0.010 * k)
    assert chosen[: every - 1] == [3] * (every - 1)  # no line yet: the configured K
    # Step 8 explores K = 0, which gives the line: the best becomes 0, a new best, so the gap stays 8 (step
    # 16); from then on the best holds and the gap doubles up to 64: steps 32, 64, 128, 192, 256, ...
    assert explore_steps == [8, 16, 32, 64, 128, 192, 256, 320, 384]
    assert [chosen[s - 1] for s in explore_steps] == [0, 1, 2, 3, 0, 1, 2, 3, 0]  # round robin over 0..3
    assert all(k == 0 for s, k in enumerate(chosen, 1) if s > every and s not in explore_steps)  # the best
    assert policy.choose([]) == 3  # nothing decoding: nothing to choose


def test_a_new_best_k_brings_exploration_back_to_every_eighth_step():
    policy = LookaheadPolicy(2, prior_acceptance=0.0)
    for _ in range(40):  # K = 0 is best; gaps 8, 8, 16 -> explorations at 8, 16, 32
        k = policy.choose([1])
        policy.observe_step(1, float(k), 0.030 + 0.010 * k)
    assert policy._gap[1] == 32
    for _ in range(20):  # drafts start to pay: every depth passes, and drafting became cheap
        policy.observe_round(1, 2, 2)
    for _ in range(3):
        policy.observe_step(1, 0.0, 0.030)
        policy.observe_step(1, 2.0, 0.031)
    assert policy.choose([1]) == 2 and policy._gap[1] == LookaheadPolicy.EXPLORE_EVERY


def test_validation():
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LookaheadPolicy(0)
    with pytest.raises(ValueError, match="time_decay"):
        LookaheadPolicy(2, time_decay=0.0)
    policy = LookaheadPolicy(2)
    with pytest.raises(ValueError, match="num_accepted <= num_drafts"):
        policy.observe_round(0, 1, 2)
    with pytest.raises(ValueError, match="num_drafts <= 2"):
        policy.observe_round(0, 3, 0)
    with pytest.raises(ValueError, match="invalid step"):
        policy.observe_step(0, 1.0, 0.1)


def test_below_min_batch_size_the_policy_keeps_k_max_and_does_not_explore():
    policy = LookaheadPolicy(3, prior_acceptance=0.0, min_batch_size=2)  # SSD's "auto"
    every = LookaheadPolicy.EXPLORE_EVERY
    for _ in range(4 * every):
        assert policy.choose([5]) == 3
        policy.observe_step(1, 3.0, 0.060)
    chosen = []
    for _ in range(2 * every):  # two sequences: the round robin starts as for a policy without a minimum
        chosen.append(policy.choose([5, 6]))
        policy.observe_step(2, float(chosen[-1]), 0.030 + 0.010 * chosen[-1])
    assert chosen[every - 1] == 0 and chosen[2 * every - 1] == 1  # explorations at steps 8 and 16 of the pair
    assert chosen[: every - 1] == [3] * (every - 1)
    with pytest.raises(ValueError, match="min_batch_size"):
        LookaheadPolicy(3, min_batch_size=0)


def test_config_accepts_adaptive_lookahead_for_both_methods():
    assert SpeculativeConfig(model="d", adaptive_lookahead=True).adaptive_lookahead is AdaptiveMode.ON
    assert SpeculativeConfig(method="ssd", model="d", adaptive_lookahead=True).adaptive_lookahead is AdaptiveMode.ON
    assert SpeculativeConfig(model="d", adaptive_lookahead="on").adaptive_lookahead is AdaptiveMode.ON
    assert SpeculativeConfig(model="d").adaptive_lookahead == "auto"  # the default
    assert SpeculativeConfig(model="d", adaptive_lookahead=False).adaptive_lookahead is AdaptiveMode.OFF
    for bad in ("yes", 1, None):
        with pytest.raises(ValueError, match="must be True, False or 'auto'"):
            SpeculativeConfig(model="d", adaptive_lookahead=bad)


def test_engine_builds_the_policy_the_setting_asks_for(checkpoint_factory):
    from ssd import LLM

    from ssd.speculative.lookahead import auto_min_batch_size

    assert auto_min_batch_size("ssd") == 2  # one sequence keeps the full K under SSD
    assert auto_min_batch_size("draft_model") == auto_min_batch_size("ngram") == 1
    path = checkpoint_factory("llama")
    for setting, min_batch in ((True, 1), ("auto", 1), (False, None)):
        spec = {"method": "draft_model", "model": str(path), "num_speculative_tokens": 2,
                "adaptive_lookahead": setting}
        with LLM(model=str(path), speculative_config=spec, kv_cache_memory="16MiB") as llm:
            policy = llm.engine.rounds.policy
            assert (policy is None) if min_batch is None else (policy.min_batch_size == min_batch)


def test_command_line_flag():
    import argparse

    from ssd.cli.common import add_engine_args, engine_kwargs

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--model", "t", "--draft", "d", "--method", "draft_model", "--adaptive-lookahead"])
    assert engine_kwargs(args)["speculative_config"]["adaptive_lookahead"] is AdaptiveMode.ON
    off = parser.parse_args(["--model", "t", "--draft", "d", "--adaptive-lookahead", "off"])
    assert engine_kwargs(off)["speculative_config"]["adaptive_lookahead"] is AdaptiveMode.OFF
    plain = engine_kwargs(parser.parse_args(["--model", "t", "--draft", "d"]))["speculative_config"]
    assert plain["adaptive_lookahead"] == "auto"


def test_seeded_sampled_requests_repeat_under_the_adaptive_policy(checkpoint_factory):
    """A seeded sampled request draws one uniform per verified position, so its tokens repeat only if its
    rounds do: while one decodes, the engine keeps the configured K whatever the policy has learned since."""
    from ssd import LLM, SamplingParams

    target = str(checkpoint_factory("llama"))
    draft = str(checkpoint_factory("llama", seed=1, num_layers=1))
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 3, "adaptive_lookahead": True}
    seeded = SamplingParams(temperature=0.9, max_tokens=24, seed=11, ignore_eos=True)
    with LLM(model=target, speculative_config=spec, kv_cache_memory="16MiB") as llm:
        first = llm.generate([[5, 6, 7, 8]], seeded)[0].token_ids
        chosen = []
        choose = llm.engine.rounds.policy.choose
        llm.engine.rounds.policy.choose = lambda ids: chosen.append(choose(ids)) or chosen[-1]
        greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
        llm.generate([[9, 10, 11], [12, 13]], greedy)  # the policy learns (and explores) meanwhile
        assert chosen  # greedy requests do use the policy
        chosen.clear()
        again = llm.generate([[5, 6, 7, 8]], seeded)[0].token_ids
        assert not chosen  # a seeded sampled request never asks it
    assert again == first
