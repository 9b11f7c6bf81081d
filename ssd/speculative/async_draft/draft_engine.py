"""The SSD draft's computation: serve speculations from the cache (or a fallback), then build the next cache.

Runs in the draft worker process (see ``worker.py``), and can run in-process for tests. Terms follow
docs/design.md, "SSD". For each sequence the draft mirrors the committed tokens t_1..t_n (t_n = pending).
After returning the speculation [t_n, e_1..e_K] for a round, :meth:`DraftEngine.build_cache`:

1. *glue*: runs t_n, e_1..e_K through the draft at their own positions (natural slots of the block table),
   giving the draft's distribution after each of them;
2. *fork*: for every acceptance length k, candidates C_k = the F_k likeliest draft tokens after e_1..e_k,
   excluding e_{k+1} (a recovery token never equals the rejected draft token). A dynamic plan gives a budget
   instead, spent on the outcomes (k, c) likeliest by the draft's probabilities, calibrated online against
   the verified outcomes (``dynamic_fanout.py``, ``calibration.py``); the fork is in ``tree.py``;
3. *tree decode*: for every branch (k, c) decodes K tokens continuing t_1..t_n, e_1..e_k, c. All branches of
   all sequences advance together, one batched forward per depth, with a tree mask. Branch K/V lives in
   scratch slots after the glue region of the block table (depth-major: depth j, branch b at
   ``n + L + j * M + b`` for a speculation of L <= K drafts), and RoPE uses the logical positions;
4. stores (k, c) -> (K tokens, the distributions they were drawn from). With an interruptible build (the
   worker's default) a request that arrives mid-build ends it after the current depth: every branch keeps
   the tokens drafted so far, and a hit on a shorter entry is served as it is.

When the outcome (k, t*) of verifying that speculation arrives, (k, t*) is looked up; a miss is served by the
fallback: ``jit`` drafts K tokens sequentially now, ``random`` returns a filler with an explicit one-hot q
(exact, nearly free): the tokens prompt lookup copies while it finds matches, then, with ``pad_filler``, the
pending token repeated up to K. Unpadded fillers are usually shorter than K, often empty (on CPU every
verified position costs the target time, and a repeat is rarely accepted); the tree still drafts K tokens
per branch, since the next round asks for K again.

With prompt lookup (``ssd/speculative/lookup.py``) every draft step, in the tree and in ``jit``, proposes the token it
copies from the context instead of the model's whenever it has one, with a one-hot q; the bonus fork (k = K)
tries that copy first. A sequence with structured outputs keeps every draft and fork candidate to its grammar.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping

import torch

from ssd.core.kv_cache_manager import KVCacheManager
from ssd.core.sequence import Sequence
from ssd.options import Fallback, LookupConfig
from ssd.runtime.forward_items import ForwardItem
from ssd.runtime.model_runner import ModelRunner
from ssd.sample.saguaro import saguaro_scale
from ssd.sampling_params import SamplingParams
from ssd.speculative.async_draft.draft_state import (
    Branch,
    BuildStats,
    CachedSpeculation,
    DraftSeqState,
    SpeculateRow,
    SpeculationResult,
    branch_masks,
    draft_seed,
    drafts_before,
)
from ssd.speculative.async_draft.planning.calibration import AcceptanceCalibration
from ssd.speculative.async_draft.planning.dynamic_fanout import DynamicFanOut, keeps_drafting
from ssd.speculative.async_draft.planning.fanout import FanOutPlan, per_k_counts
from ssd.speculative.async_draft.tree import fork_dynamic, fork_fixed, tree_item
from ssd.speculative.drafting import DraftDistribution, draft_sequentially
from ssd.speculative.lookup import copied_run, new_lookup
from ssd.structured.grammar import GrammarCompiler
from ssd.structured.spec import StructuredOutputs

logger = logging.getLogger(__name__)


class DraftEngine:
    def __init__(
        self,
        runner: ModelRunner,
        kv_manager: KVCacheManager,
        distribution: DraftDistribution,
        num_speculative_tokens: int,
        saguaro_c: float = 1.0,
        seed: int = 0,
        lookup: LookupConfig | None = None,
        pad_filler: bool = False,
        grammars: GrammarCompiler | None = None,
    ) -> None:
        self.runner = runner
        self.kv = kv_manager
        self.dist = distribution
        self.K = num_speculative_tokens
        self.saguaro_c = saguaro_c
        self.seed = seed
        self.lookup = lookup or LookupConfig(enabled=False)
        self.pad_filler = pad_filler
        self.grammars = grammars  # compiles sequences' output constraints (structured outputs)
        self.states: dict[int, DraftSeqState] = {}
        self.last_build = BuildStats()
        self.calibration = AcceptanceCalibration()  # draft probability -> acceptance rate, for dynamic forks
        self._jit_states: list[DraftSeqState] = []

    # ------------------------------------------------------------------ sequence lifecycle
    @torch.inference_mode()
    def prefill(self, seqs: list[tuple[int, list[int], SamplingParams]]) -> None:
        """Start mirroring sequences and compute their K/V (all but the last token, which is pending)."""
        items, fresh = [], []
        for seq_id, token_ids, params in seqs:
            mirror = self._new_state(seq_id, list(token_ids), params).mirror
            self.kv.allocate_prefix(mirror)
            todo = mirror.num_tokens - 1 - mirror.num_computed_tokens
            if todo > 0 and self.kv.allocate_slots(mirror, todo):
                items.append(ForwardItem(mirror.token_ids[mirror.num_computed_tokens : -1],
                                         mirror.num_computed_tokens, mirror.block_table, 0))
                fresh.append((mirror, todo))
        if items:
            self.runner.forward(items)
        for mirror, todo in fresh:
            mirror.num_computed_tokens += todo
            self.kv.cache_full_blocks(mirror)

    def _new_state(self, seq_id: int, mirrored: list[int], params: SamplingParams) -> DraftSeqState:
        """Start mirroring a sequence (forgetting an earlier one of that id) with ``mirrored`` tokens."""
        self.release(seq_id)
        generator = torch.Generator(device=self.runner.device)
        generator.manual_seed(draft_seed(params.seed, self.seed, seq_id))
        mirror = Sequence(seq_id, mirrored, params)
        state = DraftSeqState(mirror, generator, lookup=new_lookup(self.lookup, mirror.token_ids))
        self.states[seq_id] = state
        return state

    def constrain(self, seq_id: int, constraint: StructuredOutputs, output_tokens: list[int]) -> None:
        """Keep a (just prefilled) sequence's drafts to its output constraint; ``output_tokens``: those it has
        emitted so far. Every draft step then draws among the tokens the grammar allows after the committed
        tokens and the drafts before it, and forks offer only allowed candidates: the target masks them the same
        way, so more drafts are accepted (exactness does not depend on it)."""
        if self.grammars is None:
            raise RuntimeError("this draft engine has no grammar compiler for structured outputs")
        grammar = self.grammars.compile(constraint)
        for token in output_tokens:
            grammar.advance(token)
        self.states[seq_id].grammar = grammar

    def expect_first_round(self, tree_depths: dict[int, int]) -> None:
        """Treat each (just prefilled) sequence's prompt as a verified speculation with no drafts, whose
        bonus is the token the target's prompt step emits on its own: :meth:`build_cache` then prepares the
        first round's speculations (candidates at k = 0, ``tree_depths[seq_id]`` drafts each), and the first
        request, (k = 0, that token), can hit instead of paying the fallback."""
        for seq_id, tree_depth in tree_depths.items():
            state = self.states[seq_id]
            state.speculation = [state.mirror.last_token_id]
            state.tree_depth = tree_depth
            state.num_valid_drafts = 0
            state.copied, state.confidences = [], []
            state.cache = {}

    def release(self, seq_id: int) -> None:
        state = self.states.pop(seq_id, None)
        if state is not None:
            self.kv.free(state.mirror)

    # ------------------------------------------------------------------ serving
    @torch.inference_mode()
    def speculate(self, rows: list[SpeculateRow], fallback: Fallback) -> list[SpeculationResult]:
        results: list[SpeculationResult | None] = [None] * len(rows)
        jit_rows: list[int] = []
        for i, row in enumerate(rows):
            state = self.states[row.seq_id]
            hit = self._commit(state, row)
            # A hit may hold fewer than num_drafts tokens (a build cut short when the next request arrived, or
            # one built for a shorter round): served as it is, it costs nothing and may still be accepted.
            if hit is not None:
                probs = None if hit.probs is None else hit.probs[: row.num_drafts]
                n = row.num_drafts
                results[i] = SpeculationResult(hit.tokens[:n], probs, True, None, hit.copied[:n])
            elif fallback == Fallback.JIT:
                jit_rows.append(i)
            else:
                results[i] = self._filler(state, row.num_drafts)
        if jit_rows:
            for i, result in zip(jit_rows, self._jit([rows[i] for i in jit_rows])):
                results[i] = result
        for row, result in zip(rows, results):
            state = self.states[row.seq_id]
            state.speculation = state.mirror.token_ids[-1:] + result.tokens  # (a head's mirror may be empty)
            state.copied, state.confidences = list(result.copied), []
            state.tree_depth = row.tree_depth
            state.cache = {}
            if result.fallback == Fallback.RANDOM:
                state.num_valid_drafts = 0
        return results  # type: ignore[return-value]

    def _commit(self, state: DraftSeqState, row: SpeculateRow) -> CachedSpeculation | None:
        """Append the newly committed tokens; return the cached speculation for the outcome, if any."""
        mirror = state.mirror
        k = row.num_accepted
        sent = state.speculation
        consistent = k >= 0 and sent and row.new_tokens[:-1] == sent[1 : k + 1] and len(row.new_tokens) == k + 1
        pending_valid = mirror.num_computed_tokens == mirror.num_tokens
        mirror.append_tokens(row.new_tokens)
        if state.grammar is not None:
            for token in row.new_tokens:
                state.grammar.advance(token)
        if not consistent:
            mirror.num_computed_tokens = max(0, min(mirror.num_computed_tokens, mirror.num_tokens - 1))
            return None
        if state.confidences:
            self.calibration.observe_round(state.confidences, state.copied, k)
        if pending_valid:  # t_n and the accepted e_1..e_k already have K/V at their own positions
            mirror.num_computed_tokens += min(k, state.num_valid_drafts)
        self.kv.cache_full_blocks(mirror)
        return state.cache.get((k, row.new_tokens[-1]))

    def _jit(self, rows: list[SpeculateRow]) -> list[SpeculationResult]:
        states = [self.states[r.seq_id] for r in rows]
        mirrors = [s.mirror for s in states]
        self._jit_states = states
        for mirror, row in zip(mirrors, rows):
            self._allocate(mirror, mirror.num_uncomputed_tokens + row.num_drafts - 1)
        drafts = draft_sequentially(
            self.runner,
            mirrors,
            [r.num_drafts for r in rows],
            [s.generator for s in states],
            self.dist,
            None,
            adjust=self._saguaro_jit,
            lookups=[s.lookup for s in states],
            grammars=[s.grammar for s in states],
        )
        out = []
        for i, (state, row) in enumerate(zip(states, rows)):
            k = row.num_drafts
            state.num_valid_drafts = min(k - 1, max(0, drafts.computed[i] - state.mirror.num_tokens))
            probs = None if state.greedy else drafts.probs[i, :k]
            out.append(SpeculationResult(drafts.tokens[i, :k].tolist(), probs, False, Fallback.JIT, drafts.copied[i, :k].tolist()))
        return out

    def _filler(self, state: DraftSeqState, num_drafts: int) -> SpeculationResult:
        """Up to ``num_drafts`` tokens with a one-hot q and no model call: what prompt lookup copies from the
        context as long as it finds a match (possibly nothing), then the pending token repeated up to
        ``num_drafts`` if ``pad_filler``."""
        tokens = copied_run(state.lookup, num_drafts)
        copied = [True] * len(tokens)
        if self.pad_filler:
            copied += [False] * (num_drafts - len(tokens))
            tokens += [state.mirror.last_token_id] * (num_drafts - len(tokens))
        n = len(tokens)
        probs = None
        if not state.greedy:
            probs = torch.zeros(n, self.dist.target_vocab_size, device=self.runner.device)  # [n, V]
            probs[torch.arange(n), torch.tensor(tokens, dtype=torch.long)] = 1.0
        return SpeculationResult(tokens, probs, False, Fallback.RANDOM, copied)

    # ------------------------------------------------------------------ cache building
    @torch.inference_mode()
    def build_cache(
        self, fan_outs: Mapping[int, FanOutPlan], should_stop: Callable[[], bool] | None = None
    ) -> BuildStats:
        """Glue, fork and tree-decode the speculations just returned, with F_0..F_K (or a dynamic budget) per
        sequence.

        ``should_stop`` is asked after each tree step from the first on: when it says yes (the next request
        is already waiting), the build ends there and every branch keeps the tokens drafted so far, so the
        draft never holds up the target for the deeper, less likely accepted tokens."""
        start = time.perf_counter()
        states, plans = [], []
        for seq_id, plan in fan_outs.items():
            state = self.states.get(seq_id)
            if state is not None and state.tree_depth > 0:
                states.append(state)
                plans.append(plan)
        if not states:
            self.last_build = BuildStats()
            return self.last_build
        glue_logits = self._glue(states, [_max_branches(p, len(s.speculation) - 1) for s, p in zip(states, plans)])
        # forks offer only tokens the grammar allows (structured outputs): the target may emit only those
        glue_logits = [self.dist.constrain(logits, s.glue_masks()) for s, logits in zip(states, glue_logits)]
        trees: list[list[Branch]] = []  # per sequence, its branches
        for state, plan, logits in zip(states, plans, glue_logits):
            if isinstance(plan, DynamicFanOut):
                outcomes = fork_dynamic(state, logits, self.dist, self.calibration, plan.budget)
                trees.append([Branch(o.k, o.token, o.weight) for o in outcomes])
                state.fan_out = per_k_counts([(o.k, o.token) for o in outcomes], self.K)
            else:
                state.fan_out = list(plan)
                trees.append([Branch(k, token) for k, token in fork_fixed(state, logits, self.dist)])
        num_branches = sum(len(tree) for tree in trees)
        depth, interrupted = self._tree_decode(states, trees, should_stop)
        self.last_build = BuildStats(time.perf_counter() - start, num_branches, depth, interrupted,
                                     {s.mirror.seq_id: list(s.fan_out) for s in states})
        return self.last_build

    def _glue(self, states: list[DraftSeqState], max_branches: list[int]) -> list[torch.Tensor]:
        items = []
        for state, m in zip(states, max_branches):
            mirror = state.mirror
            drafts = state.speculation[1:]
            k = len(drafts)
            self._allocate(mirror, mirror.num_uncomputed_tokens + k + state.tree_depth * m)
            # t_n always runs again: after a jit round its K/V is already valid, but the fork at k = 0 needs
            # the distribution after it (K+1 logits from K tokens would read another row).
            start = min(mirror.num_computed_tokens, mirror.num_tokens - 1)
            tokens = mirror.token_ids[start:] + drafts
            items.append(ForwardItem(tokens, start, mirror.block_table, k + 1))
        logits = self.runner.forward(items)  # [sum(K+1), Vd]
        out, offset = [], 0
        for state in states:
            n = len(state.speculation)
            out.append(logits[offset : offset + n])
            offset += n
            state.mirror.num_computed_tokens = state.mirror.num_tokens
            state.num_valid_drafts = n - 1
        return out

    def _tree_decode(self, states: list[DraftSeqState], trees: list[list[Branch]],
                     should_stop: Callable[[], bool] | None = None) -> tuple[int, bool]:
        """Decode every branch of every sequence's tree up to its tree depth, fewer tokens when ``should_stop``
        ends the build early or, in a dynamic fan-out (branches with a ``weight``), once ``keeps_drafting``
        says a branch's next token is not worth a row; then cache each branch's drafts under its outcome.
        Returns the number of tree steps run and whether ``should_stop`` ended the build."""
        depth = max(s.tree_depth for s in states)  # tokens per branch
        steps = 0
        interrupted = False
        for j in range(depth):
            items, owners = [], []
            for i, (state, tree) in enumerate(zip(states, trees)):
                if j < state.tree_depth and any(branch.drafting for branch in tree):
                    items.append(tree_item(state, tree, j, len(state.speculation) - 1, self.runner.block_size))
                    owners.append(i)
            if not items:
                break
            rows = [(states[i], branch) for i in owners for branch in trees[i] if branch.drafting]
            logits = self.dist.constrain(self._tree_forward(items, rows), branch_masks(rows))  # [rows, Vd]
            params = [state.mirror.sampling_params for state, _ in rows]
            generators = [state.generator for state, _ in rows]
            scaled = [_at(state.fan_out, j) for state, _ in rows]
            forced = [state.copy(drafts_before(state, branch.k, branch.token) + branch.tokens)
                      for state, branch in rows]
            tokens_t, probs = self.dist.draw(  # probs: [rows, V], None when all rows are greedy
                logits, params, generators, None, lambda lg, pr: self._saguaro(pr, lg, params, scaled), forced
            )
            tokens = tokens_t.tolist()
            confidence = None
            if any(branch.weight is not None for _, branch in rows):
                confidence = self.dist.token_probs(logits, tokens_t[:, None])[:, 0].tolist()  # [rows]
            for r, (state, branch) in enumerate(rows):
                branch.tokens.append(tokens[r])
                branch.copied.append(forced[r] is not None)
                if not state.greedy:
                    branch.probs.append(probs[r])
                if branch.weight is not None:
                    branch.path *= self.calibration.rate(min(1.0, confidence[r]), forced[r] is not None)
            for i in owners:
                weights = [b.weight for b in trees[i] if b.weight is not None]
                for branch in trees[i]:
                    if branch.drafting and branch.weight is not None:
                        branch.drafting = keeps_drafting(branch.weight, branch.path, min(weights))
            steps = j + 1
            if should_stop is not None and steps < depth and should_stop():
                interrupted = True
                break
        for state, tree in zip(states, trees):
            for branch in tree:
                kept = torch.stack(branch.probs) if branch.probs else None
                state.cache[(branch.k, branch.token)] = CachedSpeculation(branch.tokens, kept, branch.copied)
        return steps, interrupted

    def _tree_forward(self, items: list[ForwardItem], rows: list[tuple[DraftSeqState, Branch]]) -> torch.Tensor:
        """One tree depth: ``items`` run a row for each drafting branch, ``rows`` in the same order; returns their
        logits ``[rows, Vd]``."""
        return self.runner.forward(items)

    def _saguaro(self, probs, logits, params: list[SamplingParams], num_scaled: list[int]) -> torch.Tensor:
        """Scale q on the candidates a later fork caches: a token drawn at depth j of a speculation is the
        draft at acceptance length j, whose rejection the fork covers with F_j candidates."""
        width = max(num_scaled, default=0)
        if self.saguaro_c >= 1.0 or width <= 0 or all(p.is_greedy for p in params):
            return probs
        masked = self.dist.masked_logits(logits)  # [N, V]
        top = torch.topk(masked, min(width, masked.shape[-1]), dim=-1).indices  # [N, F]
        counts = torch.tensor(num_scaled, device=top.device)  # [N]
        keep = torch.arange(top.shape[1], device=top.device)[None, :] < counts[:, None]  # [N, F]
        top = torch.where(keep, top, top[:, :1])  # rows scaling fewer candidates repeat their first one
        scaled = saguaro_scale(probs, top, self.saguaro_c)  # [N, V]
        return torch.where((counts > 0)[:, None], scaled, probs)  # a row with no candidates keeps q

    def _saguaro_jit(self, step: int, rows: list[int], logits: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        params = [self._jit_states[i].mirror.sampling_params for i in rows]
        return self._saguaro(probs, logits, params, [_at(self._jit_states[i].fan_out, step) for i in rows])

    def _allocate(self, mirror: Sequence, num_tokens: int) -> None:
        if not self.kv.allocate_slots(mirror, num_tokens):
            raise RuntimeError("draft KV cache exhausted; it is sized to never run out before the target's")


def _at(values: list[int], index: int) -> int:
    return values[index] if index < len(values) else 0


def _max_branches(plan: FanOutPlan, num_drafts: int) -> int:
    """The most branches a plan can fork after a speculation of `num_drafts` drafts (scratch slots per depth)."""
    if isinstance(plan, DynamicFanOut):
        return plan.budget
    return sum(plan[: num_drafts + 1])
