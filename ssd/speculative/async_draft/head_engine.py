"""SSD's draft computation with an EAGLE-3 head instead of a draft model (``draft_engine.py`` says what a build is).

A head's row at position p takes the token at p + 1 and a feature of position p (``ssd/models/eagle3.py``), so the
head's mirror of a sequence holds the tokens its rows take: t_2..t_n. Row p of the head then sits where token p
of the mirror does, and the draft engine's layouts (the glue in natural slots, branches in scratch slots, RoPE
positions, tree masks) apply unchanged. What differs is the feature each row reads:

- the target's, fused by the head's ``fc``, for the rows of tokens the target has verified: each SPECULATE brings
  the features of the positions the target computed since the last one (``SpeculateRow.target_features``);
  positions it never computed (its prefix cache served them) read zeros, which costs acceptance, never exactness;
- the head's own output of the row before, everywhere else: the glue's rows for the drafts just served (the
  target is verifying them while the head builds), every tree row, and the fallback's drafts.

So the glue is one catch-up forward over the committed tokens not yet run (target features), then a row per draft
served, one at a time. Rows run on the head's own features are never kept: the mirror's computed count stops at
the pending token, and the next round runs the accepted drafts again on the target's features. The fork at k
reads the glue's logits after e_k, and each branch's first row reads that glue row's output; a branch's later
rows read its own previous output. There is no first-round build (the head needs the prompt's features, which
exist only once the target has computed it) and no prefix caching (a row's K/V depends on its feature).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from ssd.core.kv_cache_manager import KVCacheManager
from ssd.options import Fallback
from ssd.runtime.forward_items import ForwardItem
from ssd.sampling_params import SamplingParams
from ssd.speculative.async_draft.draft_engine import DraftEngine
from ssd.speculative.async_draft.draft_state import (
    Branch,
    BuildStats,
    CachedSpeculation,
    DraftSeqState,
    SpeculateRow,
    SpeculationResult,
)
from ssd.speculative.async_draft.planning.fanout import FanOutPlan
from ssd.speculative.head_runner import HeadRunner, draft_with_head
from ssd.speculative.target_features import TargetFeatureLog


class HeadDraftEngine(DraftEngine):
    runner: HeadRunner

    def __init__(self, runner: HeadRunner, kv_manager: KVCacheManager, *args: Any, **kwargs: Any) -> None:
        """As :class:`DraftEngine`'s, with a head's runner and a KV cache without prefix caching."""
        if kv_manager.pool.enable_prefix_caching:
            raise ValueError("an EAGLE-3 head's KV cache cannot be prefix-cached: a row's K/V depends on its feature")
        super().__init__(runner, kv_manager, *args, **kwargs)  # type: ignore[arg-type]
        self.features = TargetFeatureLog()  # fused [m, H], of rows the head has not run yet
        self.glue_outputs: dict[int, torch.Tensor] = {}  # seq_id -> the glue's outputs [L+1, H] during a build
        self.rows_without_features = 0  # rows run on zeros: positions the target's prefix cache served

    # ------------------------------------------------------------------ sequences and features
    def prefill(self, seqs: list[tuple[int, list[int], SamplingParams]]) -> None:
        """Start mirroring: nothing to compute until the target's features of the prompt arrive."""
        for seq_id, token_ids, params in seqs:
            self._new_state(seq_id, list(token_ids[1:]), params)

    def release(self, seq_id: int) -> None:
        super().release(seq_id)
        self.features.release(seq_id)
        self.glue_outputs.pop(seq_id, None)

    def _commit(self, state: DraftSeqState, row: SpeculateRow) -> CachedSpeculation | None:
        if row.target_features is not None:
            first, rows = row.target_features
            self.features.observe([(row.seq_id, first, len(rows))], self.runner.fuse(rows))
        return super()._commit(state, row)

    def _row_features(self, seq_id: int, first: int, end: int) -> torch.Tensor:
        """The fused target features of rows ``first..end-1`` ``[end - first, H]``, zeros where there are none;
        then forgotten (the rows are about to be computed and kept), but for the pending token's: a build right
        after a fallback runs that row again."""
        head = self.runner.head
        out = torch.zeros(end - first, head.config.arch.hidden_size, device=self.runner.device,
                          dtype=head.fc.weight.dtype)
        self.rows_without_features += (end - first) - self.features.gather(seq_id, first, end, out)
        self.features.forget(seq_id, end - 1)
        return out

    def _catch_up(self, state: DraftSeqState) -> tuple[ForwardItem, torch.Tensor]:
        """The rows from the first not kept through the pending token's, and their target features."""
        mirror = state.mirror
        start = min(mirror.num_computed_tokens, mirror.num_tokens - 1)
        item = ForwardItem(mirror.token_ids[start:], start, mirror.block_table)
        return item, self._row_features(mirror.seq_id, start, mirror.num_tokens)

    def _keep_committed(self, state: DraftSeqState) -> None:
        """After a round of rows on the head's own features: only the committed tokens' rows stay valid."""
        state.mirror.num_computed_tokens = state.mirror.num_tokens
        state.num_valid_drafts = 0

    # ------------------------------------------------------------------ fallback
    def _jit(self, rows: list[SpeculateRow]) -> list[SpeculationResult]:
        out: list[SpeculationResult | None] = [None] * len(rows)
        todo = [i for i, row in enumerate(rows) if row.num_drafts > 0]
        for i, row in enumerate(rows):
            if row.num_drafts == 0:
                out[i] = SpeculationResult([], None, False, Fallback.JIT, [])
        if todo:
            states = [self.states[rows[i].seq_id] for i in todo]
            self._jit_states = states
            items, features = [], []
            for i, state in zip(todo, states):
                self._allocate(state.mirror, state.mirror.num_uncomputed_tokens + rows[i].num_drafts - 1)
                item, rows_features = self._catch_up(state)
                items.append(item)
                features.append(rows_features)
            drafts = draft_with_head(
                self.runner, items, torch.cat(features), [rows[i].num_drafts for i in todo],
                [s.mirror.sampling_params for s in states], [s.generator for s in states], self.dist, None,
                [s.lookup for s in states], adjust=self._saguaro_jit, grammars=[s.grammar for s in states],
            )
            for r, (i, state) in enumerate(zip(todo, states)):
                self._keep_committed(state)
                n = rows[i].num_drafts
                probs = None if state.greedy else drafts.probs[r, :n]
                out[i] = SpeculationResult(drafts.tokens[r, :n].tolist(), probs, False, Fallback.JIT,
                                           drafts.copied[r, :n].tolist())
        return out  # type: ignore[return-value]

    # ------------------------------------------------------------------ cache building
    def build_cache(self, fan_outs: Mapping[int, FanOutPlan],
                    should_stop: Callable[[], bool] | None = None) -> BuildStats:
        try:
            return super().build_cache(fan_outs, should_stop)
        finally:
            self.glue_outputs.clear()

    def _glue(self, states: list[DraftSeqState], max_branches: list[int]) -> list[torch.Tensor]:
        """Catch up on the target's features, then run each draft just served on the row before's output: the
        logits after t_n, e_1..e_L ``[L+1, Vd]`` per sequence (their outputs kept for the branches)."""
        items, features = [], []
        for state, m in zip(states, max_branches):
            mirror = state.mirror
            drafts = len(state.speculation) - 1
            self._allocate(mirror, mirror.num_uncomputed_tokens + drafts + state.tree_depth * m)
            item, rows_features = self._catch_up(state)
            items.append(item)
            features.append(rows_features)
        out, last = self.runner.forward(items, torch.cat(features))
        current = out[last]  # [B, H]: the pending rows' outputs
        outputs = [[row] for row in current.clone()]
        drafts = [state.speculation[1:] for state in states]
        for j in range(1, max(map(len, drafts)) + 1):
            active = [i for i, d in enumerate(drafts) if len(d) >= j]
            step = [ForwardItem([drafts[i][j - 1]], states[i].mirror.num_tokens - 1 + j, states[i].mirror.block_table)
                    for i in active]
            out, _ = self.runner.forward(step, current[active])
            current[active] = out
            for i, row in zip(active, out):
                outputs[i].append(row)
        glued = [torch.stack(rows) for rows in outputs]  # per sequence [L+1, H]
        logits = self.runner.logits(torch.cat(glued)).split([len(g) for g in glued])
        for state, rows in zip(states, glued):
            self.glue_outputs[state.mirror.seq_id] = rows
            self._keep_committed(state)
        return list(logits)

    def _tree_forward(self, items: list[ForwardItem], rows: list[tuple[DraftSeqState, Branch]]) -> torch.Tensor:
        """A branch's first row reads the output of the glue row its fork read (after e_k), later rows its own."""
        features = torch.stack([
            branch.feature if branch.feature is not None else self.glue_outputs[state.mirror.seq_id][branch.k]
            for state, branch in rows
        ])
        out, _ = self.runner.forward(items, features)
        for (_, branch), row in zip(rows, out):
            branch.feature = row
        return self.runner.logits(out)
