"""When the SSD draft worker ends a cache build early (pure Python, unit tested with a fake clock).

The target waits for the draft whenever its next request arrives while a tree step is running: a step (one
batched forward) cannot be interrupted, so a build that overruns costs the target the rest of that step.
`BuildClock.should_stop` is asked after every tree step and ends the build

- when a message is already waiting (the next request, usually), or
- when the next step, taking as long as the last one, would still be running when the next request is due:
  the target would wait for it, and the deepest tokens it would add are the least likely to be used.

The next request is due the usual gap after the reply that started the build: the time from a reply to the
next request (the target's verification and its engine step) is tracked as an exponential moving average.
Before a gap was measured, and for builds not started by a reply (a prompt's first-round build), only a
waiting message ends a build.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class BuildClock:
    SMOOTHING = 0.3  # weight of the newest gap in the moving average

    def __init__(self, poll: Callable[[], bool], clock: Callable[[], float] = time.perf_counter) -> None:
        self.poll = poll
        self.clock = clock
        self.gap_s: float | None = None  # reply -> next request, moving average
        self.ended_by_deadline = False  # the last build stopped because its next step would overrun
        self._replied_at: float | None = None
        self._seen_waiting_at: float | None = None  # when a build first found a message waiting
        self._build_start: float | None = None
        self._last_check: float | None = None

    def replied(self) -> None:
        """A speculation reply has just been sent: the next request is due one gap from now."""
        self._replied_at = self.clock()

    def message_arrived(self, at: float, is_request: bool) -> float:
        """A message was received at `at`; returns when it arrived as far as known (the moment a build found
        it waiting, if earlier). A request that follows a reply updates the gap."""
        arrived = at if self._seen_waiting_at is None else min(at, self._seen_waiting_at)
        if is_request and self._replied_at is not None:
            sample = max(0.0, arrived - self._replied_at)
            self.gap_s = sample if self.gap_s is None else self.gap_s + self.SMOOTHING * (sample - self.gap_s)
        self._replied_at = None
        self._seen_waiting_at = None
        return arrived

    def start_build(self) -> None:
        self._build_start = self.clock()
        self._last_check = None
        self.ended_by_deadline = False

    def should_stop(self) -> bool:
        """Asked after each tree step of the build begun by the last `start_build`."""
        now = self.clock()
        if self.poll():
            if self._seen_waiting_at is None:
                self._seen_waiting_at = now
            return True
        if self._last_check is not None:
            step = now - self._last_check
        else:  # the first check follows the glue and the first tree step: count half of it as one step
            step = (now - (self._build_start if self._build_start is not None else now)) / 2
        self._last_check = now
        if self._replied_at is None or self.gap_s is None:
            return False
        if now + step > self._replied_at + self.gap_s:
            self.ended_by_deadline = True
            return True
        return False
