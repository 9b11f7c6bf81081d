"""Where an engine's work runs: the process layout of a config, CPU pinning of the driver process, and the
target's runner together with the tensor-parallel ranks it drives.

:class:`ssd.engine.LLMEngine` calls these once at start-up; the CLI's ``torchrun`` worker path calls
:func:`plan_engine_layout` so that every rank derives the same layout from the same config.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from ssd.config import EngineConfig
from ssd.distributed.launcher import TensorParallelRanks
from ssd.distributed.layout import ProcessLayout, ProcessPinning, plan_layout
from ssd.distributed.worker import RunnerArgs, build_runner
from ssd.runtime.model_runner import GraphOptions, ModelRunner


def plan_engine_layout(config: EngineConfig) -> ProcessLayout:
    """Cores/devices of the target ranks and of an SSD draft process on CPU."""
    spec = config.speculative_config
    draft_on_cpu = (spec is not None and spec.method == "ssd" and not spec.remote
                    and (spec.draft_device or config.device) == "cpu")
    return plan_layout(
        config.device,
        config.tensor_parallel_size,
        config.num_threads,
        draft_on_cpu=draft_on_cpu,
        draft_threads=spec.draft_threads if spec is not None else None,
    )


class CpuPinning:
    """Keeps this process on a set of cores with a thread count, so that other ranks and an SSD draft process
    get the remaining cores. Engines in one process share :class:`ProcessPinning`: the affinity and thread
    count found before the first of them pinned are put back when the last one still pinned restores."""

    def __init__(self) -> None:
        self._pinned = False

    def pin(self, cpus: list[int], num_threads: int) -> None:
        if not self._pinned:
            if ProcessPinning.holders == 0:
                ProcessPinning.original = (os.sched_getaffinity(0), torch.get_num_threads())
            ProcessPinning.holders += 1
            self._pinned = True
        os.sched_setaffinity(0, cpus)
        torch.set_num_threads(num_threads)

    def restore(self) -> None:
        if not self._pinned:
            return
        self._pinned = False
        ProcessPinning.holders -= 1
        if ProcessPinning.holders == 0 and ProcessPinning.original is not None:
            affinity, threads = ProcessPinning.original
            ProcessPinning.original = None
            os.sched_setaffinity(0, affinity)
            torch.set_num_threads(threads)


@dataclass
class TargetRunner:
    """The driver's runner and, with tensor parallelism, the worker ranks it broadcasts each step to."""

    runner: ModelRunner
    parallel: TensorParallelRanks | None


def start_target_runner(config: EngineConfig, layout: ProcessLayout, device: str) -> TargetRunner:
    """Start the worker ranks (TP > 1) and build the driver's runner; a failure stops the ranks it started."""
    args = RunnerArgs.from_config(config)
    parallel = None
    if config.tensor_parallel_size > 1:
        parallel = TensorParallelRanks.start(args, layout, config.distributed_timeout_s, logging.getLogger().level)
    graphs = None
    if not config.enforce_eager:
        spec = config.speculative_config
        max_query_len = spec.num_speculative_tokens + 1 if spec is not None else 1
        graphs = GraphOptions(max_query_len=max_query_len, compile=config.compile_model)
    try:
        runner = build_runner(args, device, parallel.group if parallel else None, graphs)
    except BaseException:
        if parallel is not None:
            parallel.shutdown()
        raise
    return TargetRunner(runner, parallel)
