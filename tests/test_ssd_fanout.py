"""SSD fan-out planning: geometric allocation (hand-computed), parsing, online estimators, fallback choice."""

import math

import numpy as np
import pytest

from ssd.speculative.async_draft.planning.dynamic_fanout import DynamicFanOut, dynamic_branches, keeps_drafting
from ssd.speculative.async_draft.planning.fanout import (
    AcceptanceEstimator,
    BudgetController,
    FanOut,
    FanOutPolicy,
    acceptance_length_probs,
    expected_tokens_per_round,
    fold_fan_out,
    geometric_fan_out,
    largest_remainder,
    fan_out_policy,
    max_fan_out_budget,
    per_k_counts,
)
from ssd.options import FanOutChoice


def parse_fan_out(spec, K, budget=None, estimator=None):
    """The policy of a user's fan-out value, parsed as the configuration parses it."""
    return fan_out_policy(FanOutChoice.parse(spec), K, budget, estimator)

# ------------------------------------------------------------------------------------------------
# geometric allocation


def test_acceptance_length_probs_exact():
    assert acceptance_length_probs(0.5, 2) == [0.5, 0.25, 0.25]
    assert acceptance_length_probs(0.0, 3) == [1.0, 0.0, 0.0, 0.0]
    assert acceptance_length_probs(1.0, 3) == [0.0, 0.0, 0.0, 1.0]
    assert sum(acceptance_length_probs(0.7, 5)) == pytest.approx(1.0, abs=1e-15)


@pytest.mark.parametrize(
    "a, r, K, budget, expected",
    [
        # P = [.5, .25, .25], w = sqrt(P) = [.7071, .5, .5]; quotas 4.142, 2.929, 2.929 -> floors 4, 2, 2,
        # the 2 units left go to the largest remainders (k = 1, 2).
        (0.5, 1.0, 2, 10, [4, 3, 3]),
        # same weights, budget 7: quotas 2.899, 2.050, 2.050 -> floors 2, 2, 2, one unit left -> k = 0.
        (0.5, 1.0, 2, 7, [3, 2, 2]),
        # r = 0: proportional to P = [.5, .25, .25]; quotas 1, .5, .5: the tie goes to the smaller k.
        (0.5, 0.0, 2, 2, [1, 1, 0]),
        # r = 0, P = [.5, .25, .125, .125]: quotas are exact integers.
        (0.5, 0.0, 3, 8, [4, 2, 1, 1]),
        # P = [.2, .16, .128, .1024, .4096], w = sqrt(P), sum 2.16498; quotas 2.066, 1.848, 1.653, 1.478,
        # 2.956 -> floors 2, 1, 1, 1, 2 and the 3 units left go to k = 4 (.956), 1 (.848), 2 (.653).
        (0.8, 1.0, 4, 10, [2, 2, 2, 1, 3]),
        # the auto default before any data: a = 0.6, r = 1, K = 4, budget (K + 1) * 2. P = [.4, .24,
        # .144, .0864, .1296]; quotas 2.934, 2.273, 1.760, 1.364, 1.670 -> floors 2, 2, 1, 1, 1, the 3
        # units left go to k = 0 (.934), 2 (.760), 4 (.670).
        (0.6, 1.0, 4, 10, [3, 2, 2, 1, 2]),
        # edge cases: a = 0 always rejects the first draft, a = 1 always accepts everything.
        (0.0, 1.0, 4, 10, [10, 0, 0, 0, 0]),
        (1.0, 1.0, 4, 10, [0, 0, 0, 0, 10]),
        (0.0, 0.0, 1, 3, [3, 0]),
        (1.0, 3.0, 1, 3, [0, 3]),
    ],
)
def test_geometric_fan_out_hand_computed(a, r, K, budget, expected):
    assert geometric_fan_out(a, r, K, budget) == expected


def test_geometric_fan_out_sums_to_budget_and_flattens_with_r():
    for a in np.linspace(0.0, 1.0, 21):
        for r in (0.0, 0.3, 1.0, 2.5):
            for K in (1, 3, 7):
                for budget in (1, 5, 16, 33):
                    fan = geometric_fan_out(float(a), r, K, budget)
                    assert len(fan) == K + 1
                    assert sum(fan) == budget
                    assert min(fan) >= 0
    # a large r makes extra candidates at a likely k cheap to give away: the allocation flattens.
    assert geometric_fan_out(0.5, 0.0, 3, 16) == [8, 4, 2, 2]
    assert geometric_fan_out(0.5, 100.0, 3, 16) == [4, 4, 4, 4]


