"""Fixed-shape step inputs for CUDA graphs: bucket choice, padding, and one persistent staging buffer.

A CUDA graph replays kernels with the shapes and addresses it was captured with. Decode, K+1 verification
and SSD tree steps differ only in sizes, so each step is padded to a bucket ``(B, Q, L)`` (sequences, query
rows per sequence, key slots per sequence) and written into buffers that never move:

- every sequence gets exactly ``Q`` rows of the flat batch (sequence b's token i is row ``b * Q + i``);
  padding rows carry token 0 at position 0 and write their K/V to ``pad_slot``, a slot nobody reads;
- every sequence reads ``L`` slots; padding columns point at ``pad_slot`` and are masked out;
- padding rows (and padding sequences) attend to key column 0 only, so softmax stays finite.

All index arrays of a bucket live in one byte buffer (int64 sections first, the bool mask last), staged in
pinned host memory and copied with one non-blocking transfer per step. The same code runs on CPU, where the
padded forward can be compared with the reference forward exactly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ssd.models.attention import DenseAttentionMetadata
from ssd.models.attention_layout import SequenceLayout, sequence_mask
from ssd.runtime.host_transfer import section_offsets

KV_ALIGN = 16  # key buckets are multiples of this: fused SDPA kernels want aligned mask rows


@dataclass(frozen=True)
class BucketShape:
    """One captured shape: ``batch_size`` sequences x ``query_len`` rows, each reading ``kv_len`` slots."""

    batch_size: int
    query_len: int
    kv_len: int

    @property
    def num_tokens(self) -> int:
        return self.batch_size * self.query_len


def powers_of_two(lo: int, hi: int) -> tuple[int, ...]:
    """``lo, 2*lo, 4*lo, ...`` up to the first value >= ``hi`` (clamped to ``hi``)."""
    values, v = [], lo
    while v < hi:
        values.append(v)
        v *= 2
    values.append(hi)
    return tuple(values)


@dataclass(frozen=True)
class BucketPolicy:
    """The bucket sizes of each dimension; a step uses the smallest bucket that fits it in all three."""

    batch_sizes: tuple[int, ...]
    query_lens: tuple[int, ...]
    kv_lens: tuple[int, ...]

    @classmethod
    def default(cls, max_batch_size: int, max_query_len: int, max_kv_len: int, min_kv_len: int = 64) -> "BucketPolicy":
        """Powers of two, key lengths rounded up to :data:`KV_ALIGN` (padding costs at most 2x)."""
        max_kv = -(-max_kv_len // KV_ALIGN) * KV_ALIGN
        min_kv = min(-(-min_kv_len // KV_ALIGN) * KV_ALIGN, max_kv)
        return cls(powers_of_two(1, max_batch_size), powers_of_two(1, max_query_len), powers_of_two(min_kv, max_kv))

    def __post_init__(self) -> None:
        for name in ("batch_sizes", "query_lens", "kv_lens"):
            values = getattr(self, name)
            if not values or any(v < 1 for v in values) or list(values) != sorted(set(values)):
                raise ValueError(f"{name} must be increasing positive integers, got {values!r}")

    @property
    def largest(self) -> BucketShape:
        return BucketShape(self.batch_sizes[-1], self.query_lens[-1], self.kv_lens[-1])

    def select(self, num_seqs: int, max_query_len: int, max_kv_len: int) -> BucketShape | None:
        """Smallest bucket holding the step, or None when some dimension exceeds every bucket."""
        sizes = []
        needs = ((self.batch_sizes, num_seqs), (self.query_lens, max_query_len), (self.kv_lens, max_kv_len))
        for buckets, need in needs:
            fit = next((b for b in buckets if b >= need), None)
            if fit is None:
                return None
            sizes.append(fit)
        return BucketShape(*sizes)


@dataclass
class PackedStep:
    """Host arrays of one step padded to ``shape``."""

    shape: BucketShape
    input_ids: np.ndarray  # [B*Q] int64
    positions: np.ndarray  # [B*Q] int64
    slot_mapping: np.ndarray  # [B*Q] int64
    logit_index: np.ndarray  # [N] int64: padded row of each requested logit, in request order
    kv_slots: np.ndarray  # [B, L] int64
    mask: np.ndarray  # [B, 1, Q, L] bool

    def sections(self) -> list[np.ndarray]:
        """Arrays in buffer order (see :func:`bucket_sections`); logit_index padded to ``B*Q``."""
        index = np.zeros(self.shape.num_tokens, dtype=np.int64)
        index[: len(self.logit_index)] = self.logit_index
        return [self.input_ids, self.positions, self.slot_mapping, index, self.kv_slots, self.mask]


def pad_step(shape: BucketShape, pad_slot: int) -> PackedStep:
    """A step made only of padding: used to warm up and capture a bucket without touching real slots."""
    T, B, Q, L = shape.num_tokens, shape.batch_size, shape.query_len, shape.kv_len
    mask = np.zeros((B, 1, Q, L), dtype=bool)
    mask[..., 0] = True
    return PackedStep(
        shape,
        input_ids=np.zeros(T, dtype=np.int64),
        positions=np.zeros(T, dtype=np.int64),
        slot_mapping=np.full(T, pad_slot, dtype=np.int64),
        logit_index=np.zeros(0, dtype=np.int64),
        kv_slots=np.full((B, L), pad_slot, dtype=np.int64),
        mask=mask,
    )


def pack_step(
    shape: BucketShape,
    token_ids: Sequence[int] | np.ndarray,  # [T] flat batch, sequence by sequence
    positions: np.ndarray,  # [T]
    layouts: list[SequenceLayout],
    logit_rows: Sequence[int] | np.ndarray,  # rows of the flat batch whose logits are wanted
    pad_slot: int,
) -> PackedStep:
    """Pad one step (the inputs a :class:`ModelRunner` builds) to ``shape``."""
    packed = pad_step(shape, pad_slot)
    token_ids = np.asarray(token_ids, dtype=np.int64)
    positions = np.asarray(positions, dtype=np.int64)
    Q = shape.query_len
    padded_row = np.empty(len(token_ids), dtype=np.int64)  # flat row -> padded row
    start = 0
    for b, layout in enumerate(layouts):
        q_len, kv_len = len(layout.write_slots), len(layout.read_slots)
        rows = slice(b * Q, b * Q + q_len)
        padded_row[start : start + q_len] = np.arange(rows.start, rows.stop)
        packed.input_ids[rows] = token_ids[start : start + q_len]
        packed.positions[rows] = positions[start : start + q_len]
        packed.slot_mapping[rows] = layout.write_slots
        packed.kv_slots[b, :kv_len] = layout.read_slots
        packed.mask[b, 0, :q_len, :] = False
        packed.mask[b, 0, :q_len, :kv_len] = sequence_mask(layout)
        start += q_len
    if start != len(token_ids) or len(positions) != start:
        raise ValueError(f"layouts hold {start} tokens but {len(token_ids)} ids / {len(positions)} positions given")
    packed.logit_index = padded_row[np.asarray(logit_rows, dtype=np.int64)]
    return packed


def bucket_sections(shape: BucketShape) -> tuple[list[tuple[str, torch.dtype, tuple[int, ...]]], list[int], int]:
    """Names, dtypes and shapes of a bucket's sections, their byte offsets, and the total byte size."""
    T, B, Q, L = shape.num_tokens, shape.batch_size, shape.query_len, shape.kv_len
    specs = [
        ("input_ids", torch.int64, (T,)),
        ("positions", torch.int64, (T,)),
        ("slot_mapping", torch.int64, (T,)),
        ("logit_index", torch.int64, (T,)),
        ("kv_slots", torch.int64, (B, L)),
        ("mask", torch.bool, (B, 1, Q, L)),
    ]
    sizes = [int(np.prod(s)) * torch.empty((), dtype=d).element_size() for _, d, s in specs]
    offsets, total = section_offsets(sizes)
    return specs, offsets, total


