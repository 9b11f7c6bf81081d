"""The tensor-parallel process group: the only code that calls ``torch.distributed`` collectives.

Two groups span the same ranks. The *device* group (NCCL on CUDA, gloo on CPU) carries activations: the
all-reduce after row-parallel layers and the gather of vocabulary-parallel logits. The *control* group is
always gloo, so the driver can broadcast step inputs (small Python objects) whatever the device backend.
Model code only sees :class:`TensorParallelGroup`; with ``tensor_parallel_size == 1`` no group exists and
layers take their single-device path.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# Workers wait on the control group for the driver's next command however long the engine idles; a
# collective on the device group that exceeds ``DistributedInit.timeout_s`` means a rank is stuck.
_CONTROL_TIMEOUT = datetime.timedelta(days=3650)


class TensorParallelError(RuntimeError):
    """A rank died or a collective failed; the engine cannot continue with this group."""


@dataclass(frozen=True)
class DistributedInit:
    """How one rank joins the group: ``init_method`` is ``tcp://host:port`` (single-host launcher) or
    ``env://`` (torchrun: MASTER_ADDR / MASTER_PORT from the environment)."""

    init_method: str
    rank: int
    world_size: int
    backend: str  # "gloo" (CPU) or "nccl" (CUDA)
    timeout_s: float = 300.0


class TensorParallelGroup:
    """This rank's view of the tensor-parallel group; rank 0 is the driver (scheduler, sampler, API)."""

    def __init__(self, init: DistributedInit) -> None:
        if not dist.is_available():
            raise RuntimeError("tensor parallelism needs torch.distributed, which this torch build lacks")
        timeout = datetime.timedelta(seconds=init.timeout_s)
        dist.init_process_group(
            backend=init.backend,
            init_method=init.init_method,
            rank=init.rank,
            world_size=init.world_size,
            timeout=timeout,
        )
        self.rank = init.rank
        self.world_size = init.world_size
        self.backend = init.backend
        self._control = dist.new_group(backend="gloo", timeout=_CONTROL_TIMEOUT)
        # Set by the launcher: says which worker process died, for error messages.
        self.health_check: Callable[[], str | None] = lambda: None
        logger.debug("rank %d/%d joined the tensor-parallel group (%s)", self.rank, self.world_size, self.backend)

    @property
    def is_driver(self) -> bool:
        return self.rank == 0

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over ranks in place (the partial outputs of a row-parallel layer)."""
        dist.all_reduce(tensor)
        return tensor

    def gather_last_dim(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """Concatenate every rank's ``[N, V/tp]`` slice along the last dimension, on the driver only
        (``None`` elsewhere): the vocabulary-parallel LM head's logits are sampled by the driver alone."""
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)] if self.is_driver else None
        dist.gather(tensor, parts, dst=0)
        return torch.cat(parts, dim=-1) if parts is not None else None

    def broadcast_object(self, obj: Any = None) -> Any:
        """Send a picklable object from the driver to every rank; returns it on every rank."""
        box = [obj if self.is_driver else None]
        dist.broadcast_object_list(box, src=0, group=self._control)
        return box[0]

    def check_health(self) -> None:
        """Raise before a collective that could only hang or fail: a worker process is known to be dead."""
        dead = self.health_check()
        if dead:
            raise TensorParallelError(f"tensor-parallel step refused on rank {self.rank}: {dead}")

    def failure_error(self, err: BaseException) -> TensorParallelError:
        """The error to raise when a collective failed: names dead ranks when the launcher knows them."""
        dead = self.health_check()
        detail = f"{dead}; " if dead else ""
        return TensorParallelError(f"tensor-parallel step failed on rank {self.rank}: {detail}{err}")

    def destroy(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