def test_largest_remainder_exact_and_ties():
    assert largest_remainder([1.0, 1.0, 1.0], 2) == [1, 1, 0]
    assert largest_remainder([1.0, 1.0, 1.0], 4) == [2, 1, 1]
    assert largest_remainder([3.0, 0.0, 1.0], 4) == [3, 0, 1]
    assert largest_remainder([0.1, 0.2, 0.7], 0) == [0, 0, 0]
    # 0.1 + 0.2 is not exactly 0.3 in floating point; the remainders still tie and k = 0 wins.
    assert largest_remainder([0.1 + 0.2, 0.3], 1) == [1, 0]
    with pytest.raises(ValueError, match="weight"):
        largest_remainder([0.0, 0.0], 3)
    with pytest.raises(ValueError, match="weights"):
        largest_remainder([1.0, -1.0], 3)
    with pytest.raises(ValueError, match="total"):
        largest_remainder([1.0], -1)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(a=-0.1, r=1.0, K=2, budget=4), "acceptance rate"),
        (dict(a=1.5, r=1.0, K=2, budget=4), "acceptance rate"),
        (dict(a=float("nan"), r=1.0, K=2, budget=4), "acceptance rate"),
        (dict(a=0.5, r=-0.5, K=2, budget=4), "miss exponent"),
        (dict(a=0.5, r=math.inf, K=2, budget=4), "miss exponent"),
        (dict(a=0.5, r=1.0, K=0, budget=4), "K must be"),
        (dict(a=0.5, r=1.0, K=True, budget=4), "K must be"),
        (dict(a=0.5, r=1.0, K=2, budget=0), "budget"),
        (dict(a=0.5, r=1.0, K=2, budget=2.0), "budget"),
    ],
)
def test_geometric_fan_out_rejects_bad_inputs(kwargs, match):
    with pytest.raises(ValueError, match=match):
        geometric_fan_out(**kwargs)


# ------------------------------------------------------------------------------------------------
# parsing and policies


def test_fold_fan_out_moves_impossible_lengths_to_the_bonus_position():
    assert fold_fan_out([4, 2, 1, 1, 0], 0) == [8, 0, 0, 0, 0]
    assert fold_fan_out([4, 2, 1, 1, 3], 2) == [4, 2, 5, 0, 0]
    assert fold_fan_out([4, 2, 1, 1, 3], 3) == [4, 2, 1, 4, 0]
    assert fold_fan_out([4, 2, 1, 1, 3], 4) == [4, 2, 1, 1, 3]  # a full speculation keeps its plan
    assert fold_fan_out((1, 2), 7) == [1, 2]
    with pytest.raises(ValueError, match="num_drafts"):
        fold_fan_out([1, 1], -1)


def test_parse_uniform_list_and_strings():
    assert parse_fan_out(2, K=3).current() == [2, 2, 2, 2]
    assert parse_fan_out([4, 2, 1, 0], K=3).current() == [4, 2, 1, 0]
    assert parse_fan_out((0, 0, 1), K=2).current() == [0, 0, 1]
    assert parse_fan_out("3", K=2).current() == [3, 3, 3]
    assert parse_fan_out(" 4,2,1,1,0 ", K=4).current() == [4, 2, 1, 1, 0]
    policy = parse_fan_out([1, 2, 3], K=2, budget=6)
    assert not policy.is_auto and policy.budget == 6 and policy.K == 2
    policy = parse_fan_out([1, 2, 3], K=2, budget=20)  # the auto budget does not apply to a fixed spec
    assert policy.budget == 6 and policy.current() == [1, 2, 3]


def test_parse_auto_and_default_budget():
    policy = parse_fan_out("auto", K=4)
    assert policy.is_auto and policy.budget == 10
    assert policy.current() == [3, 2, 2, 1, 2]  # a = 0.6, r = 1 priors: see the hand-computed case
    assert parse_fan_out(" AUTO", K=2, budget=5).budget == 5
    assert sum(parse_fan_out("auto", K=2, budget=5).current()) == 5


