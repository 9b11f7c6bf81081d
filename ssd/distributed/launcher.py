"""Start (or join) the tensor-parallel group from the driver process and tear it down again.

Single host: the driver spawns ranks ``1 .. tp-1`` as child processes and all ranks rendezvous through a
file store in a private temporary directory, so no port is chosen, reserved or hard-coded. Multi-node: run
the same program under ``torchrun``; rank 0 becomes the driver and joins through ``env://`` (MASTER_ADDR /
MASTER_PORT chosen by the operator), and every other rank calls :func:`run_worker_from_env`.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import shutil
import tempfile
import threading
from dataclasses import replace

from ssd.distributed.comm import DistributedInit, TensorParallelGroup
from ssd.distributed.commands import ShutdownCommand
from ssd.distributed.layout import ProcessLayout, torchrun_rank
from ssd.distributed.worker import RunnerArgs, WorkerArgs, run_worker

logger = logging.getLogger(__name__)

_JOIN_TIMEOUT_S = 10.0


def backend_for(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


class TensorParallelRanks:
    """The driver's handle on the group: its own membership plus the worker processes it started."""

    def __init__(self, group: TensorParallelGroup, processes: list[mp.process.BaseProcess], store_dir: str | None):
        self.group = group
        self.processes = processes
        self._store_dir = store_dir
        self._closed = False

    @classmethod
    def start(
        cls,
        runner: RunnerArgs,
        layout: ProcessLayout,
        timeout_s: float,
        log_level: int = logging.WARNING,
    ) -> "TensorParallelRanks":
        world = len(layout.rank_devices)
        backend = backend_for(layout.rank_devices[0])
        launched = torchrun_rank()
        if launched is not None:
            rank, launched_world, _ = launched
            if launched_world != world:
                raise ValueError(
                    f"torchrun started {launched_world} processes but tensor_parallel_size={world}; they must match"
                )
            if rank != 0:
                raise RuntimeError(
                    f"rank {rank} tried to start an engine; under torchrun only rank 0 runs the engine and the "
                    "others must call ssd.distributed.run_worker_from_env (the `ssd` CLI does this itself)"
                )
            group = TensorParallelGroup(DistributedInit("env://", 0, world, backend, timeout_s))
            return cls(group, [], None)

        store_dir = tempfile.mkdtemp(prefix="ssd-tp-")
        init = DistributedInit(f"file://{store_dir}/store", 0, world, backend, timeout_s)
        context = mp.get_context("spawn")
        processes = []
        try:
            for rank in range(1, world):
                args = WorkerArgs(
                    runner=runner,
                    init=replace(init, rank=rank),
                    device=layout.rank_devices[rank],
                    num_threads=layout.rank_threads[rank],
                    cpus=layout.rank_cpus[rank],
                    log_level=log_level,
                )
                process = context.Process(target=run_worker, args=(args,), name=f"ssd-tp-rank{rank}", daemon=True)
                process.start()
                processes.append(process)
            logger.info("started %d tensor-parallel worker rank(s): pids %s", len(processes), [p.pid for p in processes])
            group = TensorParallelGroup(init)
        except BaseException:
            _stop_processes(processes, grace_s=0.0)
            shutil.rmtree(store_dir, ignore_errors=True)
            raise
        ranks = cls(group, processes, store_dir)
        group.health_check = ranks.failure
        return ranks

    def failure(self) -> str | None:
        """A description of dead worker ranks, or ``None`` while all are alive."""
        dead = [f"rank {i + 1} (pid {p.pid}, exit code {p.exitcode})" for i, p in enumerate(self.processes) if not p.is_alive()]
        return "tensor-parallel worker " + ", ".join(dead) + " died" if dead else None

    def shutdown(self) -> None:
        """Stop the workers (politely, then by force) and leave the group; safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if self.failure() is None:
            self._tell_workers_to_stop()
        _stop_processes(self.processes, grace_s=_JOIN_TIMEOUT_S)
        self.group.destroy()
        if self._store_dir is not None:
            shutil.rmtree(self._store_dir, ignore_errors=True)


    def _tell_workers_to_stop(self) -> None:
        """Broadcast the shutdown command, but never wait on a wedged rank longer than the join grace:
        the broadcast runs in a daemon thread and the processes are stopped by force after it."""

        def send() -> None:
            try:
                self.group.broadcast_object(ShutdownCommand())
            except Exception as err:  # a rank already gone: the forced stop follows
                logger.warning("could not tell tensor-parallel workers to stop: %s", err)

        sender = threading.Thread(target=send, name="ssd-tp-shutdown", daemon=True)
        sender.start()
        sender.join(_JOIN_TIMEOUT_S)


def _stop_processes(processes: list[mp.process.BaseProcess], grace_s: float) -> None:
    for process in processes:
        process.join(grace_s)
        if process.is_alive():
            process.terminate()
            process.join(_JOIN_TIMEOUT_S)
        if process.is_alive():
            process.kill()
            process.join()


def run_worker_from_env(runner: RunnerArgs, layout: ProcessLayout, timeout_s: float, log_level: int) -> None:
    """Body of a non-zero ``torchrun`` rank: serve the driver's forwards until it shuts the engine down."""
    launched = torchrun_rank()
    if launched is None:
        raise RuntimeError("run_worker_from_env needs torchrun's RANK / WORLD_SIZE environment variables")
    rank, world, local_rank = launched
    device = layout.rank_devices[0]
    if device.startswith("cuda"):
        device = f"cuda:{local_rank}"
    init = DistributedInit("env://", rank, world, backend_for(device), timeout_s)
    run_worker(WorkerArgs(runner=runner, init=init, device=device, log_level=log_level))
