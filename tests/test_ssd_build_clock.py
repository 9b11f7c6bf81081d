"""BuildClock: when the SSD draft worker ends a cache build early (fake clock and poll, exact values)."""

import pytest

from ssd.speculative.async_draft.planning.build_clock import BuildClock


class Fake:
    def __init__(self) -> None:
        self.now = 0.0
        self.waiting = False

    def clock(self) -> float:
        return self.now

    def poll(self) -> bool:
        return self.waiting


def _clock_with_gap(fake: Fake, gap: float) -> BuildClock:
    clock = BuildClock(fake.poll, fake.clock)
    clock.replied()
    fake.now += gap
    assert clock.message_arrived(fake.now, is_request=True) == fake.now
    assert clock.gap_s == gap
    return clock


def test_without_a_measured_gap_only_a_waiting_message_stops_a_build():
    fake = Fake()
    clock = BuildClock(fake.poll, fake.clock)
    clock.replied()
    clock.start_build()
    for _ in range(5):
        fake.now += 100.0
        assert not clock.should_stop()
    fake.waiting = True
    assert clock.should_stop() and not clock.ended_by_deadline


def test_a_step_that_would_overrun_the_due_request_is_not_started():
    fake = Fake()
    clock = _clock_with_gap(fake, 10.0)
    fake.now = 100.0
    clock.replied()  # the next request is due at 110
    clock.start_build()
    fake.now = 104.0  # glue + first step took 4: the next step is taken to last 2
    assert not clock.should_stop()
    fake.now = 107.0  # a step of 3: 107 + 3 = 110 ends just in time
    assert not clock.should_stop()
    fake.now = 109.0  # a step of 2: 109 + 2 > 110
    assert clock.should_stop() and clock.ended_by_deadline
    clock.start_build()
    assert not clock.ended_by_deadline


def test_a_build_not_started_by_a_reply_has_no_deadline():
    fake = Fake()
    clock = _clock_with_gap(fake, 10.0)
    clock.replied()
    fake.now += 1.0
    clock.message_arrived(fake.now, is_request=False)  # e.g. a prefill: its first-round build follows
    assert clock.gap_s == 10.0  # only requests after a reply measure the gap
    clock.start_build()
    for _ in range(3):
        fake.now += 50.0
        assert not clock.should_stop()


def test_gap_moving_average_and_arrival_seen_by_a_build():
    fake = Fake()
    clock = _clock_with_gap(fake, 10.0)
    clock.replied()
    clock.start_build()
    fake.now += 4.0
    fake.waiting = True  # the request is found waiting after a tree step, 4 after the reply
    assert clock.should_stop() and not clock.ended_by_deadline
    fake.now += 3.0  # the step in flight ends; the worker receives the request
    fake.waiting = False
    assert clock.message_arrived(fake.now, is_request=True) == fake.now - 3.0
    assert clock.gap_s == pytest.approx(10.0 + BuildClock.SMOOTHING * (4.0 - 10.0))