@pytest.mark.parametrize(
    "spec, K, budget, match",
    [
        (0, 3, None, "uniform fan_out must be >= 1"),
        (-2, 3, None, "uniform fan_out must be >= 1"),
        ("0", 3, None, "uniform fan_out must be >= 1"),
        (True, 3, None, "fan_out must be"),
        (2.5, 3, None, "fan_out must be"),
        (None, 3, None, "fan_out must be"),
        ("fast", 3, None, "fan_out must be"),
        ("1,,2", 2, None, "fan_out must be"),
        ([1, 2], 3, None, "K \\+ 1 = 4 entries"),
        ([0, 0, 0, 0], 3, None, "at least one fan-out entry must be > 0"),
        ([1, -1, 1, 1], 3, None, "integers >= 0"),
        ([1.0, 1, 1, 1], 3, None, "integers >= 0"),
        ([1, 1, True, 1], 3, None, "integers >= 0"),
        ("auto", 3, 0, "budget"),
        ("auto", 0, None, "K must be"),
        (2, 0, None, "K must be"),
    ],
)
def test_parse_errors(spec, K, budget, match):
    with pytest.raises(ValueError, match=match):
        parse_fan_out(spec, K, budget)


def test_fan_out_dataclass():
    fan = FanOut((3, 1, 0))
    assert fan.K == 2 and fan.budget == 4 and fan.as_list() == [3, 1, 0]
    with pytest.raises(ValueError, match="K \\+ 1 >= 2"):
        FanOut((3,))
    with pytest.raises(ValueError, match=r"F_0..F_2 but K = 3"):
        FanOutPolicy(3, fixed=fan)
    with pytest.raises(ValueError, match="disagrees with the fixed fan-out"):
        FanOutPolicy(2, fixed=fan, budget=5)


def test_current_returns_a_fresh_list():
    for policy in (parse_fan_out(2, K=2), parse_fan_out("auto", K=2)):
        first = policy.current()
        first[0] = 99
        assert policy.current()[0] != 99


def test_auto_policy_follows_the_estimator():
    # Rounds served by a random fallback: every first draft is rejected, so the mass moves to k = 0.
    miss_policy = parse_fan_out("auto", K=4)
    for _ in range(2000):
        miss_policy.estimator.observe_round(4, 0)
    assert miss_policy.current() == [10, 0, 0, 0, 0]
    # Rounds that always accept everything: the mass moves to k = K.
    hit_policy = parse_fan_out("auto", K=4)
    for _ in range(2000):
        hit_policy.estimator.observe_round(4, 4)
    assert hit_policy.current() == [0, 0, 0, 0, 10]
    # The two policies are independent; a shared estimator is possible when asked for.
    shared = AcceptanceEstimator()
    p1 = parse_fan_out("auto", K=2, estimator=shared)
    p2 = parse_fan_out(3, K=2, estimator=shared)
    assert p1.estimator is p2.estimator is shared


def test_auto_policy_budget_can_change_and_fixed_cannot():
    policy = parse_fan_out("auto", K=4)
    for _ in range(2000):
        policy.estimator.observe_round(4, 0)
    assert policy.current() == [10, 0, 0, 0, 0]
    policy.set_budget(17)
    assert policy.budget == 17 and policy.current() == [17, 0, 0, 0, 0]  # the cached allocation is redone
    with pytest.raises(ValueError, match="no adjustable budget"):
        parse_fan_out(2, K=4).set_budget(12)
    with pytest.raises(ValueError, match="budget must be an integer >= 1"):
        policy.set_budget(0)


# ------------------------------------------------------------------------------------------------
# dynamic fan-out


def test_parse_dynamic():
    policy = parse_fan_out(" Dynamic", K=4)
    assert policy.dynamic and policy.adjustable and not policy.is_auto and policy.budget == 10
    assert policy.plan(4) == policy.plan(0) == DynamicFanOut(10)
    policy.set_budget(13)
    assert policy.plan(2) == DynamicFanOut(13) and repr(policy) == "FanOutPolicy(K=4, dynamic, budget=13)"
    with pytest.raises(ValueError, match="no fixed F_0..F_K"):
        policy.current()
    assert parse_fan_out("dynamic", K=2, budget=5).plan(2) == DynamicFanOut(5)
    auto = parse_fan_out("auto", K=4, budget=6)
    assert auto.plan(1) == fold_fan_out(auto.current(), 1) and auto.plan(4) == auto.current()
    with pytest.raises(ValueError, match="budget"):
        DynamicFanOut(0)
    with pytest.raises(ValueError, match="either fixed or dynamic"):
        FanOutPolicy(2, fixed=FanOut((1, 1, 1)), dynamic=True)


