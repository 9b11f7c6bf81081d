"""The SSD draft worker: a process of its own that serves speculations and builds the next cache.

A :class:`DraftWorker` with one handler per message (``run_draft_worker`` starts it): for SPECULATE it
replies at once and then builds the cache for the round being verified, which is the work that SSD takes off
the critical path; after a PREFILL whose rows ask for it, it builds the cache for those sequences' first round
while the target computes their prompts. A build ends early when the next request is waiting or due (``BuildClock``).
It pins itself to its own CPU cores (or uses its own device) so target and draft do not compete.
"""

from __future__ import annotations

import logging
import os
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection

import numpy as np
import torch

from ssd.config import EngineConfig, SpeculativeConfig
from ssd.core.block_pool import BlockPool
from ssd.core.kv_cache_manager import KVCacheManager
from ssd.dtypes import torch_dtype
from ssd.models.eagle3 import is_eagle3_head
from ssd.models.loader import load_arch_config, load_input_embedding
from ssd.options import FillerPadding
from ssd.runtime.model_runner import GraphOptions, ModelRunner
from ssd.sampling_params import SamplingParams
from ssd.speculative.async_draft.draft_engine import DraftEngine
from ssd.speculative.async_draft.draft_state import BuildStats, SpeculateRow
from ssd.speculative.async_draft.head_engine import HeadDraftEngine
from ssd.speculative.async_draft.planning.build_clock import BuildClock
from ssd.speculative.async_draft.planning.fanout import BudgetController, FanOutPlan, fan_out_policy
from ssd.speculative.async_draft.wire import protocol as wire
from ssd.speculative.drafting import DraftDistribution
from ssd.speculative.head_runner import HeadRunner, load_head
from ssd.structured.grammar import GrammarCompiler
from ssd.structured.spec import StructuredOutputs

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerConfig:
    """What the draft worker starts from: the engine's resolved options (it reads those ``ssd/config.py``
    declares for ``Process.DRAFT_WORKER``) and what the target side worked out for it."""

    engine_config: EngineConfig  # resolved (ssd/resolve.py), with a speculative_config of method "ssd"
    device: str  # the draft's
    max_model_len: int  # the target's
    num_blocks: int  # draft KV blocks: the target's plus scratch for every branch of every running sequence
    target_vocab_size: int
    num_usable_tokens: int  # token ids both models can produce
    cpu_affinity: list[int] | None = None
    log_level: int = logging.WARNING
    graphs: GraphOptions | None = None  # CUDA graphs for glue and tree steps (None: eager)

    @property
    def spec(self) -> SpeculativeConfig:
        assert self.engine_config.spec is not None
        return self.engine_config.spec


def _pin(config: WorkerConfig) -> None:
    if config.cpu_affinity and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, config.cpu_affinity)
    threads = config.spec.draft_threads or (len(config.cpu_affinity) if config.cpu_affinity else None)
    if threads:
        torch.set_num_threads(threads)


def build_draft_engine(config: WorkerConfig) -> DraftEngine:
    spec, engine_config = config.spec, config.engine_config
    if is_eagle3_head(spec.model):
        return _build_head_engine(config)
    runner = ModelRunner(
        spec.model, spec.draft_dtype, config.device, engine_config.block_size, config.max_model_len,
        kv_cache_memory=None, kv_cache_fraction=0.5, num_blocks=config.num_blocks,
        graphs=config.graphs, weight_format=spec.draft_weight_format, fused_kernels=engine_config.fused_kernels,
    )
    kv = KVCacheManager(BlockPool(runner.num_blocks, engine_config.block_size, engine_config.enable_prefix_caching))
    dist = DraftDistribution.for_runner(runner, config.target_vocab_size, config.num_usable_tokens)
    return DraftEngine(runner, kv, dist, spec.num_speculative_tokens, spec.saguaro_c, engine_config.seed, spec.lookup,
                       pad_filler=spec.filler_padding is FillerPadding.REPEAT, grammars=_grammars(config))


