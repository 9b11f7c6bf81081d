"""Our engine inside a benchmark worker: :class:`EngineRunner` (generation with per-phase timings and speculative
counters), :class:`CallTimer` (wall time of a wrapped method), and the speculative-counter helpers."""

from __future__ import annotations

import os
import statistics
import time
from itertools import zip_longest
from typing import Any

from machine import available_cpus, proc_cpu_s, proc_peak_rss_mib
from report import median


class CallTimer:
    """Wraps a bound method on one instance and accumulates its wall time; the library stays untouched."""

    def __init__(self, owner: Any, name: str) -> None:
        self.owner = owner
        self.name = name
        self.inner = getattr(owner, name)
        self._was_own = name in vars(owner)  # module globals yes; bound methods of instances no
        self.total_s = 0.0
        self.calls = 0
        self.samples: list[float] = []
        self.cpu_samples: list[float] = []  # process CPU seconds of the same calls (descheduling shows here)
        self.keep_samples = False

        def timed(*args, **kwargs):
            cpu = time.process_time()
            start = time.perf_counter()
            try:
                return self.inner(*args, **kwargs)
            finally:
                elapsed = time.perf_counter() - start
                self.total_s += elapsed
                self.calls += 1
                if self.keep_samples:
                    self.samples.append(elapsed)
                    self.cpu_samples.append(time.process_time() - cpu)

        setattr(owner, name, timed)

    def reset(self, keep_samples: bool = False) -> None:
        self.total_s = 0.0
        self.calls = 0
        self.samples = []
        self.cpu_samples = []
        self.keep_samples = keep_samples

    def snapshot(self) -> tuple[float, int]:
        return self.total_s, self.calls

    def restore(self) -> None:
        if self._was_own:
            setattr(self.owner, self.name, self.inner)
        else:
            delattr(self.owner, self.name)


ACCEPT_HIST_PREFIX = "accepted_"  # spec-counter keys "accepted_<k>": rounds that accepted exactly k drafts
LOOKUPS_PREFIX, HITS_PREFIX = "lookups_k", "hits_k"  # "lookups_k<k>" / "hits_k<k>": SSD lookups / hits at k


def per_k(spec: dict[str, float], prefix: str) -> list[int]:
    """The counters ``<prefix><k>`` of a run's spec-counter deltas as a list indexed by k."""
    counts = {int(key[len(prefix):]): int(v) for key, v in spec.items() if key.startswith(prefix)}
    return [counts.get(k, 0) for k in range(max(counts) + 1)] if counts else []


def acceptance_histogram(spec: dict[str, float]) -> list[int]:
    """Rounds per number of accepted drafts (index k) from a run's spec-counter deltas."""
    return per_k(spec, ACCEPT_HIST_PREFIX)


def summed_per_k(runs_spec: list[dict[str, float]], prefix: str) -> list[int]:
    """:func:`per_k` summed over runs (lists of different lengths padded with zeros)."""
    return [sum(col) for col in zip_longest(*(per_k(s, prefix) for s in runs_spec), fillvalue=0)]


def hit_rate_per_k(runs_spec: list[dict[str, float]]) -> list[float | None]:
    """SSD cache hits per lookup at each acceptance length k of the previous round, over runs (None: no lookup)."""
    lookups = summed_per_k(runs_spec, LOOKUPS_PREFIX)
    hits = summed_per_k(runs_spec, HITS_PREFIX) + [0] * len(lookups)  # no hits at the deepest k: shorter
    return [h / n if n else None for h, n in zip(hits, lookups)]


SPEC_COUNTERS = (
    "num_drafts",
    "num_draft_tokens",
    "num_accepted_tokens",
    "num_emitted_tokens",
    "cache_lookups",
    "cache_hits",
    "rounds_on_hit",
    "rounds_on_miss",
    "draft_build_branches",
    "draft_builds",
    "draft_builds_cut_short",
)


