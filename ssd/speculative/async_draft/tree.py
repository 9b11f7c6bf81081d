"""The tree of one SSD cache build (see ``draft_engine.py``): which branches a sequence forks after the glue,
with a fixed fan-out or a dynamic plan, and the attention layout of one tree depth."""

from __future__ import annotations

import numpy as np
import torch

from ssd.models.attention_layout import block_slots
from ssd.runtime.forward_items import ForwardItem
from ssd.speculative.async_draft.draft_state import Branch, DraftSeqState
from ssd.speculative.async_draft.planning.calibration import AcceptanceCalibration
from ssd.speculative.async_draft.planning.dynamic_fanout import Outcome, dynamic_branches
from ssd.speculative.drafting import DraftDistribution


def fork_fixed(state: DraftSeqState, logits: torch.Tensor, dist: DraftDistribution) -> list[tuple[int, int]]:
    """Branches (k, c) for one sequence with the F_0..F_K of ``state.fan_out``, ordered by k then by draft
    likelihood, from the glue's ``logits [n+1, Vd]``. The bonus token (k = n) is first guessed by prompt
    lookup when it has a proposal: long copied spans are accepted whole."""
    fan_out = state.fan_out
    drafts = state.speculation[1:]
    num_drafts = len(drafts)
    top = dist.top_tokens(logits, max(fan_out[: num_drafts + 1]) + 1).tolist()  # [K+1, F+1]
    branches = []
    for k in range(num_drafts + 1):
        f = fan_out[k] if k < len(fan_out) else 0
        ranked = top[k]
        if k < num_drafts:
            ranked = [t for t in ranked if t != drafts[k]]
        elif f > 0 and (copied := state.copy(drafts)) is not None:
            ranked = [copied] + [t for t in ranked if t != copied]
        branches.extend((k, c) for c in ranked[:f])
    return branches


def fork_dynamic(state: DraftSeqState, logits: torch.Tensor, dist: DraftDistribution,
                 calibration: AcceptanceCalibration, budget: int) -> list[Outcome]:
    """The `budget` outcomes (k, c) likeliest by the draft's glue distributions (``dynamic_branches``):
    each draft is accepted with the calibrated rate for the draft's probability of it, a recovery token
    c at k < n has the draft's probability of c given that e_{k+1} was rejected, a bonus token its plain
    probability; prompt lookup's copy for the bonus counts as at least as likely as the draft's top. Sets
    ``state.confidences`` (the draft's probabilities of its drafts, for calibrating on the outcome)."""
    drafts = state.speculation[1:]
    n = len(drafts)
    copied = state.copy(drafts)  # prompt lookup's bonus, if any
    top = dist.top_tokens(logits, budget + 1)  # [n+1, budget+1]
    extra = torch.tensor(drafts + [-1 if copied is None else copied], dtype=torch.long, device=top.device)
    probs = dist.token_probs(logits, torch.cat([top, extra[:, None]], dim=1)).tolist()  # [n+1, budget+2]
    drafted = [row[-1] for row in probs[:n]]
    candidates = []
    for k, (tokens, ps) in enumerate(zip(top.tolist(), probs)):
        pairs = list(zip(tokens, ps))
        if k < n:
            rest = max(1.0 - drafted[k], 1e-12)
            pairs = [(t, min(1.0, p / rest)) for t, p in pairs if t != drafts[k]]
        elif copied is not None:
            pairs = [(copied, max(ps[-1], ps[0]))] + [(t, p) for t, p in pairs if t != copied]
        candidates.append(pairs[:budget])
    state.confidences = [min(1.0, p) for p in drafted]
    accept = [calibration.rate(p, c) for p, c in zip(state.confidences, state.copied)]
    return dynamic_branches(candidates, accept, budget)


def tree_item(state: DraftSeqState, branches: list[Branch], j: int, num_glued: int, block_size: int) -> ForwardItem:
    """Depth j of one sequence's tree: a row per branch still drafting, each reading the committed tokens, the
    drafts it continues and its own earlier tree tokens. Scratch is depth-major with a slot per branch,
    drafting or not (depth d, branch b at slot ``d * m + b`` of the scratch region)."""
    mirror = state.mirror
    table, size = mirror.block_table, block_size
    n = mirror.num_tokens  # committed tokens; t_n sits at position n - 1
    m = len(branches)
    glue_end = n + num_glued  # natural slots 0 .. n+L-1 hold t_1..t_n, e_1..e_L (L = num_glued drafts)
    active = [b for b, branch in enumerate(branches) if branch.drafting]
    rows = np.array(active)
    ks = np.array([branches[b].k for b in active])
    positions = n + ks + j
    scratch = block_slots(table, size, glue_end, glue_end + (j + 1) * m)
    own = (np.arange(j + 1)[:, None] * m + rows[None, :]).reshape(-1)  # the active branches' scratch so far
    read = np.concatenate([block_slots(table, size, 0, glue_end), scratch[own]])
    mask = np.zeros((len(rows), glue_end + len(own)), dtype=bool)
    mask[:, :glue_end] = np.arange(glue_end)[None, :] <= (n - 1 + ks)[:, None]
    mask[:, glue_end:] = (own[None, :] % m) == rows[:, None]
    tokens = [branches[b].next_input for b in active]
    return ForwardItem(tokens, 0, table, len(rows), positions, scratch[j * m + rows], read, mask)