def _build_head_engine(config: WorkerConfig) -> HeadDraftEngine:
    """An EAGLE-3 head's engine; a head without its own embedding reads the target's, loaded alone here."""
    spec, engine_config = config.spec, config.engine_config
    embedding = load_input_embedding(engine_config.model, torch_dtype(spec.draft_dtype))
    head, _ = load_head(spec, load_arch_config(engine_config.model), embedding, config.device)
    runner = HeadRunner(head, config.num_blocks, engine_config.block_size, config.device)
    kv = KVCacheManager(BlockPool(runner.num_blocks, engine_config.block_size, enable_prefix_caching=False))
    dist = DraftDistribution(config.target_vocab_size, config.num_usable_tokens, head.draft_to_target.to(runner.device))
    return HeadDraftEngine(runner, kv, dist, spec.num_speculative_tokens, spec.saguaro_c, engine_config.seed,
                           spec.lookup, pad_filler=spec.filler_padding is FillerPadding.REPEAT,
                           grammars=_grammars(config))


def _grammars(config: WorkerConfig) -> GrammarCompiler:
    """Output constraints compile against the target's tokenizer (drafts are target ids), loaded at the first."""
    engine_config = config.engine_config
    return GrammarCompiler.for_folder(engine_config.tokenizer or engine_config.model, config.target_vocab_size)


class FanOutPlanner:
    """Fan-out for the next cache build: one policy for speculations served from the cache, one for misses."""

    def __init__(self, spec: SpeculativeConfig) -> None:
        K, budget = spec.num_speculative_tokens, spec.fan_out_budget
        self.hit, self.miss = (fan_out_policy(f, K, budget) for f in spec.fan_outs)
        self.adjustable = [p for p in (self.hit, self.miss) if p.adjustable]
        self.controller = BudgetController(K) if self.adjustable and budget is None else None
        if self.controller is not None:
            self._set_budget(self.controller.budget)

    def observe_timing(self, build_s: float, idle_s: float) -> None:
        """The last cache build took `build_s`, then the draft idled `idle_s` until this request."""
        if self.controller is not None:
            self._set_budget(self.controller.observe(build_s, idle_s))

    def _set_budget(self, budget: int) -> None:
        for policy in self.adjustable:
            policy.set_budget(budget)

    def observe(self, served_by_hit: bool, k: int, num_drafts: int, hit: bool, fan_out_k: int) -> None:
        """The policy that planned the cache just looked up learns from the round and the lookup, if it is an
        "auto" one (fixed and dynamic plans do not read the estimates)."""
        policy = self.hit if served_by_hit else self.miss
        if not policy.is_auto:
            return
        estimator = policy.estimator
        estimator.observe_round(num_drafts, k)
        if fan_out_k > 0:  # no candidates were built for this k: the lookup says nothing about r
            estimator.observe_lookup(fan_out_k, hit)

    def plan(self, hit: bool, num_drafts: int) -> FanOutPlan:
        """The plan for the cache after a speculation of `num_drafts` drafts, served by a hit or not."""
        return (self.hit if hit else self.miss).plan(num_drafts)


def run_draft_worker(conn: Connection, config: WorkerConfig,
                     ready_info: Callable[[], dict[str, wire.Scalar]] | None = None) -> None:
    """Process entry point (a local worker's, and a draft server's session's over its socket). Returns when told
    to shut down or when the target side goes away. ``ready_info``: what READY tells the client, asked for once
    the engine is built."""
    logging.basicConfig(level=config.log_level, format="%(asctime)s draft-worker %(levelname)s: %(message)s")
    try:
        _pin(config)
        worker = DraftWorker(conn, build_draft_engine(config), FanOutPlanner(config.spec),
                             BuildClock(conn.poll) if config.spec.interruptible_build else None)
    except Exception as exc:  # report start-up failures to the client instead of dying silently
        logger.exception("draft worker failed to start")
        conn.send_bytes(wire.ErrorMsg(f"draft worker failed to start: {exc}").pack())
        return
    conn.send_bytes(wire.ReadyMsg(info=ready_info() if ready_info else {}).pack())
    try:
        worker.run()
    except (EOFError, OSError):
        logger.warning("target side closed the connection; draft worker exiting")
    except Exception as exc:  # tell the client (it continues without speculation) rather than vanish
        logger.exception("draft worker failed")
        try:
            conn.send_bytes(wire.ErrorMsg(f"draft worker failed: {exc!r}", traceback.format_exc()).pack())
        except OSError:
            pass


