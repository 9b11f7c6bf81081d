"""Shared pieces of the benchmark scripts: prompts, worker processes, timers, engine/HF runners, tables.

Why worker processes: every configuration (engine mode, thread count, CPU set, HF baseline) lives in its own
long-lived process, so its thread pool and CPU affinity are its own, its peak RSS (``ru_maxrss``) is clean,
and the parent can interleave configurations repeat by repeat (A, B, C, A, B, C, ...) without reloading
models. Idle workers block on a pipe and use no CPU while another one is measured. Ratios are computed per
repeat from measurements taken seconds apart, then summarised by their median, because this kind of machine
is noisy (shared cores, frequency changes) and absolute numbers drift over minutes.

Worker processes are started with the ``spawn`` method and are not daemonic (an SSD engine inside one
starts its own draft process), so every script must guard its entry point with ``if __name__ == "__main__":``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import multiprocessing as mp
import os
import platform
import resource
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from itertools import zip_longest
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

BENCH_DIR = Path(__file__).resolve().parent
RESULTS_DIR = BENCH_DIR / "results"

# Chat-style prompts: the first eight held-out evaluation prompts of the draft (train/eval_prompts.py, never
# used in its training), so benchmark numbers never reward memorised prompts; one list, kept there.
def load_eval_prompts():
    """The module ``train/eval_prompts.py`` (not a package: loaded from its file)."""
    spec = importlib.util.spec_from_file_location("eval_prompts", BENCH_DIR.parent / "train" / "eval_prompts.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CHAT_PROMPTS = load_eval_prompts().CHAT_EVAL[:8]


# ----------------------------------------------------------------------------------------------- basics
def available_cpus() -> list[int]:
    """CPUs this process may run on (respects taskset/cgroups), sorted."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def resolve_model(path: str | None) -> str:
    """The given checkpoint folder, or the project's default target (SmolLM2-135M-Instruct, fetched once)."""
    if path:
        if not Path(path).is_dir():
            raise SystemExit(f"model folder {path!r} does not exist")
        return str(Path(path).resolve())
    from ssd.models.fetch import fetch_default_target

    return str(fetch_default_target())


def chat_prompt_ids(model_path: str, num_prompts: int) -> list[list[int]]:
    """Token ids of the first ``num_prompts`` chat prompts (cycled), identical for every engine under test."""
    from ssd.tokenizer import Tokenizer

    tok = Tokenizer(model_path)
    ids = [tok.apply_chat_template([{"role": "user", "content": text}]) for text in CHAT_PROMPTS]
    return [list(ids[i % len(ids)]) for i in range(num_prompts)]


def parse_int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError as exc:
        raise SystemExit(f"expected a comma-separated list of integers, got {text!r}") from exc
    if not values or any(v < 1 for v in values):
        raise SystemExit(f"expected positive integers, got {text!r}")
    return values


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus_available": len(available_cpus()),
        "load_avg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        info["cpu_model"] = names[0] if names else None
    except OSError:
        info["cpu_model"] = None
    try:
        import torch
        import transformers

        info["torch"] = torch.__version__
        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    return info