# Three outcomes per k; P(0) = 0.5, P(1) = 0.5 * 0.2, P(2) = 0.5 * 0.8, so the weights P(k) P(c | k) are
# (0, 10) 0.3, (2, 30) 0.28, (0, 11) 0.15, (1, 20) 0.09, (2, 31) 0.08, (0, 12) 0.05, (1, 21) 0.01.
CANDIDATES = [[(10, 0.6), (11, 0.3), (12, 0.1)], [(20, 0.9), (21, 0.1)], [(30, 0.7), (31, 0.2)]]


@pytest.mark.parametrize(
    "budget, expected",
    [
        (1, [(0, 10)]),
        (2, [(0, 10), (2, 30)]),
        (4, [(0, 10), (0, 11), (1, 20), (2, 30)]),
        (6, [(0, 10), (0, 11), (0, 12), (1, 20), (2, 30), (2, 31)]),
        (50, [(0, 10), (0, 11), (0, 12), (1, 20), (1, 21), (2, 30), (2, 31)]),  # fewer candidates than budget
    ],
)
def test_dynamic_branches_hand_computed(budget, expected):
    outcomes = dynamic_branches(CANDIDATES, [0.5, 0.8], budget)
    assert [(o.k, o.token) for o in outcomes] == expected
    weights = {(0, 10): 0.3, (0, 11): 0.15, (0, 12): 0.05, (1, 20): 0.09, (1, 21): 0.01, (2, 30): 0.28, (2, 31): 0.08}
    assert [o.weight for o in outcomes] == pytest.approx([weights[key] for key in expected], abs=1e-15)


def _pairs(outcomes):
    return [(o.k, o.token) for o in outcomes]


def test_dynamic_branches_edges_and_ties():
    # every draft accepted for sure: only the bonus can happen; never accepted: only k = 0 (outcomes of
    # probability 0 get no branch, even when the budget has room)
    assert _pairs(dynamic_branches(CANDIDATES, [1.0, 1.0], 3)) == [(2, 30), (2, 31)]
    assert _pairs(dynamic_branches(CANDIDATES, [0.0, 1.0], 5)) == [(0, 10), (0, 11), (0, 12)]
    # no drafts (a first round, an empty filler): the bonus row is k = 0
    assert dynamic_branches([[(7, 0.9), (8, 0.1)]], [], 1) == [(0, 7, 0.9)]
    # equal weights: the smaller k, then the better rank
    assert _pairs(dynamic_branches([[(1, 0.5)], [(2, 0.5)]], [0.5], 1)) == [(0, 1)]
    assert _pairs(dynamic_branches([[(1, 0.25), (3, 0.25)], []], [0.0], 1)) == [(0, 1)]
    assert per_k_counts([(0, 10), (0, 11), (2, 30)], K=4) == [2, 0, 1, 0, 0]
    assert per_k_counts(dynamic_branches(CANDIDATES, [0.5, 0.8], 4), K=2) == [2, 1, 1]


def test_keeps_drafting_while_the_path_is_worth_the_marginal_branch():
    # branches of weights 0.3 and 0.05 (the least likely started): the likely one drafts while
    # 0.3 x P(its drafts so far accepted) >= 0.05, the marginal one stops after its first token
    assert keeps_drafting(0.3, 0.6, 0.05) and keeps_drafting(0.3, 0.6**3, 0.05)
    assert not keeps_drafting(0.3, 0.6**4, 0.05)
    assert not keeps_drafting(0.05, 0.99, 0.05) and keeps_drafting(0.05, 1.0, 0.05)


