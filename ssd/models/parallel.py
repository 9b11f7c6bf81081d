"""Tensor-parallel partitioning: which slice of each checkpoint tensor a rank holds, and the layers that
combine the slices (Megatron-style column/row pairs, vocabulary-parallel embedding and LM head).

Column-parallel projections (fused q/k/v and gate/up) keep the layer's input whole and split their output
rows by attention head or by intermediate channel, so attention and the SiLU gate run on local data. The
following row-parallel projection (o_proj, down_proj) splits its input columns the same way and sums the
partial outputs with one all-reduce per projection. With ``tp=None`` every layer here computes what its
single-device ``torch.nn`` counterpart computes; the projections' products go through the model's ``matmul``
(``F.linear``, the measured orientation of :mod:`ssd.models.small_gemm`, or packed float16 weights).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from ssd.distributed.comm import TensorParallelGroup


@dataclass(frozen=True)
class SourceSlice:
    """The part ``[start, stop)`` along ``dim`` of a checkpoint tensor that one rank loads."""

    dim: int
    start: int
    stop: int


def tp_rank_size(tp: "TensorParallelGroup | None") -> tuple[int, int]:
    return (0, 1) if tp is None else (tp.rank, tp.world_size)


@dataclass(frozen=True)
class HeadPartition:
    """Attention heads of one rank: query heads ``[q_start, q_start + num_q)`` and KV heads
    ``[kv_start, kv_start + num_kv)``. When there are fewer KV heads than ranks each KV head is replicated on
    the ``world / num_kv_heads`` ranks whose query heads use it."""

    q_start: int
    num_q: int
    kv_start: int
    num_kv: int


def partition_heads(num_heads: int, num_kv_heads: int, rank: int, world: int) -> HeadPartition:
    if num_heads % world:
        raise ValueError(f"num_attention_heads={num_heads} is not divisible by tensor_parallel_size={world}")
    num_q = num_heads // world
    if num_kv_heads % world == 0:
        num_kv = num_kv_heads // world
        return HeadPartition(rank * num_q, num_q, rank * num_kv, num_kv)
    if world % num_kv_heads == 0:
        return HeadPartition(rank * num_q, num_q, rank // (world // num_kv_heads), 1)
    raise ValueError(
        f"num_key_value_heads={num_kv_heads} and tensor_parallel_size={world}: one must divide the other"
    )


def partition_evenly(size: int, rank: int, world: int, what: str) -> slice:
    if size % world:
        raise ValueError(f"{what}={size} is not divisible by tensor_parallel_size={world}")
    part = size // world
    return slice(rank * part, (rank + 1) * part)


@dataclass(frozen=True)
class VocabPartition:
    """Vocabulary rows ``[start, stop)`` of one rank, stored in the first ``stop - start`` of ``local_size``
    rows; every rank holds ``ceil(V / world)`` rows so that gathered logits have equal-size parts."""

    start: int
    stop: int
    local_size: int


def partition_vocab(vocab_size: int, rank: int, world: int) -> VocabPartition:
    local = -(-vocab_size // world)
    start = min(rank * local, vocab_size)
    return VocabPartition(start, min(start + local, vocab_size), local)


LinearProduct = Callable[..., torch.Tensor]  # (x, weight, bias=None) -> x @ weight.T (+ bias), like F.linear


class RowParallelLinear(nn.Linear):
    """``y = x W^T (+ b)`` where this rank holds the input columns ``source`` of W; partial outputs are
    summed over ranks before the bias is added (once). ``matmul`` computes the product (``F.linear`` or a
    :class:`ssd.models.small_gemm.SmallRowMatmul`)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        source: slice,
        tp: "TensorParallelGroup | None",
        dtype: torch.dtype | None = None,
        matmul: LinearProduct = F.linear,
    ) -> None:
        super().__init__(in_features, out_features, bias=bias, dtype=dtype)
        self.source = source
        self.tp = tp
        self.matmul = matmul

    def checkpoint_slice(self, param_name: str) -> SourceSlice | None:
        if self.tp is None or param_name != "weight":
            return None
        return SourceSlice(1, self.source.start, self.source.stop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return self.matmul(x, self.weight, self.bias)
        out = self.tp.all_reduce(self.matmul(x, self.weight))  # [T, out] summed over ranks
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """Embedding (and, tied or not, LM-head weight) holding this rank's vocabulary rows; a token's row lives
    on exactly one rank, the others contribute zeros to the all-reduce, so the lookup is exact."""

    def __init__(
        self, vocab_size: int, hidden: int, tp: "TensorParallelGroup | None", dtype: torch.dtype | None = None
    ) -> None:
        rank, world = tp_rank_size(tp)
        self.partition = partition_vocab(vocab_size, rank, world)
        super().__init__(self.partition.local_size if tp is not None else vocab_size, hidden, dtype=dtype)
        self.full_vocab_size = vocab_size
        self.tp = tp

    def reset_parameters(self) -> None:
        """No random initialisation: models are built on the meta device and every weight is then loaded (or
        filled by the caller). ``nn.Embedding``'s ``normal_`` on a meta tensor would also import PyTorch's
        compiler stack, ~1.4 s of start-up."""

    def checkpoint_slice(self, param_name: str) -> SourceSlice | None:
        if self.tp is None:
            return None
        return SourceSlice(0, self.partition.start, self.partition.stop)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return super().forward(input_ids)
        part = self.partition
        local = (input_ids >= part.start) & (input_ids < part.stop)  # [T]
        rows = torch.where(local, input_ids - part.start, 0)  # [T]
        h = F.embedding(rows, self.weight) * local[:, None].to(self.weight.dtype)  # [T, hidden]
        return self.tp.all_reduce(h)


class VocabParallelHead(nn.Module):
    """Untied LM head split by vocabulary rows like :class:`VocabParallelEmbedding`."""

    def __init__(
        self, vocab_size: int, hidden: int, tp: "TensorParallelGroup | None", dtype: torch.dtype | None = None
    ) -> None:
        super().__init__()
        rank, world = tp_rank_size(tp)
        self.partition = partition_vocab(vocab_size, rank, world)
        rows = self.partition.local_size if tp is not None else vocab_size
        self.weight = nn.Parameter(torch.empty(rows, hidden, dtype=dtype))
        self.tp = tp

    def checkpoint_slice(self, param_name: str) -> SourceSlice | None:
        if self.tp is None:
            return None
        return SourceSlice(0, self.partition.start, self.partition.stop)


def parallel_logits(
    hidden: torch.Tensor, weight: torch.Tensor, vocab_size: int, tp: "TensorParallelGroup | None",
    matmul: LinearProduct = F.linear,
) -> torch.Tensor | None:
    """Float32 logits ``[N, V]`` from a (vocabulary-parallel) head weight; ``None`` on non-driver ranks.
    ``matmul(hidden, weight)`` computes ``hidden @ weight.T`` (see :mod:`ssd.models.small_gemm`)."""
    logits = matmul(hidden, weight).float()  # [N, V / tp] (all of V without tp)
    if tp is None:
        return logits
    gathered = tp.gather_last_dim(logits)  # [N, tp * ceil(V / tp)] on the driver
    return None if gathered is None else gathered[:, :vocab_size]
