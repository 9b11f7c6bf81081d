"""Where each process of an engine runs: tensor-parallel target ranks and the SSD draft process.

One function decides the placement so that the launcher, the SSD factory and the documentation agree. On
CPU every rank gets its own cores (torch threads on shared cores fight over OpenMP barriers), and an SSD
draft on CPU is given the last cores first. On CUDA, rank ``r`` of a single-host launch uses the ``r``-th
GPU counted from the configured device (``cuda:1`` + TP 2 -> ``cuda:1``, ``cuda:2``); under ``torchrun``
it uses ``LOCAL_RANK``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class ProcessLayout:
    rank_devices: list[str]  # per target rank
    rank_cpus: list[list[int] | None]  # per target rank; None = leave the affinity alone
    rank_threads: list[int | None]  # torch intra-op threads per target rank; None = leave torch's default
    draft_cpus: list[int] | None  # cores of an SSD draft process on CPU; None = share the target's


class ProcessPinning:
    """Process-wide record of CPU pinning by engines: the affinity and thread count this process had before the
    first live engine pinned it, and how many live engines hold a pin. A second engine in the same process must
    plan from those cores, not from the first engine's target cores (it would put its draft on them)."""

    holders = 0
    original: tuple[set[int], int] | None = None  # (affinity, torch threads) before the first pin


def available_cpus() -> list[int]:
    """The cores this process may use: its affinity before any live engine pinned it, else the current one."""
    if ProcessPinning.original is not None:
        return sorted(ProcessPinning.original[0])
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


def plan_layout(
    device: str,
    tensor_parallel_size: int,
    num_threads: int | None = None,
    draft_on_cpu: bool = False,
    draft_threads: int | None = None,
    cpus: list[int] | None = None,
) -> ProcessLayout:
    cpus = available_cpus() if cpus is None else sorted(cpus)
    draft_cpus = None
    if draft_on_cpu:
        n_draft = draft_threads or 1
        if len(cpus) > n_draft:
            cpus, draft_cpus = cpus[:-n_draft], cpus[-n_draft:]
    tp = tensor_parallel_size
    if device.startswith("cuda"):
        first = int(device.split(":", 1)[1]) if ":" in device else 0
        devices = [f"cuda:{first + r}" for r in range(tp)]
    else:
        devices = [device] * tp
    if tp == 1:
        # A single rank keeps every remaining core; it is pinned only when a draft process took some.
        return ProcessLayout(devices, [cpus if draft_cpus else None], [num_threads], draft_cpus)
    per_rank = num_threads or max(1, len(cpus) // tp)
    if per_rank * tp <= len(cpus):
        rank_cpus: list[list[int] | None] = [cpus[r * per_rank : (r + 1) * per_rank] for r in range(tp)]
    else:
        rank_cpus = [None] * tp  # oversubscribed: let the OS schedule
    return ProcessLayout(devices, rank_cpus, [per_rank] * tp, draft_cpus)


def torchrun_rank() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) when launched by ``torchrun`` (or any launcher setting its variables)."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return rank, world, int(os.environ.get("LOCAL_RANK", rank))