def own_peak_rss_mib() -> float:
    """Peak resident memory of this process (Linux reports ru_maxrss in KiB)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 1024 if sys.platform != "darwin" else peak / 2**20


def proc_peak_rss_mib(pid: int | None) -> float | None:
    """Peak RSS (VmHWM) of a live process, e.g. an SSD draft worker; None when unreadable."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def proc_cpu_s(pid: int | None) -> float | None:
    """CPU seconds (user + system) a live process has used so far; None when unreadable."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def median(values: Sequence[float | None]) -> float | None:
    clean = [v for v in values if v is not None]
    return statistics.median(clean) if clean else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def print_table(headers: list[str], rows: list[list[Any]], title: str | None = None) -> None:
    cells = [[fmt(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    if title:
        print(f"\n{title}")
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths)))
    print("  ".join("-" * w for w in widths))
    for row in cells:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)))


def write_json(data: dict[str, Any], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2, default=_json_default) + "\n")
    return path


def _json_default(value: Any) -> Any:
    if hasattr(value, "to_dict"):
        return value.to_dict()
    if isinstance(value, (set, tuple)):
        return list(value)
    return str(value)


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


# ----------------------------------------------------------------------------------------------- workers
@dataclass
class WorkerSpec:
    """One configuration's process: which CPUs and threads it gets, and what object it builds there.

    ``factory`` must be a module-level function (spawn pickles it by name); it receives ``kwargs`` and
    returns an object whose public methods the parent calls through :meth:`Worker.call`.
    """

    name: str
    factory: Callable[..., Any]
    kwargs: dict[str, Any] = field(default_factory=dict)
    cpus: list[int] | None = None  # CPU affinity of the worker (None: inherit)
    threads: int | None = None  # torch intra-op threads (None: leave torch's default)


def _serve(conn, spec: WorkerSpec) -> None:
    logging.basicConfig(level=logging.WARNING, format=f"[{spec.name}] %(levelname)s %(name)s: %(message)s")
    try:
        if spec.cpus is not None and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, spec.cpus)
        import torch

        if spec.threads is not None:
            torch.set_num_threads(spec.threads)
        start = time.perf_counter()
        obj = spec.factory(**spec.kwargs)
        conn.send(("ok", {"load_s": time.perf_counter() - start, "pid": os.getpid()}))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    try:
        while True:
            msg = conn.recv()
            if msg is None:
                break
            method, kwargs = msg
            try:
                if method == "__rss__":
                    result: Any = own_peak_rss_mib()
                else:
                    result = getattr(obj, method)(**kwargs)
                conn.send(("ok", result))
            except BaseException:
                conn.send(("error", traceback.format_exc()))
    finally:
        close = getattr(obj, "close", None)
        if close is not None:
            close()


class WorkerError(RuntimeError):
    pass


def receive_reply(conn, who: str, timeout_s: float, context: Callable[[], str] = str) -> Any:
    """A worker's ``("ok", payload)`` reply, as the payload. ``WorkerError`` when it does not answer in time, dies,
    or answers ``("error", traceback)``; ``context()`` adds what the caller knows (an exit code, a log tail) to the
    first two."""
    if not conn.poll(timeout_s):
        raise WorkerError(f"{who} did not answer within {timeout_s:.0f} s{context()}")
    try:
        status, payload = conn.recv()
    except EOFError as exc:
        raise WorkerError(f"{who} died{context()}") from exc
    if status == "error":
        raise WorkerError(f"{who} failed:\n{payload}")
    return payload


class Worker:
    """Parent-side handle of one configuration's process."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe(duplex=True)
        self._process = ctx.Process(target=_serve, args=(child, spec), name=f"bench-{spec.name}", daemon=False)
        self._process.start()
        child.close()
        self.info: dict[str, Any] | None = None

    def wait_ready(self, timeout_s: float = 600.0) -> dict[str, Any]:
        self.info = self._receive(timeout_s)
        return self.info

    def call(self, method: str, timeout_s: float = 1800.0, **kwargs: Any) -> Any:
        self._conn.send((method, kwargs))
        return self._receive(timeout_s)

    def peak_rss_mib(self) -> float:
        return self.call("__rss__")

    def _receive(self, timeout_s: float) -> Any:
        def exit_code() -> str:
            code = self._process.exitcode
            return "" if code is None else f" (exit code {code})"

        return receive_reply(self._conn, f"worker {self.spec.name}", timeout_s, exit_code)

    def close(self) -> None:
        if self._process is None:
            return
        try:
            if self._process.is_alive():
                self._conn.send(None)
        except (OSError, BrokenPipeError):
            pass
        self._process.join(timeout=30)
        if self._process.is_alive():
            self._process.terminate()
            self._process.join(timeout=10)
        self._conn.close()
        self._process = None


def start_workers(specs: list[WorkerSpec]) -> dict[str, Worker]:
    """Start every worker, then wait for all (they load their models in parallel)."""
    workers: dict[str, Worker] = {}
    try:
        for spec in specs:
            workers[spec.name] = Worker(spec)
        for name, worker in workers.items():
            info = worker.wait_ready()
            print(f"  ready: {name:<22} load {info['load_s']:.1f} s (cpus {worker.spec.cpus}, threads {worker.spec.threads})",
                  flush=True)
    except BaseException:
        close_workers(workers)
        raise
    return workers


def close_workers(workers: dict[str, Worker]) -> None:
    for worker in workers.values():
        worker.close()


def rotated(items: list[Any], shift: int) -> list[Any]:
    """Repeat r visits configurations in a rotated order, so none is always first (or right after another)."""
    if not items:
        return items
    shift %= len(items)
    return items[shift:] + items[:shift]


# ----------------------------------------------------------------------------------------------- timers
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


# ----------------------------------------------------------------------------------------------- our engine
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