class EngineRunner:
    """Our engine in a worker process, with timers on the target forward and on the proposer."""

    def __init__(
        self,
        model: str,
        threads: int,
        kv_cache_memory: str,
        max_model_len: int | None = None,
        speculative_config: dict[str, Any] | None = None,
        warmup_prompt: list[int] | None = None,
        warmup_batch: int = 1,
        dtype: str = "bfloat16",
        weight_format: str = "dense",
    ) -> None:
        from ssd import LLM

        kwargs: dict[str, Any] = dict(dtype=dtype, weight_format=weight_format, kv_cache_memory=kv_cache_memory,
                                      num_threads=threads)
        if max_model_len is not None:
            kwargs["max_model_len"] = max_model_len
        self.threads = threads
        self.llm = LLM(model=model, speculative_config=speculative_config, **kwargs)
        self.engine = self.llm.engine
        self.runner = self.engine.runner
        self.forward_timer = CallTimer(self.runner, "forward")
        proposer = getattr(self.engine, "proposer", None)
        self.propose_timer = CallTimer(proposer, "propose") if proposer is not None else None
        if warmup_prompt is not None:
            self.generate([warmup_prompt] * warmup_batch, output_len=8, batch=warmup_batch)

    def describe(self) -> dict[str, Any]:
        """Where this engine actually runs (after SSD pinned the target), and the draft's pid."""
        import torch

        proposer = getattr(self.engine, "proposer", None)
        draft_cpus = None
        config = getattr(proposer, "config", None)
        if config is not None:
            draft_cpus = getattr(config, "cpu_affinity", None)
        return {
            "target_cpus": available_cpus(),
            "target_threads": torch.get_num_threads(),
            "draft_cpus": draft_cpus,
            "draft_pid": getattr(proposer, "pid", None),
        }

    def _spec_snapshot(self) -> dict[str, float]:
        stats = self.llm.stats
        snap = {name: float(getattr(stats, name, 0) or 0) for name in SPEC_COUNTERS}
        # Timings the engine keeps (copied from the SSD proposer where it owns them); our own timers on
        # runner.forward and proposer.propose measure the same things independently.
        pstats = getattr(getattr(self.engine, "proposer", None), "stats", None)
        for name in ("draft_build_time_s", "verify_time_s", "draft_critical_time_s"):
            value = float(getattr(stats, name, 0.0) or 0.0)
            snap[name] = value or float(getattr(pstats, name, 0.0) or 0.0)
        fallbacks = getattr(stats, "fallbacks", {}) or {}
        for key, value in fallbacks.items():
            snap[f"fallback_{key}"] = float(value)
        # rounds that accepted exactly k drafts (acceptance length k + 1), for histograms
        for prefix, name in ((ACCEPT_HIST_PREFIX, "acceptance_histogram"), (LOOKUPS_PREFIX, "cache_lookups_per_k"),
                             (HITS_PREFIX, "cache_hits_per_k")):
            for k, value in enumerate(getattr(stats, name, None) or []):
                snap[f"{prefix}{k}"] = float(value)
        return snap

    def generate(self, prompts: list[list[int]], output_len: int, batch: int, temperature: float = 0.0,
                 seed: int | None = None) -> dict[str, Any]:
        """Generation of ``output_len`` tokens per prompt, ``batch`` prompts at a time (greedy by default;
        ``temperature`` > 0 samples, prompt i with seed ``seed + i`` when a seed is given).

        Uses ``llm.stream`` (the same step loop as ``llm.generate``) to see when each request's first tokens
        arrive. Decode throughput counts only the tokens emitted after a request's first step, over the time
        after that step: with speculation the first step (prefill + a verification) already emits up to K+1
        tokens, so "(n - 1) / (finished - first token)" would overstate SD/SSD.
        """
        from ssd import SamplingParams

        def params_for(index: int) -> SamplingParams:
            return SamplingParams(max_tokens=output_len, temperature=temperature, ignore_eos=True,
                                  seed=None if seed is None or temperature == 0 else seed + index)

        before = self._spec_snapshot()
        prop0, prop_calls0 = self.propose_timer.snapshot() if self.propose_timer else (0.0, 0)
        tokens: list[list[int]] = []
        decode_s = 0.0
        decode_tokens = 0
        fwd_total, fwd_calls = 0.0, 0
        ttft: list[float] = []
        first_step_tokens: list[int] = []
        decode_forward: list[float] = []
        decode_forward_cpu: list[float] = []
        draft_pid = getattr(getattr(self.engine, "proposer", None), "pid", None)
        draft_cpu0 = proc_cpu_s(draft_pid)
        cpu0 = time.process_time()
        wall_start = time.perf_counter()
        for i in range(0, len(prompts), batch):
            chunk = prompts[i : i + batch]
            self.forward_timer.reset(keep_samples=True)
            start = time.perf_counter()
            first: dict[str, tuple[float, int]] = {}  # request id -> (time, tokens) of its first output
            final: dict[str, tuple[float, list[int]]] = {}
            params = [params_for(i + j) for j in range(len(chunk))]
            for out in self.llm.stream(chunk, params):
                now = time.perf_counter()
                if out.request_id not in first and out.token_ids:
                    first[out.request_id] = (now, len(out.token_ids))
                if out.finished:
                    final[out.request_id] = (now, list(out.token_ids))
            self.forward_timer.keep_samples = False
            decode_forward.extend(self.forward_timer.samples[1:])  # the first forward holds the prompts' prefill
            decode_forward_cpu.extend(self.forward_timer.cpu_samples[1:])
            fwd_total += self.forward_timer.total_s
            fwd_calls += self.forward_timer.calls
            ids = sorted(final, key=int)  # request ids count up in submission order
            decode_s += max(final[r][0] for r in ids) - min(first[r][0] for r in ids)
            decode_tokens += sum(len(final[r][1]) - first[r][1] for r in ids)
            ttft.extend(first[r][0] - start for r in ids)
            first_step_tokens.extend(first[r][1] for r in ids)
            tokens.extend(final[r][1] for r in ids)
        wall_s = time.perf_counter() - wall_start
        cpu_s = time.process_time() - cpu0
        draft_cpu1 = proc_cpu_s(draft_pid)
        after = self._spec_snapshot()
        spec = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
        prop1, prop_calls1 = self.propose_timer.snapshot() if self.propose_timer else (0.0, 0)
        total_tokens = sum(len(t) for t in tokens)
        return {
            "tokens": tokens,
            "decode_tokens": decode_tokens,
            "decode_s": decode_s,
            "decode_tok_s": decode_tokens / decode_s if decode_s > 0 else None,
            "wall_s": wall_s,
            "e2e_tok_s": total_tokens / wall_s,
            "ttft_s": median(ttft),
            "first_step_tokens": median(first_step_tokens),
            # CPU time / (wall time x threads): well below 1 means other processes took our cores
            "cpu_share": cpu_s / (wall_s * self.threads),
            "draft_cpu_share": (draft_cpu1 - draft_cpu0) / wall_s
            if draft_cpu0 is not None and draft_cpu1 is not None else None,
            "load_avg_1m": os.getloadavg()[0],
            "target_forward_s": fwd_total,
            "target_forward_calls": fwd_calls,
            "decode_forward_s": sum(decode_forward),  # target forwards after the prefill: decode or verify steps
            "decode_forward_calls": len(decode_forward),
            "decode_forward_cpu_s": sum(decode_forward_cpu),
            "propose_s": prop1 - prop0,
            "propose_calls": prop_calls1 - prop_calls0,
            "spec": spec,
        }

    def step_overhead(self, prompt: list[int], num_steps: int) -> dict[str, Any]:
        """Time ``engine.step()`` against the target forward inside it, for ``num_steps`` batch-1 decode steps.

        Also splits the forward into the model call, the logits projection and the rest (input tensors,
        slot mapping, attention metadata), so a ratio above target says which part to look at.
        """
        from ssd import SamplingParams
        from ssd.runtime import model_runner as mr

        model = self.runner.model
        model_timer = CallTimer(model, "forward")
        logits_timer = CallTimer(model, "compute_logits")
        meta_timer = CallTimer(mr, "build_attention_metadata")
        try:
            engine = self.engine
            params = SamplingParams(max_tokens=num_steps + 4, temperature=0.0, ignore_eos=True)
            request = engine.add_request(list(prompt), params)
            while engine.has_unfinished() and request.seq.num_output_tokens == 0:
                engine.step()  # prefill (and the first token)
            for timer in (self.forward_timer, model_timer, logits_timer, meta_timer):
                timer.reset(keep_samples=True)
            steps: list[float] = []
            for _ in range(num_steps):
                start = time.perf_counter()
                engine.step()
                steps.append(time.perf_counter() - start)
            forwards = list(self.forward_timer.samples)
            model_calls = list(model_timer.samples)
            logits = list(logits_timer.samples)
            metas = list(meta_timer.samples)
            engine.abort(request.request_id)
            while engine.has_unfinished():
                engine.step()
        finally:
            for timer in (model_timer, logits_timer, meta_timer):
                timer.restore()
            self.forward_timer.reset()
        n = len(steps)
        step_ms = 1e3 * sum(steps) / n
        fwd_ms = 1e3 * sum(forwards) / max(len(forwards), 1)
        model_ms = 1e3 * sum(model_calls) / max(len(model_calls), 1)
        logits_ms = 1e3 * sum(logits) / max(len(logits), 1)
        meta_ms = 1e3 * sum(metas) / max(len(metas), 1)
        return {
            "num_steps": n,
            "step_ms": step_ms,
            "forward_ms": fwd_ms,
            "model_ms": model_ms,  # transformer layers (runner.model.forward)
            "logits_ms": logits_ms,  # runner.model.compute_logits
            "attention_metadata_ms": meta_ms,  # build_attention_metadata
            "forward_other_ms": fwd_ms - model_ms - logits_ms - meta_ms,
            "step_outside_forward_ms": step_ms - fwd_ms,
            "step_over_forward": step_ms / fwd_ms if fwd_ms > 0 else None,
            "step_median_ms": 1e3 * statistics.median(steps),
            "forward_median_ms": 1e3 * statistics.median(forwards) if forwards else None,
        }

    def draft_peak_rss_mib(self) -> float | None:
        return proc_peak_rss_mib(getattr(getattr(self.engine, "proposer", None), "pid", None))

    def close(self) -> None:
        self.llm.shutdown()
