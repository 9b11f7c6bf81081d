"""AcceptanceCalibration: draft probability -> measured acceptance rate (exact values, pure Python)."""

import random

import pytest

from ssd.speculative.async_draft.planning.calibration import NUM_BUCKETS, AcceptanceCalibration


def test_without_data_the_rate_is_the_draft_probability():
    cal = AcceptanceCalibration()
    for p in (0.0, 0.05, 0.5, 0.93, 1.0):
        assert cal.rate(p) == p and cal.rate(p, copied=True) == p


def test_buckets():
    assert [AcceptanceCalibration.bucket(p) for p in (0.0, 0.099, 0.1, 0.55, 0.999, 1.0)] == [0, 0, 1, 5, 9, 9]
    assert NUM_BUCKETS == 10


def test_exact_update_with_prior_and_decay():
    cal = AcceptanceCalibration(prior_weight=2.0, decay=0.5)
    cal.observe(0.62, copied=False, accepted=True)  # bucket 6: accepted 1, verified 1
    assert cal.rate(0.6) == pytest.approx((1 + 2 * 0.6) / (1 + 2))
    cal.observe(0.69, copied=False, accepted=False)  # accepted 0.5, verified 1.5
    assert cal.rate(0.65) == pytest.approx((0.5 + 2 * 0.65) / (1.5 + 2))
    # other buckets and copied tokens keep their own counts
    assert cal.rate(0.75) == 0.75 and cal.rate(0.65, copied=True) == 0.65


def test_observe_round_counts_the_verified_positions_only():
    cal = AcceptanceCalibration(prior_weight=1.0, decay=1.0)
    # 2 of 4 accepted: drafts 1, 2 accepted, 3 rejected, 4 never looked at
    cal.observe_round([0.95, 0.15, 0.35, 0.55], [False, True, False, False], num_accepted=2)
    assert cal.rate(0.95) == pytest.approx((1 + 0.95) / 2)
    assert cal.rate(0.15, copied=True) == pytest.approx((1 + 0.15) / 2)
    assert cal.rate(0.35) == pytest.approx(0.35 / 2)
    assert cal.rate(0.55) == 0.55
    cal.observe_round([0.55, 0.55], [False, False], num_accepted=2)  # all accepted: both count
    assert cal.rate(0.55) == pytest.approx((2 + 0.55) / 3)
    cal.observe_round([], [], num_accepted=0)  # no drafts: nothing to learn


def test_converges_to_the_measured_rate():
    rng = random.Random(0)
    cal = AcceptanceCalibration()
    for _ in range(4000):  # an over-confident draft: p = 0.9 accepted 60% of the time
        cal.observe(0.9, copied=False, accepted=rng.random() < 0.6)
    assert cal.rate(0.9) == pytest.approx(0.6, abs=0.08)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda c: c.rate(1.5), "draft probability"),
        (lambda c: c.observe(-0.1, False, True), "draft probability"),
        (lambda c: c.observe_round([0.5], [], 0), "copied flags"),
        (lambda c: c.observe_round([0.5], [False], 2), "num_accepted"),
        (lambda c: AcceptanceCalibration(prior_weight=0), "prior_weight"),
        (lambda c: AcceptanceCalibration(decay=1.5), "decay"),
    ],
)
def test_validation(call, match):
    with pytest.raises(ValueError, match=match):
        call(AcceptanceCalibration())