@dataclass(frozen=True)
class BuiltCache:
    """What the last build prepared for a sequence, kept until its next request says how the round went."""

    after_hit: bool  # the speculation it followed was served from the cache
    num_drafts: int  # drafts of that speculation (K_i)
    fan_out: list[int]  # F_0..F_K built


class DraftWorker:
    """The draft process's state and one handler per message the target sends (PREFILL, SPECULATE, RELEASE,
    SHUTDOWN); :meth:`run` receives, dispatches, and after a SPECULATE replies at once and then builds."""

    def __init__(self, conn: Connection, engine: DraftEngine, planner: FanOutPlanner, clock: BuildClock | None) -> None:
        self.conn = conn
        self.engine = engine
        self.planner = planner
        self.clock = clock  # None: builds run to the end
        self.built: dict[int, BuiltCache] = {}  # seq_id -> the cache built for its next round
        self.first_round: dict[int, int] = {}  # seq_id -> drafts per branch of a first-round cache not built yet
        self.built_at: float | None = None  # when the last cache build ended, if no other message came since
        self._handlers = {wire.PrefillMsg: self.on_prefill, wire.SpeculateMsg: self.on_speculate,
                          wire.ReleaseMsg: self.on_release}

    def run(self) -> None:
        """Serve messages until SHUTDOWN (or the connection closes: EOFError / OSError reach the caller)."""
        while True:
            data = self.conn.recv_bytes()
            arrived = time.perf_counter()
            msg = wire.decode_message(data)
            if isinstance(msg, wire.ShutdownMsg):
                return
            self._observe_idle(arrived, isinstance(msg, wire.SpeculateMsg))
            handler = self._handlers.get(type(msg))
            if handler is None:
                raise ValueError(f"the draft worker does not handle {type(msg).__name__}")
            handler(msg)

    def _observe_idle(self, arrived: float, is_request: bool) -> None:
        """A message arrived at ``arrived``: the clock learns the gap to a request, and the fan-out budget how
        long the last build left the draft idle before it. A build that stopped before a step it had no time
        for neither idled nor kept the target waiting: its budget fits the verification, so the controller
        holds it."""
        if self.clock is not None:
            arrived = self.clock.message_arrived(arrived, is_request)
        if (is_request and self.built_at is not None and self.engine.last_build.num_branches
                and not (self.clock is not None and self.clock.ended_by_deadline)):
            self.planner.observe_timing(self.engine.last_build.seconds, max(0.0, arrived - self.built_at))
        self.built_at = None

    def on_prefill(self, msg: wire.PrefillMsg) -> None:
        """Prefill new sequences; build their first-round caches now, while the target computes the prompts,
        unless other sequences' request is already waiting (then with their next cache, so the draft does not
        hold them up)."""
        seqs = [(int(sid), toks.tolist(), _params(msg, row))
                for row, (sid, toks) in enumerate(zip(msg.seq_ids, msg.token_lists()))]
        self.engine.prefill(seqs)
        for (seq_id, tokens, _), start, constraint in zip(seqs, msg.num_prompt_tokens, msg.constraint_texts()):
            if constraint is not None:
                self.engine.constrain(seq_id, StructuredOutputs.from_json(constraint), tokens[int(start):])
        requested = dict(zip(msg.seq_ids.tolist(), msg.first_round_drafts.tolist()))
        for seq_id in requested:  # a re-prefilled sequence drops a first round still pending
            self.first_round.pop(seq_id, None)
        fresh = {seq_id: n for seq_id, n in requested.items() if n > 0}
        self.engine.expect_first_round(fresh)
        self.first_round.update(fresh)
        if self.first_round and (len(self.engine.states) == len(self.first_round) or not self.conn.poll()):
            self._build({})

    def on_release(self, msg: wire.ReleaseMsg) -> None:
        for seq_id in msg.seq_ids.tolist():
            self.engine.release(seq_id)
            self.built.pop(seq_id, None)
            self.first_round.pop(seq_id, None)

    def on_speculate(self, msg: wire.SpeculateMsg) -> None:
        """Serve the speculations (cache hit or fallback) and reply; then, off the target's critical path,
        let the fan-out policies learn from the lookups and build the next cache."""
        start = time.perf_counter()
        rows = [
            SpeculateRow(int(seq_id), new.tolist(), int(k), int(n), int(depth),
                         None if features is None else (features[0], torch.from_numpy(features[1])))
            for seq_id, new, k, n, depth, features in zip(msg.seq_ids, msg.new_token_lists(), msg.num_accepted,
                                                          msg.num_drafts, msg.tree_depth, msg.target_features())
        ]
        results = self.engine.speculate(rows, msg.fallback)
        reply = speculation_message(msg.round_id, results, self.engine.K, self.engine.dist.target_vocab_size,
                                    self.engine.last_build, time.perf_counter() - start)
        self.conn.send_bytes(reply.pack())
        if self.clock is not None:
            self.clock.replied()
        # The reply is out: from here on the draft works while the target verifies.
        served = {}
        for row, result in zip(rows, results):
            previous = self.built.pop(row.seq_id, None)
            if row.num_accepted >= 0 and previous is not None:
                k = row.num_accepted
                f = previous.fan_out[k] if k < len(previous.fan_out) else 0
                self.planner.observe(previous.after_hit, k, previous.num_drafts, result.hit, f)
            served[row.seq_id] = (result.hit, len(result.tokens))
        self._build(served)
        self.built_at = time.perf_counter()

    def _build(self, served: dict[int, tuple[bool, int]]) -> None:
        """Build the next cache: for the sequences just served (``served``: seq_id -> (served by a hit,
        drafts)), plus the first round of sequences prefilled since the last build (then forgotten): their
        prompt is a speculation with no drafts, planned like a round not served from the cache (so a geometric
        plan folds its whole budget onto k = 0). With interruptible builds (a clock), a waiting message or the
        next request's due time ends the build early (``BuildClock``)."""
        for seq_id in self.first_round:
            served.setdefault(seq_id, (False, 0))  # one that was served already holds that speculation now
        self.first_round.clear()
        plans = {seq_id: self.planner.plan(hit, num_drafts) for seq_id, (hit, num_drafts) in served.items()}
        if self.clock is not None:
            self.clock.start_build()
        should_stop = None if self.clock is None else self.clock.should_stop
        fan_outs = self.engine.build_cache(plans, should_stop=should_stop).fan_outs
        for seq_id, (hit, num_drafts) in served.items():
            if seq_id in fan_outs:
                self.built[seq_id] = BuiltCache(hit, num_drafts, fan_outs[seq_id])