@dataclass
class StaticViews:
    """Device views of one bucket's inputs; their addresses never change, so a graph may capture them."""

    shape: BucketShape
    input_ids: torch.Tensor  # [B*Q]
    positions: torch.Tensor  # [B*Q]
    logit_index: torch.Tensor  # [B*Q]; the first N entries of a step are meaningful
    meta: DenseAttentionMetadata


class StaticInputs:
    """One device byte buffer (and a pinned host twin) large enough for every bucket of ``policy``."""

    def __init__(self, policy: BucketPolicy, device: torch.device) -> None:
        self.device = device
        capacity = max(
            bucket_sections(BucketShape(b, q, k))[2]
            for b in policy.batch_sizes
            for q in policy.query_lens
            for k in policy.kv_lens
        )
        pinned = device.type == "cuda"
        self._host = torch.zeros(capacity, dtype=torch.uint8, pin_memory=pinned)  # [C]
        self._device = torch.zeros(capacity, dtype=torch.uint8, device=device)  # [C]
        self._copied: torch.cuda.Event | None = None  # last host->device copy, before the host buffer is reused
        self._views: dict[BucketShape, StaticViews] = {}

    def views(self, shape: BucketShape) -> StaticViews:
        """The (cached) views of ``shape``'s sections in the device buffer."""
        if shape not in self._views:
            specs, offsets, _ = bucket_sections(shape)
            tensors = {}
            for (name, dtype, dims), off in zip(specs, offsets):
                n = int(np.prod(dims)) * torch.empty((), dtype=dtype).element_size()
                tensors[name] = self._device[off : off + n].view(dtype).view(dims)
            meta = DenseAttentionMetadata(tensors["slot_mapping"], tensors["kv_slots"], tensors["mask"])
            self._views[shape] = StaticViews(
                shape, tensors["input_ids"], tensors["positions"], tensors["logit_index"], meta
            )
        return self._views[shape]

    def load(self, packed: PackedStep) -> StaticViews:
        """Write ``packed`` into the bucket's sections: host staging, then one non-blocking copy."""
        specs, offsets, total = bucket_sections(packed.shape)
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy has long finished; this never waits in practice
        staging = self._host.numpy()
        for array, (name, _, dims), off in zip(packed.sections(), specs, offsets):
            if array.shape != dims:
                raise ValueError(f"{name}: shape {array.shape} != bucket shape {dims}")
            flat = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
            staging[off : off + flat.size] = flat
        self._device[:total].copy_(self._host[:total], non_blocking=True)
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()
        return self.views(packed.shape)
