"""Benchmark configurations in worker processes of their own.

Why worker processes: every configuration (engine mode, thread count, CPU set, HF baseline) lives in its own
long-lived process, so its thread pool and CPU affinity are its own, its peak RSS (``ru_maxrss``) is clean,
and the parent can interleave configurations repeat by repeat (A, B, C, A, B, C, ...) without reloading
models. Idle workers block on a pipe and use no CPU while another one is measured. Ratios are computed per
repeat from measurements taken seconds apart, then summarised by their median, because this kind of machine
is noisy (shared cores, frequency changes) and absolute numbers drift over minutes.

Worker processes are started with the ``spawn`` method and are not daemonic (an SSD engine inside one
starts its own draft process), so every script must guard its entry point with ``if __name__ == "__main__":``."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from machine import own_peak_rss_mib


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
