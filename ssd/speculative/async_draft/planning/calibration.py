"""How often the target accepts a draft token that the draft proposed with probability p (online, pure Python).

The dynamic fan-out (``fanout.DYNAMIC``) ranks a round's possible outcomes by how likely the target is to
accept each draft. The draft's own probability p of a token is the natural predictor, but a small draft is
miscalibrated (over-confident on some text, under-confident on other), and a token copied by prompt lookup
is accepted far more often than the draft's p for it suggests. So the engine maps p to a measured rate:
`NUM_BUCKETS` equal-width buckets of p, separately for model-proposed and copied tokens, each with decayed
counts of accepted and verified positions and a prior of `prior_weight` pseudo-positions accepted at rate p
itself, so that with no data the estimate is p and every bucket moves to its measured rate as positions
arrive (a memory of about 1 / (1 - decay) positions per bucket).
"""

from __future__ import annotations

import math

from ssd.speculative.async_draft.planning.estimator import check_rate

NUM_BUCKETS = 10


class AcceptanceCalibration:
    def __init__(self, prior_weight: float = 4.0, decay: float = 0.995) -> None:
        if isinstance(prior_weight, bool) or not isinstance(prior_weight, (int, float)) or not (
            0.0 < prior_weight < math.inf
        ):
            raise ValueError(f"prior_weight must be a finite number > 0, got {prior_weight!r}")
        self.prior_weight = float(prior_weight)
        self.decay = check_rate("decay", decay)
        # (copied, bucket) -> [accepted, verified], decayed
        self._counts: dict[tuple[bool, int], list[float]] = {}

    @staticmethod
    def bucket(p: float) -> int:
        return min(NUM_BUCKETS - 1, max(0, int(p * NUM_BUCKETS)))

    def rate(self, p: float, copied: bool = False) -> float:
        """The estimated probability that the target accepts a draft token the draft gave probability `p`."""
        p = check_rate("draft probability p", p)
        accepted, verified = self._counts.get((bool(copied), self.bucket(p)), (0.0, 0.0))
        return (accepted + self.prior_weight * p) / (verified + self.prior_weight)

    def observe(self, p: float, copied: bool, accepted: bool) -> None:
        """One verified draft position: the draft gave its token probability `p`; the target accepted it or not."""
        p = check_rate("draft probability p", p)
        counts = self._counts.setdefault((bool(copied), self.bucket(p)), [0.0, 0.0])
        counts[0] = self.decay * counts[0] + (1.0 if accepted else 0.0)
        counts[1] = self.decay * counts[1] + 1.0

    def observe_round(self, confidences: list[float], copied: list[bool], num_accepted: int) -> None:
        """A verified speculation whose drafts had probabilities `confidences`: the first `num_accepted` were
        accepted and the next one, if any, rejected; later drafts were never looked at."""
        n = len(confidences)
        if len(copied) != n:
            raise ValueError(f"got {n} confidences but {len(copied)} copied flags")
        if not (0 <= num_accepted <= n):
            raise ValueError(f"num_accepted must be in [0, {n}], got {num_accepted!r}")
        for i in range(min(num_accepted + 1, n)):
            self.observe(confidences[i], copied[i], i < num_accepted)