@pytest.mark.parametrize(
    "candidates, accept, budget, match",
    [
        (CANDIDATES, [0.5], 3, "k = 0..1"),
        (CANDIDATES, [0.5, 1.5], 3, "acceptance of draft 2"),
        (CANDIDATES, [0.5, 0.5], 0, "budget"),
        ([[(1, -0.1)], [], []], [0.5, 0.5], 1, "candidate probability"),
    ],
)
def test_dynamic_branches_validation(candidates, accept, budget, match):
    with pytest.raises(ValueError, match=match):
        dynamic_branches(candidates, accept, budget)


# ------------------------------------------------------------------------------------------------
# adaptive budget


def test_budget_controller_grows_holds_and_shrinks_exactly():
    ctl = BudgetController(K=4)
    assert (ctl.minimum, ctl.budget, ctl.maximum) == (5, 10, 30)
    assert ctl.observe(build_s=0.050, idle_s=0.006) == 11  # idle 12% of the build: one more branch
    assert ctl.observe(build_s=0.050, idle_s=0.004) == 11  # 8%: hold
    assert ctl.observe(build_s=0.050, idle_s=0.0001) == 10  # request already waiting: shrink by 11 // 8 = 1
    for _ in range(40):
        ctl.observe(0.050, 0.010)
    assert ctl.budget == 30  # capped
    assert ctl.observe(0.050, 0.0) == 27  # an eighth of 30, rounded down
    for _ in range(40):
        ctl.observe(0.050, 0.0)
    assert ctl.budget == 5  # never below K + 1: one candidate per acceptance length


def test_budget_controller_follows_the_verification_time():
    """Simulated rounds: a build costs 40 ms + 1 ms per branch. With 60 ms verifications the controller
    climbs while the idle time exceeds 10% of the build, i.e. to b = 15 (idle 5 ms < 5.5 ms), never late.
    When verification drops to 50 ms (a shorter batch), builds of 15 branches are late and it backs off."""
    ctl = BudgetController(K=4, maximum=64)

    def run(verify_s: float, rounds: int) -> tuple[list[int], int]:
        history, late = [], 0
        for _ in range(rounds):
            build = 0.040 + 0.001 * ctl.budget
            idle = max(0.0, verify_s - build)
            late += idle < BudgetController.LATE_S
            history.append(ctl.observe(build, idle))
        return history, late

    history, late = run(0.060, 100)
    assert history[-10:] == [15] * 10 and late == 0
    history, late = run(0.050, 100)
    assert max(history[-50:]) <= 10 and late >= 1  # 40 + b ms must fit in 50 ms
    assert min(history[-50:]) >= 8


def test_budget_controller_validation():
    with pytest.raises(ValueError, match="below K \\+ 1"):
        BudgetController(K=4, maximum=3)
    assert BudgetController(K=2, maximum=4).budget == 4  # starts at min(2 (K + 1), maximum)


def test_max_fan_out_budget():
    assert max_fan_out_budget(FanOutChoice.parse("4,2,1,1,0"), K=4, budget=None) == 8
    assert max_fan_out_budget(FanOutChoice.parse(3), K=4, budget=None) == 15
    assert max_fan_out_budget(FanOutChoice.parse("auto"), K=4, budget=None) == BudgetController.max_budget(4) == 30
    assert max_fan_out_budget(FanOutChoice.parse("auto"), K=4, budget=40) == 40
    assert max_fan_out_budget(FanOutChoice.parse("dynamic"), K=4, budget=None) == 30
    assert max_fan_out_budget(FanOutChoice.parse("dynamic"), K=4, budget=7) == 7
    assert max_fan_out_budget(FanOutChoice.parse(2), K=4, budget=40) == 10  # a fixed spec ignores the auto budget


# ------------------------------------------------------------------------------------------------
# online estimator


def _truncated_geometric(rng: np.random.Generator, a: float, K: int, n: int) -> np.ndarray:
    """Accepted counts k for n rounds of K Bernoulli(a) positions stopped at the first rejection."""
    accepted = rng.random((n, K)) < a  # [n, K]
    return np.where(accepted.all(axis=1), K, np.argmin(accepted, axis=1))


