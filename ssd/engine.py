"""The engine loop: admit requests, schedule, execute one step, apply the results, report outputs.

``schedule -> execute -> update`` and nothing else lives here; models, caches, sampling and speculation
are behind :class:`StepExecutor` and the proposers. Speculation never mutates sequence state: only
:meth:`LLMEngine._update` appends tokens, moves ``num_computed_tokens`` and frees KV blocks.
"""

from __future__ import annotations

import itertools
import logging
import time

import torch

from ssd.config import EngineConfig
from ssd.core.block_pool import BlockPool
from ssd.core.kv_cache_manager import KVCacheManager
from ssd.core.scheduler import Scheduler, SchedulerConfig, SequenceTooLongError
from ssd.core.sequence import FinishReason, Sequence
from ssd.distributed.launcher import TensorParallelRanks
from ssd.models.loader import load_arch_config
from ssd.outputs import RequestMetrics, RequestOutput, SpecStats
from ssd.placement import CpuPinning, plan_engine_layout, start_target_runner
from ssd.request import EncodedPrompt, Request
from ssd.resolve import resolve_config
from ssd.sample.penalties import check_token_ids
from ssd.sample.sampler import make_generator
from ssd.sampling_params import SamplingParams
from ssd.speculative.factory import build_proposer
from ssd.speculative.round_plan import RoundPlanner
from ssd.speculative.proposal import TargetFacts, VerifiedRound
from ssd.step import RowContext, StepExecutor, StepResult
from ssd.structured.grammar import GrammarCompiler
from ssd.tokenizer import IncrementalDetokenizer, Tokenizer

logger = logging.getLogger(__name__)


