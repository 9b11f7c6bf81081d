"""Tensor-parallel worker rank: join the group, load this rank's shard, run forwards until told to stop.

The loop mirrors the driver's :class:`~ssd.runtime.model_runner.ModelRunner`: every command the driver
broadcasts is one forward pass that all ranks run together (the collectives inside the model pair them up).
Workers own no scheduler or sampler state, so a worker is a pure function of the command stream.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ssd.distributed.comm import DistributedInit, TensorParallelGroup
from ssd.distributed.commands import ForwardCommand, ShutdownCommand
from ssd.options import Process, WeightFormat, options_for

if TYPE_CHECKING:
    from ssd.config import EngineConfig
    from ssd.runtime.model_runner import GraphOptions, ModelRunner

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RunnerArgs:
    """ModelRunner arguments shared by every rank (the driver's own runner uses the same values): the options
    ``EngineConfig`` marks as read by target ranks."""

    model: str
    dtype: str
    block_size: int
    max_model_len: int | None
    kv_cache_memory: int | None
    kv_cache_fraction: float
    max_num_seqs: int
    weight_format: WeightFormat = WeightFormat.DENSE  # resolved (ssd/resolve.py)
    fused_kernels: bool = True

    @classmethod
    def from_config(cls, config: "EngineConfig") -> "RunnerArgs":
        """From a resolved config (``ssd/resolve.py``)."""
        return cls(**options_for(config, Process.TARGET_RANK))


@dataclass(frozen=True)
class WorkerArgs:
    runner: RunnerArgs
    init: DistributedInit
    device: str
    num_threads: int | None = None
    cpus: list[int] | None = None
    log_level: int = logging.WARNING


def place_process(device: str, num_threads: int | None, cpus: list[int] | None) -> None:
    """Pin this process to its cores and thread count, or select its GPU."""
    if cpus is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cpus)
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))


def build_runner(
    args: RunnerArgs, device: str, tp: TensorParallelGroup | None, graphs: "GraphOptions | None" = None
) -> "ModelRunner":
    from ssd.runtime.model_runner import ModelRunner  # the runner imports this package: import late

    return ModelRunner(
        args.model,
        args.dtype,
        device,
        args.block_size,
        args.max_model_len,
        args.kv_cache_memory,
        args.kv_cache_fraction,
        max_num_seqs=args.max_num_seqs,
        tp=tp,
        graphs=graphs,
        weight_format=args.weight_format,
        fused_kernels=args.fused_kernels,
    )


def run_worker(args: WorkerArgs) -> None:
    """Entry point of a worker rank (a spawned process, or a non-zero ``torchrun`` rank)."""
    logging.basicConfig(level=args.log_level, format=f"%(asctime)s tp-rank{args.init.rank} %(name)s: %(message)s")
    place_process(args.device, args.num_threads, args.cpus)
    group = TensorParallelGroup(args.init)
    try:
        runner = build_runner(args.runner, args.device, group)
        serve(runner, group)
    finally:
        group.destroy()


def serve(runner: "ModelRunner", group: TensorParallelGroup) -> None:
    """Execute the driver's commands until :class:`ShutdownCommand` (or until the driver disappears)."""
    while True:
        command = group.broadcast_object()
        if isinstance(command, ShutdownCommand):
            logger.debug("rank %d: shutdown", group.rank)
            return
        if not isinstance(command, ForwardCommand):
            raise TypeError(f"tensor-parallel worker got an unknown command {type(command).__name__}")
        runner.forward(command.items, eager=command.eager)
