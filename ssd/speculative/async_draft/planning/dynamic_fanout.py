"""The "dynamic" fan-out: each sequence's cache build spends its branch budget on the outcomes the draft finds
likeliest, and each branch drafts as deep as it is worth (pure Python, unit tested with exact values).

Verifying a speculation of n drafts ends with k accepted drafts and then a token c (the recovery token for
k < n, the bonus for k = n). The draft estimates P(k) from its probability of each draft, mapped to the
acceptance rate measured for such probabilities (``calibration.py``), and P(c | k) from its distribution at
k without the rejected draft; the M likeliest outcomes get the branches (`dynamic_branches`). A confident
speculation puts its branches deep, an uncertain one on k = 0. In the tree a branch drafts its next token
only while that token is worth the least likely branch's first (`keeps_drafting`), so the tree narrows with
depth and costs fewer rows than M full branches; the budget controller (``fanout.BudgetController``) turns
the saving into more branches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from ssd.speculative.async_draft.planning.estimator import check_budget, check_rate


@dataclass(frozen=True)
class DynamicFanOut:
    """A plan of `budget` branches that the fork spreads over (k, c) by the draft's own probabilities."""

    budget: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "budget", check_budget(self.budget))


class Outcome(NamedTuple):
    """A possible result of verifying a speculation: k drafts accepted, then `token`; `weight` = its
    probability as estimated when the branch for it was chosen."""

    k: int
    token: int
    weight: float


def dynamic_branches(
    candidates: Sequence[Sequence[tuple[int, float]]], accept: Sequence[float], budget: int
) -> list[Outcome]:
    """The `budget` likeliest outcomes (k, c) of verifying a speculation of n = len(accept) drafts.

    ``accept[i]``: the probability that the target accepts draft i + 1 once it reached it;
    ``candidates[k]`` (k = 0..n): candidate tokens c with P(c | the round ends at k), most likely first (for
    k < n the recovery tokens, which never include the rejected draft; for k = n the bonus tokens).
    P(k) = accept[0] ... accept[k-1] (1 - accept[k]) (no last factor for k = n), and an outcome's weight is
    P(k) P(c | k); outcomes of weight 0 get no branch. Returns the chosen outcomes ordered by k, then as
    ranked in ``candidates``; equal weights go to the smaller k, then the better rank (deterministic).
    """
    n = len(accept)
    if len(candidates) != n + 1:
        raise ValueError(f"need candidates for k = 0..{n} ({n + 1} lists), got {len(candidates)}")
    budget = check_budget(budget)
    scored = []
    reach = 1.0
    for k, ranked in enumerate(candidates):
        a = check_rate(f"acceptance of draft {k + 1}", accept[k]) if k < n else 0.0
        stop = reach * (1.0 - a)
        for rank, (token, prob) in enumerate(ranked):
            weight = stop * check_rate("candidate probability", prob)
            if weight > 0.0:
                scored.append((-weight, k, rank, token))
        reach *= a
    chosen = sorted(sorted(scored)[:budget], key=lambda s: (s[1], s[2]))
    return [Outcome(k, token, -neg_weight) for neg_weight, k, _, token in chosen]


def keeps_drafting(weight: float, path_acceptance: float, marginal_weight: float) -> bool:
    """Whether a dynamic branch drafts one more token (each branch drafts its first token regardless).

    A branch's next token is worth its outcome's weight times the probability that its drafted tokens so
    far are all accepted (`path_acceptance`); it is drafted while that is at least the weight of the least
    likely branch the plan started (`marginal_weight`), whose first token was deemed worth a row. Likely
    branches draft deep, unlikely ones stop after a token or two: the tree costs fewer rows than `budget`
    full branches, and the budget controller turns the saving into more branches."""
    return weight * path_acceptance >= marginal_weight
