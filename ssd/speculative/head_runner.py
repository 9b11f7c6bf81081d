"""An EAGLE-3 head run like a draft model: its paged KV cache, steps over :class:`ForwardItem` lists with a feature
per row, and the sequential drafting both proposers that run a head share (SD's ``Eagle3Proposer`` in the target's
process, SSD's ``HeadDraftEngine`` in the draft worker).

A row at position p takes the token at p + 1 and a feature of position p (``ssd/models/eagle3.py``): the target's
hidden states through the head's ``fc`` where the target computed p, else the head's own output of the row at
p - 1. Items here are in row positions: an item starting at p runs rows p, p + 1, ... with the tokens given.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ssd.core.sequence import Sequence
from ssd.dtypes import torch_dtype
from ssd.models.arch import ModelArchConfig
from ssd.models.attention_layout import build_step_tensors
from ssd.models.eagle3 import Eagle3Config, Eagle3Head, load_eagle3_head
from ssd.models.weight_formats import pack_weights
from ssd.options import PACKED_WEIGHT_FORMATS, WeightFormat
from ssd.runtime.forward_items import ForwardItem, flatten_items
from ssd.sampling_params import SamplingParams
from ssd.speculative.drafting import DraftDistribution, ProbsHook, draft_penalties, grammar_masks
from ssd.speculative.lookup import PromptLookup, copied_token
from ssd.structured.grammar import Grammar

if TYPE_CHECKING:
    from ssd.config import SpeculativeConfig


def check_head_options(spec: SpeculativeConfig) -> None:
    """Refuse options that do not apply to a head."""
    if spec.draft_weight_format == WeightFormat.GGUF:
        raise ValueError("an EAGLE-3 head has no GGUF blocks; draft_weight_format 'gguf' does not apply")


def head_feature_layers(spec: SpeculativeConfig, target: ModelArchConfig) -> tuple[int, ...]:
    """The target layers the head in ``spec.model`` reads, from its config alone (refuses a head that does not fit
    the target, or options that do not apply to heads, before any weights are read)."""
    check_head_options(spec)
    path = Path(spec.model) / "config.json"
    try:
        return Eagle3Config.from_hf_config(json.loads(path.read_text(encoding="utf-8"))).target_layers(target)
    except (OSError, json.JSONDecodeError, ValueError) as exc:
        raise ValueError(f"{path}: {exc}") from exc


def load_head(
    spec: SpeculativeConfig, target: ModelArchConfig, target_embedding: torch.Tensor | None, device: torch.device | str
) -> tuple[Eagle3Head, tuple[int, ...]]:
    """The head in ``spec.model`` for ``target`` (in ``draft_dtype`` on ``device``, packed in ``draft_weight_format``
    like a draft model: fewer bytes a draft step reads) and the target layers it reads."""
    check_head_options(spec)
    head, layers = load_eagle3_head(spec.model, target, torch_dtype(spec.draft_dtype), target_embedding)
    head.to(device)
    if spec.draft_weight_format in PACKED_WEIGHT_FORMATS:
        pack_weights(head, spec.draft_weight_format)
    return head, layers


class HeadRunner:
    """The head, its one-layer KV cache (``num_blocks`` blocks of ``block_size`` rows) and its device."""

    def __init__(self, head: Eagle3Head, num_blocks: int, block_size: int, device: torch.device | str) -> None:
        self.head = head
        self.block_size = block_size
        self.device = torch.device(device)
        self.num_blocks = num_blocks
        self.caches = head.allocate_kv_caches(num_blocks, block_size, self.device)

    @property
    def target_feature_size(self) -> int:
        """Width of the target features the head fuses: three target hidden states, 3 Ht."""
        return self.head.fc.in_features

    def fuse(self, target_features: torch.Tensor) -> torch.Tensor:
        """The target's features ``[T, 3 Ht]`` (any float dtype) as row features ``[T, H]``."""
        return self.head.fuse(target_features.to(device=self.device, dtype=self.head.fc.weight.dtype))

    def forward(self, items: list[ForwardItem], features: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """The head over ``items`` with a feature per row (``[T, H]``, in flat order): its outputs ``[T, H]`` (each
        row's next-row feature) and the flat rows of the items' logit rows (``num_logits`` trailing rows each)."""
        flat = flatten_items(items, self.block_size)
        step = build_step_tensors(flat.token_ids, flat.positions, flat.layouts, flat.logit_rows, self.device)
        return self.head(step.input_ids, features, step.positions, step.meta, self.caches), flat.logit_rows

    def logits(self, outputs: torch.Tensor) -> torch.Tensor:
        """Float32 logits over the draft vocabulary ``[N, Vd]`` of output rows ``[N, H]``."""
        return self.head.compute_logits(outputs)


@dataclass
class HeadDrafts:
    """Drafts of :func:`draft_with_head`: tokens, the exact q each was drawn from, and which prompt lookup copied."""

    tokens: torch.Tensor  # [B, W] int64
    probs: torch.Tensor  # [B, W, V] float32
    copied: torch.Tensor  # [B, W] bool


def draft_with_head(
    runner: HeadRunner,
    catch_up: list[ForwardItem],
    features: torch.Tensor,
    num_drafts: list[int],
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    distribution: DraftDistribution,
    default_generator: torch.Generator | None,
    lookups: list[PromptLookup | None],
    adjust: ProbsHook | None = None,
    grammars: list[Grammar | None] | None = None,
    seqs: list[Sequence] | None = None,
) -> HeadDrafts:
    """Run each row's ``catch_up`` item (rows through its pending token, one logit row) on ``features [T, H]``, then
    draft ``num_drafts[i]`` tokens a row at a time, each row reading the previous row's output as its feature.

    A position where prompt lookup copies a token takes it with a one-hot q instead of the head's draw; the head
    still runs that row (its output is the next row's feature). ``adjust(step, rows, logits, probs)`` may reshape a
    distribution before the draw (Saguaro), ``grammars[i]`` restricts row i's drafts to its grammar's allowed
    tokens, and ``seqs[i]`` (the sequence, with its prompt and output) penalises them as its target is penalised;
    the returned q are exactly the distributions drawn from. The rows after
    the pending ones are written at the catch-up items' next positions of their block tables, which must have
    slots for ``num_drafts[i] - 1`` of them.
    """
    device = runner.device
    width = max(num_drafts)
    tokens_out = torch.zeros(len(catch_up), width, dtype=torch.long, device=device)  # [B, W]
    probs_out = torch.zeros(len(catch_up), width, distribution.target_vocab_size, device=device)  # [B, W, V]
    copied = torch.zeros(len(catch_up), width, dtype=torch.bool)  # [B, W]
    out, last = runner.forward(catch_up, features)
    current = out[last]  # [B, H]: each row's newest output
    ends = [item.start_pos + len(item.token_ids) for item in catch_up]  # the next row's position
    drafted: list[list[int]] = [[] for _ in catch_up]
    active = list(range(len(catch_up)))
    for step in range(width):
        active = [i for i in active if num_drafts[i] > step]
        if step > 0:
            items = [ForwardItem([drafted[i][-1]], ends[i] + step - 1, catch_up[i].block_table) for i in active]
            out, _ = runner.forward(items, current[active])
            current[active] = out
        forced = [copied_token(lookups[i], drafted[i]) for i in active]
        hook = None if adjust is None else (lambda lg, pr, rows=active, s=step: adjust(s, rows, lg, pr))
        logits = distribution.constrain(runner.logits(current[active]), grammar_masks(grammars, active, drafted))
        penalties = None if seqs is None else draft_penalties(seqs, active, drafted)
        tokens, probs = distribution.draw(
            logits, [params[i] for i in active], [generators[i] for i in active], default_generator, hook, forced,
            penalties,
        )
        rows = torch.tensor(active, device=device)
        tokens_out[rows, step] = tokens
        if probs is None:
            probs_out[rows, step, tokens] = 1.0  # all greedy: q is one-hot at the draft
        else:
            probs_out[rows, step] = probs
        for i, token, copy in zip(active, tokens.tolist(), forced):
            drafted[i].append(token)
            copied[i, step] = copy is not None
    return HeadDrafts(tokens_out, probs_out, copied)