def speculation_message(
    round_id: int, results, K: int, vocab: int, build: BuildStats, serve_s: float
) -> wire.SpeculationMsg:
    tokens = np.zeros((len(results), K), dtype=np.int64)  # [B, K]
    copied = np.zeros((len(results), K), dtype=np.bool_)  # [B, K]
    prob_rows, probs = [], []
    for i, r in enumerate(results):
        tokens[i, : len(r.tokens)] = r.tokens
        copied[i, : len(r.copied)] = r.copied
        if r.probs is not None:
            prob_rows.append(i)
            padded = torch.zeros(K, vocab)  # [K, V]
            padded[: r.probs.shape[0]] = r.probs
            probs.append(padded)
    return wire.SpeculationMsg(
        round_id=round_id,
        draft_tokens=tokens,
        hit=np.array([r.hit for r in results], dtype=np.bool_),
        fallback=wire.encode_fallbacks([r.fallback for r in results]),
        prob_rows=np.array(prob_rows, dtype=np.int32),
        probs=torch.stack(probs).numpy() if probs else np.zeros((0, K, vocab), dtype=np.float32),
        copied=copied,
        num_drafts=np.array([len(r.tokens) for r in results], dtype=np.int32),
        cache_build_s=build.seconds,
        cache_branches=build.num_branches,
        cache_cut_short=int(build.cut_short),
        serve_s=serve_s,
    )


def _params(msg: wire.PrefillMsg, row: int) -> SamplingParams:
    greedy = bool(msg.greedy[row])
    return SamplingParams(
        temperature=0.0 if greedy else float(msg.temperature[row]),
        top_k=int(msg.top_k[row]),
        top_p=float(msg.top_p[row]),
        seed=msg.seed_of(row),
    )