def test_acceptance_rate_exact_mle_and_decay():
    est = AcceptanceEstimator(prior_acceptance=0.5, prior_weight=2.0, decay=1.0)
    assert est.acceptance_rate == 0.5  # prior: 1 accepted of 2 attempted
    est.observe_round(4, 4)  # 4 of 4 attempted: 5 / 6
    est.observe_round(4, 1)  # 1 accepted, 2 attempted: 6 / 8
    est.observe_round(4, 0)  # 0 accepted, 1 attempted: 6 / 9
    assert est.acceptance_rate == pytest.approx(6 / 9, abs=1e-15)
    # forgetting is per attempted position: a round that attempted n positions scales the counts by d^n.
    decayed = AcceptanceEstimator(prior_acceptance=0.5, prior_weight=2.0, decay=0.5)
    decayed.observe_round(2, 2)  # 2 attempted: accepted 1 * .25 + 2 = 2.25, attempted 2 * .25 + 2 = 2.5
    decayed.observe_round(2, 0)  # 1 attempted: accepted 1.125, attempted 1.25 + 1 = 2.25
    assert decayed.acceptance_rate == pytest.approx(1.125 / 2.25, abs=1e-15)


def test_observe_round_validation_and_empty_rounds():
    est = AcceptanceEstimator()
    version = est.version
    est.observe_round(0, 0)  # nothing proposed: nothing learned
    assert est.version == version
    for drafts, accepted in ((3, 4), (3, -1), (-1, 0), (3, True)):
        with pytest.raises(ValueError):
            est.observe_round(drafts, accepted)


def test_acceptance_rate_converges_on_synthetic_stream():
    rng = np.random.default_rng(1234)
    est = AcceptanceEstimator(decay=1.0)
    for k in _truncated_geometric(rng, 0.7, 4, 5000):
        est.observe_round(4, int(k))
    assert abs(est.acceptance_rate - 0.7) < 0.02


def test_acceptance_rate_adapts_with_forgetting():
    rng = np.random.default_rng(99)
    est = AcceptanceEstimator(decay=0.999)
    for k in _truncated_geometric(rng, 0.9, 5, 3000):
        est.observe_round(5, int(k))
    assert abs(est.acceptance_rate - 0.9) < 0.03
    for k in _truncated_geometric(rng, 0.3, 5, 3000):
        est.observe_round(5, int(k))
    assert abs(est.acceptance_rate - 0.3) < 0.04


def test_miss_exponent_exact_fit():
    est = AcceptanceEstimator(lookup_decay=1.0, min_lookups=32)
    # F = 4: 33 lookups, 8 misses -> smoothed miss (8 + 0.5) / 34 = 1/4 = 4^(-1), so r = 1.
    for i in range(33):
        est.observe_lookup(4, hit=i >= 8)
    assert est.miss_exponent == pytest.approx(1.0, abs=1e-12)
    # F = 2 with the same counts: miss 1/4 = 2^(-2). Weighted least squares through the origin:
    # r = -(ln2 * -2ln2 + 2ln2 * -2ln2) / (ln2^2 + (2ln2)^2) = 6/5.
    for i in range(33):
        est.observe_lookup(2, hit=i >= 8)
    assert est.miss_exponent == pytest.approx(1.2, abs=1e-12)


def test_miss_exponent_defaults_and_clamps():
    est = AcceptanceEstimator(default_r=0.8, r_bounds=(0.1, 3.0), min_lookups=32, lookup_decay=1.0)
    assert est.miss_exponent == 0.8  # no data
    for i in range(100):  # F = 0 and F = 1 say nothing about r
        est.observe_lookup(0, hit=False)
        est.observe_lookup(1, hit=i % 2 == 0)
    assert est.miss_exponent == 0.8
    for _ in range(31):  # below min_lookups at F >= 2
        est.observe_lookup(3, hit=True)
    assert est.miss_exponent == 0.8
    est.observe_lookup(3, hit=True)  # 32 hits of 32 at F = 3: the fit is huge, clamped to the bound
    assert est.miss_exponent == 3.0
    low = AcceptanceEstimator(r_bounds=(0.1, 3.0), min_lookups=8, lookup_decay=1.0)
    for _ in range(50):  # never a hit at F = 8: r -> ~0, clamped to the lower bound
        low.observe_lookup(8, hit=False)
    assert low.miss_exponent == 0.1
    with pytest.raises(ValueError, match="impossible"):
        est.observe_lookup(0, hit=True)
    with pytest.raises(ValueError, match="fan_out_k"):
        est.observe_lookup(-1, hit=False)
    with pytest.raises(ValueError, match="default_r"):
        AcceptanceEstimator(default_r=9.0, r_bounds=(0.1, 3.0))


