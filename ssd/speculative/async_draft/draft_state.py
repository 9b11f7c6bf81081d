"""The SSD draft engine's per-sequence state, its step inputs and outputs, and the per-sequence helpers (draft seeds,
grammar masks of tree rows) of ``draft_engine.py``."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ssd.core.sequence import Sequence
from ssd.options import Fallback
from ssd.speculative.drafting import Allowed
from ssd.speculative.lookup import PromptLookup, copied_token
from ssd.structured.grammar import Grammar


@dataclass
class CachedSpeculation:
    tokens: list[int]  # e_1..e_K
    probs: torch.Tensor | None  # [K, V] the exact q each e_j was drawn from (None for greedy sequences)
    copied: list[bool]  # which e_j prompt lookup copied


@dataclass
class DraftSeqState:
    mirror: Sequence  # committed tokens; num_computed_tokens = tokens whose draft K/V is valid
    generator: torch.Generator
    speculation: list[int] = field(default_factory=list)  # last returned [t_n, e_1..e_n] (n <= K_i)
    tree_depth: int = 0  # tokens each tree branch drafts for the next round (the last request's)
    num_valid_drafts: int = 0  # leading e_j whose K/V sits in natural slots (glue: all K, jit: K-1)
    copied: list[bool] = field(default_factory=list)  # which of e_1..e_n prompt lookup copied
    # the draft's probability of each of e_1..e_n where a dynamic fork computed them (else empty): checked
    # against the verified outcome to calibrate the next forks (``calibration.py``)
    confidences: list[float] = field(default_factory=list)
    fan_out: list[int] = field(default_factory=list)  # F_0..F_K of the next cache build (Saguaro scales these)
    cache: dict[tuple[int, int], CachedSpeculation] = field(default_factory=dict)
    lookup: PromptLookup | None = None  # prompt lookup over the mirror's tokens
    grammar: Grammar | None = None  # structured outputs: the state after the committed output tokens

    def copy(self, tail: list[int]) -> int | None:
        """What prompt lookup proposes after the committed tokens and ``tail``, if anything."""
        return copied_token(self.lookup, tail)

    @property
    def greedy(self) -> bool:
        return self.mirror.sampling_params.is_greedy

    def allowed_after(self, drafts: list[int]) -> torch.Tensor | None:
        """``[W]``: the tokens the grammar allows after the committed tokens and ``drafts``; None: unconstrained."""
        return None if self.grammar is None else self.grammar.mask_after(drafts)

    def glue_masks(self) -> Allowed | None:
        """What the grammar allows after each of t_n, e_1..e_L (the glue's logits rows); None: unconstrained."""
        if self.grammar is None:
            return None
        return list(range(len(self.speculation))), self.grammar.masks_along(self.speculation[1:])


@dataclass
class SpeculateRow:
    seq_id: int
    new_tokens: list[int]  # committed tokens the draft has not seen (ends with the pending token)
    num_accepted: int  # k of the round just verified; -1 when there was none (a first round with no cache built
    # after the prefill, or after a reset); 0 for a first round after a first-round build (its prompt's step)
    num_drafts: int  # K_i of this round
    tree_depth: int | None = None  # drafts per branch of the next cache (>= num_drafts); None: num_drafts
    # an EAGLE-3 head's input: (p, the target's features [m, 3 Ht] of positions p..p+m-1) it has not been sent yet
    target_features: tuple[int, torch.Tensor] | None = None

    def __post_init__(self) -> None:
        if self.tree_depth is None:
            self.tree_depth = self.num_drafts


@dataclass
class SpeculationResult:
    tokens: list[int]
    probs: torch.Tensor | None  # [K, V]; None for greedy sequences (q is one-hot at the token)
    hit: bool
    fallback: Fallback | None  # None on a hit
    copied: list[bool]  # which tokens prompt lookup copied


@dataclass
class BuildStats:
    seconds: float = 0.0
    num_branches: int = 0
    depth: int = 0  # tree steps run: tokens per branch (the longest lookahead unless cut short)
    cut_short: bool = False  # stopped before its full depth: the next request was waiting or due
    fan_outs: dict[int, list[int]] = field(default_factory=dict)  # seq_id -> F_0..F_K built (dynamic: as forked)


@dataclass
class Branch:
    """One branch of a sequence's tree in a cache build: the verification outcome it prepares for (``k`` drafts
    accepted, then ``token``) and what it has drafted after it so far."""

    k: int
    token: int
    weight: float | None = None  # the outcome's probability (a dynamic fan-out); None in a fixed one
    path: float = 1.0  # P(its drafts so far are all accepted): dynamic fan-outs only
    drafting: bool = True  # still drafts at the next depth
    tokens: list[int] = field(default_factory=list)  # its drafts, in order
    copied: list[bool] = field(default_factory=list)  # which of them prompt lookup copied
    probs: list[torch.Tensor] = field(default_factory=list)  # the q [V] of each (sampled requests only)
    feature: torch.Tensor | None = None  # an EAGLE-3 head's output of the branch's last row [H] (its next feature)

    @property
    def next_input(self) -> int:
        """The token it runs at its next depth: its last draft, or at first its outcome's token."""
        return self.tokens[-1] if self.tokens else self.token


def drafts_before(state: DraftSeqState, k: int, token: int) -> list[int]:
    """The tokens of branch (k, token) after the committed ones: e_1..e_k, then the token."""
    return state.speculation[1 : k + 1] + [token]


def branch_masks(rows: list[tuple[DraftSeqState, Branch]]) -> Allowed | None:
    """The grammar masks of the tree rows whose sequence has one: what may follow each branch's tokens."""
    masks = [(r, state.allowed_after(drafts_before(state, branch.k, branch.token) + branch.tokens))
             for r, (state, branch) in enumerate(rows) if state.grammar is not None]
    if not masks:
        return None
    return [r for r, _ in masks], torch.stack([m for _, m in masks])


def draft_seed(request_seed: int | None, engine_seed: int, seq_id: int) -> int:
    """The seed of a sequence's draft generator, chosen so it never replays the target's random stream.

    The target seeds a request's generator with the request's seed (unseeded requests share one seeded with
    the engine seed). Reusing that seed here would make the draft's j-th draw equal the target's j-th
    uniform, e.g. the acceptance test of the previous draft, which correlates drafts with their own
    verification and biases the output distribution. An odd-multiplier affine map of 2**64 (a bijection)
    keeps distinct sequences on distinct seeds.
    """
    base = request_seed if request_seed is not None else engine_seed * 1_000_003 + seq_id
    return (base * 6364136223846793005 + 1442695040888963407) % 2**64