# ----------------------------------------------------------------------------------------------- transformers
class HFRunner:
    """``transformers`` baseline: ``AutoModelForCausalLM.generate`` (optionally assisted) on the same ids."""

    def __init__(
        self,
        model: str,
        assistant: str | None = None,
        num_assistant_tokens: int = 4,
        warmup_prompt: list[int] | None = None,
        warmup_batch: int = 1,
        dtype: str = "bfloat16",
    ) -> None:
        import torch
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        self.torch = torch
        torch_dtype = getattr(torch, dtype)
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=torch_dtype).eval()
        config = self.model.generation_config
        eos = config.eos_token_id
        self.pad_id = config.pad_token_id if config.pad_token_id is not None else (
            eos[0] if isinstance(eos, list) else (eos if eos is not None else 0)
        )
        self.assistant = None
        if assistant is not None:
            # A separate copy even when assistant == model: HF keeps separate caches, as our SD does.
            self.assistant = load_hf_assistant(assistant, torch_dtype)
            gc = self.assistant.generation_config
            gc.num_assistant_tokens = num_assistant_tokens  # same K as our engine ...
            gc.num_assistant_tokens_schedule = "constant"  # ... kept fixed (HF's default adapts it)
            gc.assistant_confidence_threshold = 0.0  # never stop drafting early on low confidence
        self._target_calls = 0
        self.model.register_forward_hook(self._count_target_call)
        if warmup_prompt is not None:
            self.generate([warmup_prompt] * warmup_batch, output_len=8, batch=warmup_batch)
            if self.assistant is not None:
                self.generate([warmup_prompt], output_len=8, batch=1, assisted=True)

    def _count_target_call(self, module, args, output) -> None:
        self._target_calls += 1

    def generate(self, prompts: list[list[int]], output_len: int, batch: int, assisted: bool = False,
                 temperature: float = 0.0, seed: int | None = None) -> dict[str, Any]:
        """Exactly ``output_len`` new tokens (EOS ignored via min_new_tokens), left padding for batches; greedy
        unless ``temperature`` > 0 (then sampled, torch seeded with ``seed + chunk index`` when a seed is given).

        A streamer timestamps every emission. As for our engine, decode throughput counts the tokens after
        the first emission (assisted decoding's first round already emits up to K+1) over the time after it.
        """
        torch = self.torch
        from transformers.generation.streamers import BaseStreamer

        if assisted and (self.assistant is None or batch != 1):
            raise ValueError("assisted generation needs an assistant model and batch 1")

        class Clock(BaseStreamer):
            def __init__(self) -> None:
                self.puts = 0
                self.first: tuple[float, int] | None = None  # (time, tokens per row) of the first emission

            def put(self, value) -> None:
                self.puts += 1
                if self.puts == 1:
                    return  # the prompt
                if self.first is None:
                    self.first = (time.perf_counter(), value.shape[-1] if value.dim() == 2 else 1)

            def end(self) -> None:
                pass

        tokens: list[list[int]] = []
        decode_s = 0.0
        decode_tokens = 0
        ttft: list[float] = []
        calls0 = self._target_calls
        cpu0 = time.process_time()
        wall_start = time.perf_counter()
        for i in range(0, len(prompts), batch):
            chunk = prompts[i : i + batch]
            width = max(len(p) for p in chunk)
            input_ids = torch.full((len(chunk), width), self.pad_id, dtype=torch.long)  # [B, L]
            mask = torch.zeros((len(chunk), width), dtype=torch.long)  # [B, L]
            for row, p in enumerate(chunk):
                input_ids[row, width - len(p) :] = torch.tensor(p, dtype=torch.long)
                mask[row, width - len(p) :] = 1
            clock = Clock()
            kwargs: dict[str, Any] = dict(
                attention_mask=mask,
                max_new_tokens=output_len,
                min_new_tokens=output_len,
                do_sample=temperature > 0,
                pad_token_id=self.pad_id,
                streamer=clock,
            )
            if temperature > 0:
                kwargs.update(temperature=temperature, top_k=0, top_p=1.0)
                if seed is not None:
                    torch.manual_seed(seed + i)
            if assisted:
                kwargs["assistant_model"] = self.assistant
            start = time.perf_counter()
            with torch.inference_mode():
                out = self.model.generate(input_ids, **kwargs)  # [B, L + N]
            end = time.perf_counter()
            new = out[:, width:].tolist()
            tokens.extend(new)
            if clock.first is not None:
                first_time, first_tokens = clock.first
                ttft.append(first_time - start)
                decode_s += end - first_time
                decode_tokens += sum(len(t) - first_tokens for t in new)
        wall_s = time.perf_counter() - wall_start
        cpu_s = time.process_time() - cpu0
        total = sum(len(t) for t in tokens)
        calls = self._target_calls - calls0
        result: dict[str, Any] = {
            "tokens": tokens,
            "decode_tokens": decode_tokens,
            "decode_s": decode_s,
            "decode_tok_s": decode_tokens / decode_s if decode_s > 0 else None,
            "wall_s": wall_s,
            "e2e_tok_s": total / wall_s,
            "ttft_s": median(ttft),
            "cpu_share": cpu_s / (wall_s * torch.get_num_threads()),
            "load_avg_1m": os.getloadavg()[0],
            "target_forward_calls": calls,
        }
        if assisted:
            # Every assisted round is one target forward over the candidates (the first one includes the
            # prompt), emitting accepted + 1 tokens: tokens per target call is HF's mean acceptance length.
            result["mean_acceptance_length"] = total / calls if calls else None
        return result