def test_miss_exponent_recovered_from_synthetic_hits():
    rng = np.random.default_rng(7)
    r_true = 0.7
    est = AcceptanceEstimator(lookup_decay=1.0)
    for fan_out in np.repeat([1, 2, 3, 4, 6, 8], 3000)[rng.permutation(18000)]:
        est.observe_lookup(int(fan_out), hit=bool(rng.random() < 1.0 - fan_out ** (-r_true)))
    assert abs(est.miss_exponent - r_true) < 0.05


def test_hit_rate():
    est = AcceptanceEstimator(prior_hit_rate=0.5, lookup_decay=1.0)
    assert est.hit_rate == 0.5
    for hit in (True, True, True, False):
        est.observe_lookup(2, hit)
    assert est.hit_rate == pytest.approx((0.5 + 3) / (1 + 4), abs=1e-15)


# ------------------------------------------------------------------------------------------------
# expected values and the fallback choice


def test_expected_tokens_per_round():
    assert expected_tokens_per_round(0.5, 2) == 1.75
    assert expected_tokens_per_round(0.0, 4) == 1.0
    assert expected_tokens_per_round(1.0, 4) == 5.0
    assert expected_tokens_per_round(0.8, 3) == pytest.approx(1 + 0.8 + 0.64 + 0.512, abs=1e-15)
    # matches E[k + 1] computed from the distribution
    probs = acceptance_length_probs(0.7, 6)
    assert expected_tokens_per_round(0.7, 6) == pytest.approx(sum((k + 1) * p for k, p in enumerate(probs)))


# ------------------------------------------------------------------------------------------------
# the draft worker's planner


def _worker_config(**overrides):
    """The speculative options the draft worker's planner reads."""
    from ssd.config import SpeculativeConfig

    return SpeculativeConfig(**{"method": "ssd", "model": "unused", "fan_out": "auto", **overrides})


def test_planner_steers_the_budget_of_auto_and_dynamic_policies_only():
    from ssd.speculative.async_draft.worker import FanOutPlanner

    planner = FanOutPlanner(_worker_config(fan_out="4,2,1,1,0", fan_out_miss="auto"))
    assert sum(planner.plan(True, 4)) == 8 and sum(planner.plan(False, 4)) == 10
    planner.observe_timing(build_s=0.05, idle_s=0.02)
    assert sum(planner.plan(True, 4)) == 8 and sum(planner.plan(False, 4)) == 11
    planner.observe_timing(build_s=0.05, idle_s=0.0)
    assert sum(planner.plan(False, 4)) == 10

    fixed_budget = FanOutPlanner(_worker_config(fan_out_budget=20))
    fixed_budget.observe_timing(build_s=0.05, idle_s=0.0)  # a user-given budget is never steered
    assert sum(fixed_budget.plan(True, 4)) == sum(fixed_budget.plan(False, 4)) == 20

    dynamic = FanOutPlanner(_worker_config(fan_out="dynamic", fan_out_miss="3"))
    assert dynamic.plan(True, 4) == DynamicFanOut(10) and dynamic.plan(False, 4) == [3] * 5
    assert dynamic.plan(False, 1) == [3, 12, 0, 0, 0]  # a fixed plan folds the lengths a short filler cannot reach
    dynamic.observe_timing(build_s=0.05, idle_s=0.02)
    assert dynamic.plan(True, 2) == DynamicFanOut(11)  # the fork spreads it over the drafts there are


def test_planner_feeds_only_auto_estimators():
    from ssd.speculative.async_draft.worker import FanOutPlanner

    planner = FanOutPlanner(_worker_config(fan_out="auto", fan_out_miss="dynamic"))
    hit_version, miss_version = planner.hit.estimator.version, planner.miss.estimator.version
    planner.observe(served_by_hit=True, k=2, num_drafts=4, hit=True, fan_out_k=3)
    planner.observe(served_by_hit=False, k=0, num_drafts=0, hit=False, fan_out_k=5)
    assert planner.hit.estimator.version == hit_version + 2  # the round and the lookup
    assert planner.miss.estimator.version == miss_version  # a dynamic plan never reads it
