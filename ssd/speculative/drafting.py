"""Draft-side building blocks shared by ordinary SD and SSD: the draft's processed distribution and
K sequential draft steps over mirrored sequences."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ssd.core.sequence import Sequence
from ssd.runtime.forward_items import ForwardItem
from ssd.runtime.model_runner import ModelRunner
from ssd.sample.penalties import PenaltyRow, apply_penalties
from ssd.sample.sampler import SamplingTensors, draw_uniforms, processed_probs, sample
from ssd.sampling_params import SamplingParams
from ssd.speculative.lookup import PromptLookup, copied_token
from ssd.structured.bitmask import any_allowed, apply_bitmasks, pack, unpack
from ssd.structured.grammar import Grammar

Allowed = tuple[list[int], torch.Tensor]  # rows a grammar constrains, and their [n, W] bitmasks


class DraftDistribution:
    """Turns draft logits into the distribution drafts are drawn from, over the *target's* vocabulary.

    Ids at or past ``num_usable_tokens`` (padding rows of either embedding) get zero mass, and rows are
    padded to the target vocabulary so verification can compare q with p directly.
    """

    def __init__(
        self, target_vocab_size: int, num_usable_tokens: int, draft_to_target: torch.Tensor | None = None
    ) -> None:
        self.target_vocab_size = target_vocab_size
        self.num_usable_tokens = num_usable_tokens
        self._scatter = None  # reduced draft vocabulary: (draft ids with a target id, their target ids)
        # the usable target ids in ascending order, and the draft's columns holding them (a slice where they are
        # its first columns in order, as in a reduced vocabulary built from target ids in ascending order: a
        # view, no copy); None: column index == target id
        self._target_ids: torch.Tensor | None = None
        self._columns: slice | torch.Tensor | None = None
        self._proposable: torch.Tensor | None = None  # [W] bitmask of the target ids the draft can propose
        if draft_to_target is not None:
            known = draft_to_target >= 0
            self._scatter = (torch.nonzero(known).squeeze(1), draft_to_target[known])
            draft_ids, target_ids = self._scatter
            usable = target_ids < num_usable_tokens
            order = torch.argsort(target_ids[usable])
            columns, self._target_ids = draft_ids[usable][order], target_ids[usable][order]
            in_order = torch.equal(columns, torch.arange(len(columns), device=columns.device))
            self._columns = slice(0, len(columns)) if in_order else columns

    def masked_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits ``[N, Vd]`` -> ``[N, V]`` over target ids, -inf where the draft cannot propose."""
        if self._scatter is not None:
            draft_ids, target_ids = self._scatter
            out = logits.new_full((logits.shape[0], self.target_vocab_size), float("-inf"))  # [N, V]
            out[:, target_ids] = logits[:, draft_ids]
            out[:, self.num_usable_tokens :] = float("-inf")
            return out
        logits = logits[:, : self.num_usable_tokens]  # [N, U]
        missing = self.target_vocab_size - logits.shape[-1]
        if missing > 0:
            pad = logits.new_full((logits.shape[0], missing), float("-inf"))
            logits = torch.cat([logits, pad], dim=-1)  # [N, V]
        return logits

    @classmethod
    def for_runner(cls, runner: ModelRunner, target_vocab_size: int, num_usable_tokens: int) -> "DraftDistribution":
        vocab = runner.draft_vocab
        if vocab is None:
            return cls(target_vocab_size, num_usable_tokens)
        if vocab.target_vocab_size != target_vocab_size:
            raise ValueError(
                f"the draft's draft_vocab.json is for a target vocabulary of {vocab.target_vocab_size} tokens, "
                f"but the target has {target_vocab_size}"
            )
        return cls(target_vocab_size, num_usable_tokens, torch.from_numpy(vocab.draft_to_target).to(runner.device))

    def greedy_tokens(self, logits: torch.Tensor) -> torch.Tensor:
        """``argmax(masked_logits(logits))`` as target ids ``[N]`` (lowest target id on ties), computed on the
        draft's own columns: no ``[N, V]`` row over the target vocabulary is built."""
        if self._target_ids is None:  # column index == target id
            return logits[:, : self.num_usable_tokens].argmax(dim=-1)  # [N]
        return self._target_ids[logits[:, self._columns].argmax(dim=-1)]  # [N]

    def top_tokens(self, logits: torch.Tensor, n: int) -> torch.Tensor:
        """The ``n`` (at most the number of proposable ids) likeliest proposable target ids per row, most
        likely first: ``[N, n]``, on the draft's own columns like :meth:`greedy_tokens`."""
        if self._target_ids is None:
            usable = logits[:, : self.num_usable_tokens]  # [N, U]
            return torch.topk(usable, min(n, usable.shape[-1]), dim=-1).indices  # [N, n]
        target_ids = self._target_ids
        return target_ids[torch.topk(logits[:, self._columns], min(n, len(target_ids)), dim=-1).indices]  # [N, n]

    def token_probs(self, logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """The draft's plain (temperature 1) probabilities of target ids ``tokens [N, m]`` under draft
        ``logits [N, Vd]``: ``[N, m]``, 0 for ids the draft cannot propose. Computed on the draft's own
        columns like :meth:`greedy_tokens`."""
        tokens = tokens.long()
        if self._target_ids is None:
            usable = logits[:, : self.num_usable_tokens].float()  # [N, U]
            columns, known = tokens.clamp(0, usable.shape[-1] - 1), tokens < usable.shape[-1]
        else:
            target_ids = self._target_ids
            usable = logits[:, self._columns].float()  # [N, U], columns in ascending target-id order
            columns = torch.searchsorted(target_ids, tokens).clamp(max=len(target_ids) - 1)  # [N, m]
            known = target_ids[columns] == tokens
        log_probs = usable.gather(1, columns) - torch.logsumexp(usable, dim=-1, keepdim=True)  # [N, m]
        return torch.where(known & (tokens >= 0), log_probs.exp(), torch.zeros_like(log_probs))

    def draw(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        default_generator: torch.Generator | None,
        adjust: Adjust | None = None,
        forced: list[int | None] | None = None,
        penalties: list[PenaltyRow] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One draft token per row of draft ``logits [N, Vd]``: ``(tokens [N], probs [N, V] or None)``.

        ``probs`` are exactly the distributions sampled from (after ``adjust``). When every row is greedy
        they are one-hot and not built (None): the cheap path that most draft steps of a greedy batch take.
        A row with a ``forced`` token (prompt lookup) proposes it with a one-hot q instead; the choice must not
        depend on this draw. ``penalties`` (rows of ``logits``) penalise the draft as the target is penalised, so
        a penalised request's drafts follow its target more often. Generators advance as in
        :func:`ssd.sample.sampler.sample` in every case.
        """
        st = SamplingTensors.from_params(params, logits.device)
        full = None  # [N, V] over target ids, built only where penalties need it
        if penalties:
            full = self.masked_logits(logits).clone()
            apply_penalties(full, penalties)
        if st.all_greedy:
            draw_uniforms(generators, [1] * len(params), 1, logits.device, default_generator)
            greedy = self.greedy_tokens(logits) if full is None else full.argmax(dim=-1)  # lowest id on ties alike
            return _force(greedy, None, forced), None
        probs = processed_probs(self.masked_logits(logits) if full is None else full, st)  # [N, V]
        if adjust is not None:
            probs = adjust(logits, probs)
        tokens = sample(probs, generators, st.greedy, default_generator)  # [N]
        return _force(tokens, probs, forced), probs

    def constrain(self, logits: torch.Tensor, allowed: Allowed | None) -> torch.Tensor:
        """Draft ``logits [N, Vd]`` with each grammar row's disallowed tokens at -inf (structured outputs), so every
        other method (draws, top tokens, probabilities) keeps to the grammar. A copy; ``logits`` itself where
        nothing is constrained. A row whose grammar allows nothing the draft can propose keeps its logits: its
        draft is rejected then, and q stays a distribution."""
        if allowed is None:
            return logits
        rows, masks = allowed
        masks = masks.to(logits.device)
        keep = any_allowed(masks, self._proposable_bits(masks.shape[1], logits.device))  # [n]
        rows = [r for r, k in zip(rows, keep.tolist()) if k]
        masks = masks[keep]
        out = logits.clone()
        if not rows:
            return out
        if self._scatter is None:  # column index == target id
            width = min(logits.shape[-1], self.target_vocab_size)
            apply_bitmasks(out[:, :width], rows, masks)
            return out
        draft_ids, target_ids = self._scatter
        columns = torch.zeros(len(rows), logits.shape[-1], dtype=torch.bool, device=logits.device)  # [n, Vd]
        columns[:, draft_ids] = unpack(masks, self.target_vocab_size)[:, target_ids]
        index = torch.tensor(rows, dtype=torch.long, device=logits.device)
        out[index] = out[index].masked_fill(~columns, float("-inf"))
        return out

    def _proposable_bits(self, width: int, device: torch.device) -> torch.Tensor:
        """``[W]`` bitmask of the target ids the draft can propose (made once)."""
        if self._proposable is None:
            proposable = torch.zeros(self.target_vocab_size, dtype=torch.bool)
            if self._scatter is None:
                proposable[: self.num_usable_tokens] = True
            else:
                ids = self._scatter[1].cpu()
                proposable[ids[ids < self.num_usable_tokens]] = True
            self._proposable = pack(proposable)
        return self._proposable[:width].to(device)


def draft_penalties(seqs: list[Sequence], rows: list[int], drafted: list[list[int]]) -> list[PenaltyRow]:
    """The penalties of a draft step over ``rows`` (position p of the step's logits is ``rows[p]``): each penalised
    sequence's options, prompt, and output with its drafts so far counted as generated, as the target counts them."""
    return [PenaltyRow(p, seqs[i].sampling_params, seqs[i].prompt_token_ids, seqs[i].output_token_ids + drafted[i])
            for p, i in enumerate(rows) if seqs[i].sampling_params.has_penalties]


def grammar_masks(grammars: list[Grammar | None] | None, rows: list[int], drafted: list[list[int]]) -> Allowed | None:
    """For a draft step over ``rows``: the positions (in ``rows``) a grammar constrains and their masks after the
    drafts so far; None when no row has a grammar."""
    if grammars is None:
        return None
    positions = [p for p, i in enumerate(rows) if grammars[i] is not None]
    if not positions:
        return None
    return positions, torch.stack([grammars[rows[p]].mask_after(drafted[rows[p]]) for p in positions])


def _force(tokens: torch.Tensor, probs: torch.Tensor | None, forced: list[int | None] | None) -> torch.Tensor:
    """Put each forced token into ``tokens [N]`` and make its row of ``probs [N, V]`` one-hot (in place)."""
    rows = [i for i, token in enumerate(forced or ()) if token is not None]
    if not rows:
        return tokens
    index = torch.tensor(rows, device=tokens.device)
    values = torch.tensor([forced[i] for i in rows], device=tokens.device, dtype=tokens.dtype)
    tokens = tokens.clone()
    tokens[index] = values
    if probs is not None:
        probs[index] = 0.0
        probs[index, values] = 1.0
    return tokens


@dataclass
class Drafts:
    """K sequential drafts per row: tokens, the exact q each was drawn from, and which prompt lookup copied."""

    tokens: torch.Tensor  # [B, K] int64
    probs: torch.Tensor  # [B, K, V] float32
    copied: torch.Tensor  # [B, K] bool
    computed: list[int]  # per row: the draft cache holds K/V for the first computed[i] tokens (own, then drafts)


ProbsHook = Callable[[int, list[int], torch.Tensor, torch.Tensor], torch.Tensor]
Adjust = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (logits, probs) -> the probs to draw from


def draft_sequentially(
    runner: ModelRunner,
    mirrors: list[Sequence],
    num_drafts: list[int],
    generators: list[torch.Generator | None],
    distribution: DraftDistribution,
    default_generator: torch.Generator | None,
    adjust: ProbsHook | None = None,
    lookups: list[PromptLookup | None] | None = None,
    grammars: list[Grammar | None] | None = None,
) -> Drafts:
    """Catch each mirror up to its pending token, then draft ``num_drafts[i]`` tokens one step at a time.

    ``lookups[i]`` (prompt lookup over mirror i's tokens) replaces a draft by the token it copies, when it has
    one. A copy is known before its step, so that row skips the step's forward: the copied token (q one-hot at
    it) waits, with the tokens before it, for the row's next forward, and a row whose drafts are all copies runs
    no forward at all. Mirrors must have slots for all their uncomputed tokens plus ``num_drafts - 1`` lookahead
    tokens. On return the draft cache holds K/V for each mirror's first ``Drafts.computed[i]`` tokens (its own,
    then d_1..d_{K-1} at most) and ``num_computed_tokens`` counts those of the mirror's own tokens.
    ``adjust(step, rows, logits, probs)`` may reshape the distribution a draft is drawn from (Saguaro scaling);
    ``grammars[i]`` (structured outputs) restricts row i's drafts to what its grammar allows after the drafts
    before them, and a mirror's penalties (its sampling options) apply as the target applies them. The returned
    probabilities are exactly the ones sampled from.
    """
    device = runner.device
    max_drafts = max(num_drafts)
    tokens_out = torch.zeros(len(mirrors), max_drafts, dtype=torch.long, device=device)  # [B, K]
    probs_out = torch.zeros(len(mirrors), max_drafts, distribution.target_vocab_size, device=device)  # [B, K, V]
    copied = torch.zeros(len(mirrors), max_drafts, dtype=torch.bool)  # [B, K]
    pending = [m.token_ids[m.num_computed_tokens :] for m in mirrors]  # tokens the next forward must run
    drafted: list[list[int]] = [[] for _ in mirrors]
    positions = [m.num_computed_tokens for m in mirrors]  # K/V held so far
    for step in range(max_drafts):
        active = [i for i, k in enumerate(num_drafts) if k > step]
        copies = {i: copied_token(lookups[i], drafted[i]) for i in active} if lookups is not None else {}
        run = [i for i in active if copies.get(i) is None]
        new = {i: token for i, token in copies.items() if token is not None}
        if new:
            rows = list(new)
            index = torch.tensor(rows, device=device)
            values = torch.tensor([new[i] for i in rows], device=device)
            tokens_out[index, step] = values
            probs_out[index, step, values] = 1.0  # q one-hot at the copy
            copied[rows, step] = True
        if run:
            logits = runner.forward([ForwardItem(pending[i], positions[i], mirrors[i].block_table, 1) for i in run])
            logits = distribution.constrain(logits, grammar_masks(grammars, run, drafted))
            hook = None if adjust is None else lambda lg, pr: adjust(step, run, lg, pr)
            tokens, probs = distribution.draw(
                logits, [mirrors[i].sampling_params for i in run], [generators[i] for i in run], default_generator,
                hook, penalties=draft_penalties(mirrors, run, drafted),
            )
            rows_t = torch.tensor(run, device=device)
            tokens_out[rows_t, step] = tokens  # tokens: [R]
            if probs is None:
                probs_out[rows_t, step, tokens] = 1.0  # all greedy: q is one-hot at the draft
            else:
                probs_out[rows_t, step] = probs  # [R, V]
            for i, token in zip(run, tokens.tolist()):
                positions[i] += len(pending[i])
                pending[i] = []
                new[i] = token
        for i in active:
            pending[i].append(new[i])
            drafted[i].append(new[i])
    for mirror, held in zip(mirrors, positions):
        mirror.num_computed_tokens = min(held, mirror.num_tokens)
    return Drafts(tokens_out, probs_out, copied, positions)