def load_hf_assistant(path: str, torch_dtype: Any) -> Any:
    """A ``transformers`` model for assisted generation from one of our draft folders.

    A draft with a reduced vocabulary (``draft_vocab.json``, ``ssd.models.draft_vocab``) embeds and predicts
    only a subset of the target's ids, and ``generate(assistant_model=...)`` rejects an assistant whose vocab
    size differs from the target's (it would then need two tokenizers and retokenise text). So the model is
    wrapped with two hooks that keep its own small head: target ids are mapped to draft ids before the
    embedding, and the [.., Vd] logits are scattered into [.., V_target] logits with every id the draft cannot
    produce at the dtype's minimum. Greedy drafts are then exactly our engine's (argmax over the subset);
    sampled drafts give those ids probability 0, as our engine's q does.
    """
    import torch
    from transformers import AutoModelForCausalLM

    from ssd.models.draft_vocab import DraftVocab

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype).eval()
    vocab = DraftVocab.load(path)
    if vocab is None:
        return model
    to_draft = torch.from_numpy(vocab.target_to_draft())  # [V_target]
    known = torch.from_numpy(vocab.draft_to_target >= 0)  # [Vd]
    columns = torch.from_numpy(vocab.draft_to_target[vocab.draft_to_target >= 0])  # [Vd - 1] target ids
    target_vocab = vocab.target_vocab_size

    def map_inputs(module, args):
        return (to_draft[args[0]],) + tuple(args[1:])  # [B, L] target ids -> draft ids

    def widen_logits(module, args, output):
        full = output.new_full((*output.shape[:-1], target_vocab), torch.finfo(output.dtype).min)  # [B, L, V]
        full[..., columns] = output[..., known]
        return full

    model.get_input_embeddings().register_forward_pre_hook(map_inputs)
    model.get_output_embeddings().register_forward_hook(widen_logits)
    model.config.get_text_config().vocab_size = target_vocab  # what generate() compares with the target's
    return model


def add_filler_padding_arg(p: argparse.ArgumentParser) -> None:
    from ssd.options import FillerPadding

    p.add_argument("--filler-padding", default="auto", choices=FillerPadding.values(),
                   help="SSD random fillers past prompt lookup's copies (as the engine: auto = none on CPU)")


def add_weight_format_args(p: argparse.ArgumentParser) -> None:
    from ssd.options import TARGET_WEIGHT_FORMATS, WeightFormat

    p.add_argument("--weight-format", default="auto", choices=[f.value for f in TARGET_WEIGHT_FORMATS],
                   help="the target's weights (as the engine: auto = fp16-packed when --dtype auto chose float32)")
    p.add_argument("--draft-weight-format", default="auto", choices=WeightFormat.values(),
                   help="the draft's weights (as the engine: auto = fp16-packed in float32 on CPU)")


def resolve_weight_formats(args: argparse.Namespace, requested_dtype: str) -> None:
    """Concrete ``args.weight_format`` / ``args.draft_weight_format`` for ``args.dtype`` (already resolved from
    ``requested_dtype``), as the engine resolves them, so that they are recorded with the results."""
    from ssd.models.weight_formats import resolve_weight_format

    args.weight_format = resolve_weight_format(args.weight_format, "cpu", args.dtype,
                                               explicit_dtype=requested_dtype != "auto")
    args.draft_weight_format = resolve_weight_format(args.draft_weight_format, "cpu", args.dtype, draft=True)
