"""Saguaro sampling: draw drafts from q scaled down on the tokens the SSD fork step will cache.

With q_C(x) proportional to C * q(x) on the cached candidates and q(x) elsewhere (0 < C <= 1), the residual
max(0, p - q_C) that a rejection samples from puts more mass on the cached candidates, so the recovery
token is more often one the draft prepared for. Verification uses q_C itself, so outputs stay exact; the
cost is some acceptance, since q_C departs from q.
"""

from __future__ import annotations

import torch


def saguaro_scale(probs: torch.Tensor, candidate_ids: torch.Tensor, c: float) -> torch.Tensor:
    """``probs [N, V]`` with the columns ``candidate_ids [N, F]`` multiplied by ``c``, renormalised.

    A row whose whole mass sits on its candidates (e.g. greedy one-hots) comes back unchanged.
    """
    if c >= 1.0 or candidate_ids.numel() == 0:
        return probs
    scale = torch.ones_like(probs)  # [N, V]
    scale.scatter_(1, candidate_ids, c)
    scaled = probs * scale  # [N, V]
    return scaled / scaled.sum(dim=-1, keepdim=True)
