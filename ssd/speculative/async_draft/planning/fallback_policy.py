"""Which fallback serves an SSD cache miss: a fixed one ("jit", "random") or "auto", chosen by measured
throughput (pure Python, unit tested).

Why measure instead of model: the fallback changes more than the cost of a miss. A random filler is
almost always rejected, so the next lookup lands on k = 0, where the fan-out puts most branches, and the
cache hit rate rises (0.28 with jit vs 0.47 with random on HumanEval with the default pair); jit drafts are
accepted further but put K draft steps on the critical path. Which wins depends on the draft, the hardware
and the batch size, so "auto" runs each fallback for a short window and keeps the faster:

- per batch size (throughput and the hit rate both depend on it), a cycle of `EXPLORE_ROUNDS` rounds with
  jit, `EXPLORE_ROUNDS` with random, then an exploit window with whichever emitted more tokens per second,
  once each has been measured over at least `MIN_MEASURED_ROUNDS` rounds (until then cycles only explore);
- the exploit window is `EXPLOIT_ROUNDS` long and doubles (up to `MAX_EXPLOIT_ROUNDS`) each time the same
  fallback wins again, back to `EXPLOIT_ROUNDS` when the other one wins: where one fallback is clearly
  faster, the rounds spent exploring the slower one fall from a fifth to a few percent, and a change in
  conditions is still noticed within `MAX_EXPLOIT_ROUNDS` rounds;
- a fallback's rate is the tokens emitted over the wall time of its measured rounds (propose to verified, so
  the draft's serve time, the verification and the hit rate all count), both sums discounted by `DISCOUNT`
  at the end of each of its windows: a ratio of sums over several windows, not a mean of short-window
  ratios, because one round emits anywhere from 1 to K + 1 tokens and 8 rounds alone are too noisy to rank
  two fallbacks 10-20% apart. Exploit windows refresh the winner's sums too.
The first window of a cycle also pays for the previous fallback's cache, which is the same for both.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ssd.options import Fallback


@dataclass
class _Window:
    kind: Fallback
    rounds: int
    rounds_left: int = field(init=False)
    tokens: int = 0
    seconds: float = 0.0

    def __post_init__(self) -> None:
        self.rounds_left = self.rounds


@dataclass
class _Measured:
    """Discounted sums over a fallback's measured rounds."""

    tokens: float = 0.0
    seconds: float = 0.0
    rounds: int = 0  # undiscounted: how much evidence there is

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds


@dataclass
class _BatchSizeTrial:
    """The explore/exploit cycle and the measurements for one batch size."""

    measured: dict[Fallback, _Measured] = field(default_factory=dict)  # fallback -> its sums
    window: _Window | None = None
    next_explore: int = 0  # index into the exploration order
    winner: Fallback | None = None  # the fallback of the last exploit window
    exploit_rounds: int = 0  # its length


class FallbackPolicy:
    EXPLORE_ROUNDS = 8
    EXPLOIT_ROUNDS = 64
    MAX_EXPLOIT_ROUNDS = 512
    MIN_MEASURED_ROUNDS = 16
    DISCOUNT = 0.75
    EXPLORE_ORDER: tuple[Fallback, Fallback] = (Fallback.JIT, Fallback.RANDOM)

    def __init__(self, kind: Fallback | str) -> None:
        self.kind = Fallback.parse(kind, "fallback")
        self._trials: dict[int, _BatchSizeTrial] = {}

    def choose(self, batch_size: int) -> Fallback:
        """The fallback for the next round of a batch of `batch_size` sequences."""
        if self.kind is not Fallback.AUTO:
            return self.kind
        trial = self._trials.setdefault(batch_size, _BatchSizeTrial())
        if trial.window is None or trial.window.rounds_left <= 0:
            trial.window = self._next_window(trial)
        return trial.window.kind

    def observe_round(self, batch_size: int, tokens: int, seconds: float) -> None:
        """A round of `batch_size` sequences (served with this policy's last choice for that size) emitted
        `tokens` tokens in `seconds` (from the proposal request to the end of verification)."""
        trial = self._trials.get(batch_size)
        if self.kind is not Fallback.AUTO or trial is None or trial.window is None or trial.window.rounds_left <= 0:
            return
        w = trial.window
        w.tokens += tokens
        w.seconds += max(seconds, 0.0)
        w.rounds_left -= 1
        if w.rounds_left == 0 and w.seconds > 0.0:
            m = trial.measured.setdefault(w.kind, _Measured())
            m.tokens = self.DISCOUNT * m.tokens + w.tokens
            m.seconds = self.DISCOUNT * m.seconds + w.seconds
            m.rounds += w.rounds

    def rates(self, batch_size: int) -> dict[Fallback, float]:
        """Measured tokens per second per fallback at `batch_size` (empty until a window has ended)."""
        trial = self._trials.get(batch_size)
        return {} if trial is None else {kind: m.rate for kind, m in trial.measured.items()}

    def _next_window(self, trial: _BatchSizeTrial) -> _Window:
        if trial.next_explore < len(self.EXPLORE_ORDER):
            kind = self.EXPLORE_ORDER[trial.next_explore]
            trial.next_explore += 1
            return _Window(kind, self.EXPLORE_ROUNDS)
        trial.next_explore = 0
        measured = [trial.measured.get(kind) for kind in self.EXPLORE_ORDER]
        if any(m is None or m.rounds < self.MIN_MEASURED_ROUNDS for m in measured):  # not enough evidence yet
            return self._next_window(trial)
        # ties: random, which frees the draft sooner
        best = max(self.EXPLORE_ORDER, key=lambda k: (trial.measured[k].rate, k is Fallback.RANDOM))
        if best == trial.winner:
            trial.exploit_rounds = min(self.MAX_EXPLOIT_ROUNDS, 2 * trial.exploit_rounds)
        else:
            trial.winner, trial.exploit_rounds = best, self.EXPLOIT_ROUNDS
        return _Window(best, trial.exploit_rounds)