class LLMEngine:
    """Synchronous engine: call :meth:`add_request`, then :meth:`step` until :meth:`has_unfinished`."""

    def __init__(self, config: EngineConfig) -> None:
        config = self.config = resolve_config(config)  # every "auto" decided for this machine
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        load_arch_config(config.model)  # a missing folder or broken config.json is reported as such, first
        self.tokenizer = Tokenizer(config.tokenizer or config.model)
        self.spec = config.speculative_config
        self.layout = plan_engine_layout(config)
        self.device = torch.device(self.layout.rank_devices[0])
        self.pinning = CpuPinning()
        if self.layout.rank_cpus[0] is not None:
            cpus = self.layout.rank_cpus[0]
            self.pinning.pin(cpus, self.layout.rank_threads[0] or config.num_threads or len(cpus))
        self.parallel: TensorParallelRanks | None = None
        try:
            target = start_target_runner(config, self.layout, str(self.device))
        except BaseException:
            self.shutdown()
            raise
        self.runner, self.parallel = target.runner, target.parallel
        self.max_model_len = self.runner.max_model_len
        self.kv_manager = KVCacheManager(
            BlockPool(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=self.max_model_len,
                enable_chunked_prefill=config.enable_chunked_prefill,
            ),
            self.kv_manager,
        )
        self.default_generator = torch.Generator(device=self.device)
        self.default_generator.manual_seed(config.seed)
        self.proposer = None
        if self.spec is not None:
            try:
                self.proposer = build_proposer(config, self._target_facts(), self.tokenizer, self.default_generator,
                                               self.layout.draft_cpus, self.runner)
            except BaseException:
                self.shutdown()
                raise
        self.executor = StepExecutor(self.runner, self.proposer, self.default_generator)
        self.rounds = None if self.spec is None else RoundPlanner(self.spec, self.max_model_len)  # round drafts
        self.requests: dict[int, Request] = {}
        self.stats = SpecStats()
        self._seq_ids = itertools.count()
        self.grammars = GrammarCompiler.for_tokenizer(self.tokenizer, self.runner.vocab_size)  # structured outputs

    def _target_facts(self) -> TargetFacts:
        return TargetFacts(
            vocab_size=self.runner.vocab_size,
            hidden_size=self.runner.arch.hidden_size,
            device=str(self.device),
            dtype=self.config.dtype,
            max_model_len=self.max_model_len,
            num_kv_blocks=self.runner.num_blocks,
        )

    @property
    def spec_stats(self) -> SpecStats:
        """Engine-wide speculative counters, with the proposer's draft-side ones (an SSD worker's cache builds)."""
        if self.proposer is not None:
            draft = self.proposer.statistics()
            self.stats.draft_build_time_s = draft.build_time_s
            self.stats.draft_build_branches = draft.build_branches
            self.stats.draft_builds = draft.builds
            self.stats.draft_builds_cut_short = draft.builds_cut_short
            self.stats.draft_feature_bytes = draft.feature_bytes
            self.stats.draft_rounds = draft.rounds
            self.stats.draft_reply_wait_s = draft.reply_wait_s
            self.stats.draft_serve_s = draft.serve_s
            self.stats.draft_bytes_sent = draft.bytes_sent
            self.stats.draft_bytes_received = draft.bytes_received
            self.stats.draft_link_rtt_s = draft.link_rtt_s
        return self.stats

    # ---------------------------------------------------------------- requests
    def add_request(
        self,
        prompt: "str | list[int] | EncodedPrompt",
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> Request:
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        check_token_ids(params, self.runner.vocab_size)
        text, token_ids = prompt if isinstance(prompt, EncodedPrompt) else self.encode_prompt(prompt)
        constraint = params.structured_outputs
        grammar = self.grammars.compile(constraint) if constraint is not None else None
        seq_id = next(self._seq_ids)
        now = time.monotonic()
        seq = Sequence(seq_id, token_ids, params, arrival_time=now)
        stop_ids = set(params.stop_token_ids or [])
        eos = self._eos_token_ids()
        if not params.ignore_eos:
            stop_ids |= eos
        request = Request(
            request_id=request_id if request_id is not None else str(seq_id),
            prompt=text,
            seq=seq,
            params=params,
            generator=make_generator(params.seed, self.device),
            detokenizer=IncrementalDetokenizer(
                self.tokenizer, list(params.stop or []), params.include_stop_str_in_output, params.skip_special_tokens
            ),
            metrics=RequestMetrics(arrival_time=now, num_prompt_tokens=len(token_ids)),
            stop_token_ids=stop_ids,
            logprobs=[] if params.logprobs is not None else None,
            speculation=self.spec.method.value if self.spec is not None else "off",
            grammar=grammar,
        )
        self.requests[seq_id] = request
        self.scheduler.add(seq)
        return request

    def encode_prompt(self, prompt: str | list[int]) -> "EncodedPrompt":
        """Tokenize and validate a prompt (empty, out-of-vocabulary ids, too long for max_model_len)."""
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty; give at least one character or token id")
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            text, token_ids = None, list(prompt)
            if not token_ids:
                raise ValueError("prompt token id list is empty")
            bad = [t for t in token_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.runner.vocab_size]
            if bad:
                raise ValueError(
                    f"prompt token ids must be integers in [0, {self.runner.vocab_size}); got {bad[:5]}"
                )
        else:
            raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(token_ids)} tokens but max_model_len is {self.max_model_len}; the prompt must "
                f"leave room for at least one generated token (at most {self.max_model_len - 1} prompt tokens)"
            )
        return EncodedPrompt(text, token_ids)

    def _eos_token_ids(self) -> set[int]:
        ids = set(self.runner.arch.eos_token_id or [])
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    def abort(self, request_id: str) -> bool:
        for seq_id, request in list(self.requests.items()):
            if request.request_id == request_id and not request.seq.is_finished:
                self.scheduler.abort(seq_id)
                self._release(request)
                del self.requests[seq_id]
                return True
        return False

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---------------------------------------------------------------- stepping
    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns outputs of the requests that produced tokens or finished."""
        try:
            plan = self.scheduler.schedule(self._round_drafts())
        except SequenceTooLongError as exc:  # can never fit: fail that request, keep serving the others
            return [self._fail_request(self.requests[exc.seq.seq_id], str(exc))]
        for seq in plan.preempted:
            if self.proposer is not None:
                self.proposer.release(seq)
        if not plan.scheduled:
            return []
        now = time.monotonic()
        contexts = {}
        for s in plan.scheduled:
            request = self.requests[s.seq.seq_id]
            if request.metrics.first_scheduled_time is None:
                request.metrics.first_scheduled_time = now
            self._label_speculation(request)
            contexts[s.seq.seq_id] = RowContext(
                seq=s.seq,
                generator=request.generator,
                banned_token_ids=self._banned_tokens(request),
                speculate=self._speculates(request),
                grammar=request.grammar,
            )
        started = time.perf_counter()
        result = self.executor.execute(plan.scheduled, contexts)
        if self.rounds is not None:
            self.rounds.observe_step([s.num_new_tokens for s in plan.scheduled],
                                     sum(r.num_drafts for r in result.rounds.values()), time.perf_counter() - started)
        return self._update(plan.scheduled, result)

    def _round_drafts(self) -> dict[int, int]:
        """The scheduler's plan: round drafts of every sequence it may run this step (``RoundPlanner``)."""
        if self.rounds is None:
            return {}
        return self.rounds.plan(self.scheduler.running, self.scheduler.candidates(),
                                lambda seq: self._speculates(self.requests[seq.seq_id]))

    def _speculates(self, request: Request) -> bool:
        # While EOS is banned (min_tokens) the processed distribution depends on the output position; plain
        # decoding serves those few tokens so verification stays exact.
        if self.proposer is None or not self.proposer.available:
            return False
        return request.seq.num_output_tokens >= request.params.min_tokens

    def _label_speculation(self, request: Request) -> None:
        """Tell the request's outputs why it decodes without speculation once the draft has failed."""
        if self.proposer is not None and not self.proposer.available:
            request.speculation = f"disabled: {self.proposer.failure or 'draft unavailable'}"

    def _banned_tokens(self, request: Request) -> list[int]:
        if request.seq.num_output_tokens < request.params.min_tokens:
            return sorted(request.stop_token_ids)
        return []

    def _update(self, scheduled, result: StepResult) -> list[RequestOutput]:
        outputs = []
        now = time.monotonic()
        for s in scheduled:
            seq = s.seq
            request = self.requests[seq.seq_id]
            seq.num_computed_tokens = result.num_computed[seq.seq_id]
            new_tokens = result.new_tokens.get(seq.seq_id, [])
            round_ = result.rounds.get(seq.seq_id)
            if round_ is not None:
                self._record_round(request, round_)
            if not new_tokens:
                self.kv_manager.cache_full_blocks(seq)
                continue
            first_emission = request.metrics.first_token_time is None
            if first_emission:
                request.metrics.first_token_time = now
            logprobs = result.logprobs.get(seq.seq_id)
            reason = None
            for i, token in enumerate(new_tokens):
                seq.append_tokens([token])
                if request.logprobs is not None and logprobs is not None:
                    request.logprobs.append(logprobs[i])
                reason = self._check_stop(request, token)
                if reason is None and request.grammar is not None and request.grammar.advance(token):
                    reason = FinishReason.STOP  # the grammar is complete
                if reason is None and i + 1 < len(new_tokens) and request.detokenizer.finds_stop(seq.output_token_ids):
                    reason = FinishReason.STOP  # a stop string ends mid-round: drop the rest, as plain decoding would
                if reason is not None:
                    break
            if first_emission:
                request.metrics.num_first_step_tokens = i + 1
            seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens - 1)
            self.kv_manager.cache_full_blocks(seq)
            if reason is None:
                self.kv_manager.trim(seq)
            outputs.append(self._finish_or_report(request, reason, now))
        if self.proposer is not None and result.rounds:
            self.stats.verify_time_s += result.forward_time_s
            self.stats.draft_critical_time_s += result.propose_time_s
            self.proposer.on_verified(list(result.rounds.values()))
        return outputs

    def _record_round(self, request: Request, round_: VerifiedRound) -> None:
        origin = round_.origin
        if self.rounds is not None and origin.informative:
            self.rounds.observe_round(request.seq.seq_id, round_.num_drafts, round_.num_accepted)
        for stats in (request.spec_stats, self.stats):
            stats.record_round(round_.num_drafts, round_.num_accepted, origin.copied)
            if origin.cache_hit is not None:
                stats.record_lookup(max(request.last_accepted, 0), origin.cache_hit, round_.num_accepted,
                                    origin.fallback)
        request.last_accepted = round_.num_accepted

    def _check_stop(self, request: Request, token: int) -> FinishReason | None:
        seq, params = request.seq, request.params
        if token in request.stop_token_ids:  # banned below min_tokens, so never seen early
            return FinishReason.STOP
        if seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _finish_or_report(self, request: Request, reason: FinishReason | None, now: float) -> RequestOutput:
        seq = request.seq
        new_text, stopped = request.detokenizer.update(self._visible_output(request, reason), reason is not None)
        if stopped and reason is None:
            reason = FinishReason.STOP
        if reason is not None:
            request.metrics.finished_time = now
            self.scheduler.finish(seq, reason)
            self._release(request)
        output = self._make_output(request, new_text)
        if reason is not None:
            del self.requests[seq.seq_id]
        return output

    def _visible_output(self, request: Request, reason: FinishReason | None) -> list[int]:
        """Output ids to detokenize: a stop token id is not part of the text (as in vLLM)."""
        ids = request.seq.output_token_ids
        if reason is FinishReason.STOP and ids and ids[-1] in request.stop_token_ids:
            return ids[:-1]
        return ids

    def _fail_request(self, request: Request, message: str) -> RequestOutput:
        logger.error("request %s failed: %s", request.request_id, message)
        request.seq.error = message
        self.scheduler.finish(request.seq, FinishReason.ERROR)
        self._release(request)
        output = self._make_output(request, "")
        output.error = message
        del self.requests[request.seq.seq_id]
        return output

    def _release(self, request: Request) -> None:
        if self.proposer is not None:
            self.proposer.release(request.seq)
        if self.rounds is not None:
            self.rounds.forget(request.seq.seq_id)

    def _make_output(self, request: Request, new_text: str) -> RequestOutput:
        seq = request.seq
        m = request.metrics
        m.num_output_tokens = seq.num_output_tokens
        m.num_cached_prompt_tokens = seq.num_cached_prompt_tokens
        m.num_preemptions = seq.num_preemptions
        new_ids = seq.output_token_ids[request.num_reported_tokens :]
        request.num_reported_tokens = seq.num_output_tokens
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=seq.prompt_token_ids,
            text=request.detokenizer.text,
            token_ids=list(seq.output_token_ids),
            finished=seq.is_finished,
            finish_reason=seq.finish_reason.value if seq.finish_reason is not None else None,
            new_token_ids=new_ids,
            new_text=new_text,
            logprobs=request.logprobs,
            metrics=m,
            spec_stats=request.spec_stats if self.spec is not None else None,
            speculation=request.speculation,
        )

    def shutdown(self) -> None:
        if getattr(self, "proposer", None) is not None:
            self.proposer.shutdown()
            self.proposer = None
        if getattr(self, "parallel", None) is not None:
            self.parallel.shutdown()
            self.parallel = None
        if getattr(self, "pinning", None) is not None:
            self.pinning.restore()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:  # interpreter teardown: nothing useful left to do
            pass
