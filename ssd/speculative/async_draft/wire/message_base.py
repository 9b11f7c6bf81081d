"""Validation helpers, ragged and probability-row array helpers, and the pack/unpack base class shared by the
typed SSD wire messages."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any, ClassVar

import numpy as np

from ssd.speculative.async_draft.wire.frames import Command, Frame, ProtocolError, Scalar, decode_frame, encode_frame

# the dtypes of the messages' arrays
I64 = np.dtype(np.int64)
I32 = np.dtype(np.int32)
U64 = np.dtype(np.uint64)
U8 = np.dtype(np.uint8)
F32 = np.dtype(np.float32)
BOOL = np.dtype(np.bool_)


def coerce_array(owner: str, name: str, value: object, dtype: np.dtype, ndim: int) -> np.ndarray:
    """`value` as an array of `dtype`: no copy when it already is one, no silently lossy conversion."""
    arr = value if isinstance(value, np.ndarray) else np.asarray(value)
    if arr.ndim != ndim:
        raise ProtocolError(f"{owner}.{name} must be {ndim}-D, got shape {arr.shape}")
    if arr.dtype != dtype:
        if arr.size == 0:
            return arr.astype(dtype)
        if dtype.kind in "iu" and arr.dtype.kind in "iu":  # any integer width, if the values fit
            info = np.iinfo(dtype)
            if arr.min() < info.min or arr.max() > info.max:
                raise ProtocolError(f"{owner}.{name} has values outside the {dtype} range")
        elif dtype.kind == "b" and arr.dtype.kind in "iu":  # 0/1 integers are flags
            if arr.min() < 0 or arr.max() > 1:
                raise ProtocolError(f"{owner}.{name} must be bool (got {arr.dtype} values other than 0/1)")
        elif not np.can_cast(arr.dtype, dtype, casting="same_kind"):
            raise ProtocolError(f"{owner}.{name} must be {dtype} (got {arr.dtype}, which would lose values)")
        arr = arr.astype(dtype)
    return arr


def check_int(owner: str, name: str, value: object) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ProtocolError(f"{owner}.{name} must be an integer, got {value!r}")
    return int(value)


def check_float(owner: str, name: str, value: object) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ProtocolError(f"{owner}.{name} must be a number, got {value!r}")
    return float(value)


def check_ragged(owner: str, flat: str, lengths: str, msg: Any) -> None:
    flat_arr: np.ndarray = getattr(msg, flat)
    len_arr: np.ndarray = getattr(msg, lengths)
    if len_arr.size and len_arr.min() < 0:
        raise ProtocolError(f"{owner}.{lengths} must be >= 0")
    if int(len_arr.sum()) != flat_arr.size:
        raise ProtocolError(
            f"{owner}.{lengths} sums to {int(len_arr.sum())} but {owner}.{flat} has {flat_arr.size} tokens"
        )


def check_rows(owner: str, batch: int, msg: Any, names: Sequence[str]) -> None:
    for name in names:
        n = getattr(msg, name).shape[0]
        if n != batch:
            raise ProtocolError(f"{owner}.{name} has {n} rows, expected {batch} (one per sequence)")


def pack_ragged(rows: Sequence[Sequence[int] | np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Token lists -> (flat int64 [N], lengths int64 [B])."""
    lengths = np.fromiter((len(r) for r in rows), dtype=np.int64, count=len(rows))  # [B]
    if not rows or lengths.sum() == 0:
        return np.zeros(0, dtype=np.int64), lengths
    flat = np.concatenate([np.asarray(r, dtype=np.int64).reshape(-1) for r in rows])  # [N]
    return flat, lengths


def split_ragged(flat: np.ndarray, lengths: np.ndarray) -> list[np.ndarray]:
    """(flat [N], lengths [B]) -> B arrays (views into `flat`)."""
    if lengths.size == 0:
        return []
    return np.split(flat, np.cumsum(lengths)[:-1])


def scatter_prob_rows(
    prob_rows: np.ndarray,
    probs: np.ndarray,
    batch_size: int,
    vocab_size: int | None = None,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """[S, K, V] probabilities of rows `prob_rows` -> [B, K, V], zeros in the other rows.

    The result is a fresh array unless `out` (a C-contiguous [B, K, V] float32 array) is given to be
    filled and returned: a caller that reuses one buffer per round avoids the page faults of allocating
    megabytes every round (with V ~ 50k, these cost more than the copy itself).
    """
    S, K, V = probs.shape
    if vocab_size is None:
        if S == 0 and out is None:
            raise ProtocolError("vocab_size is needed to build dense probabilities when no row carries any")
        vocab_size = V if S else out.shape[-1]  # type: ignore[union-attr]
    elif S and V != vocab_size:
        raise ProtocolError(f"probabilities have vocabulary {V}, expected vocab_size={vocab_size}")
    shape = (batch_size, K, vocab_size)
    if out is None:
        out = np.empty(shape, dtype=np.float32)  # [B, K, V]
    elif out.shape != shape or out.dtype != np.float32 or not out.flags.c_contiguous:
        raise ProtocolError(
            f"out must be a C-contiguous float32 array of shape {shape}, got {out.dtype} {out.shape}"
        )
    has_probs = np.zeros(batch_size, dtype=bool)  # [B]
    for s, row in enumerate(prob_rows.tolist()):  # row slices copy at memcpy speed; fancy indexing is slower
        out[row] = probs[s]
        has_probs[row] = True
    for row in np.flatnonzero(~has_probs).tolist():
        out[row] = 0.0
    return out


@dataclass(eq=False)
class WireMessage:
    """Shared pack/unpack: dataclass fields named in ARRAYS travel as arrays, the others as scalars."""

    COMMAND: ClassVar[Command]
    ARRAYS: ClassVar[dict[str, tuple[np.dtype, int]]] = {}  # name -> (dtype, ndim)
    ZERO_COPY: ClassVar[frozenset[str]] = frozenset()  # arrays left as views into the buffer when decoded

    def __post_init__(self) -> None:
        owner = type(self).__name__
        for name, (dtype, ndim) in self.ARRAYS.items():
            setattr(self, name, coerce_array(owner, name, getattr(self, name), dtype, ndim))
        self._validate()

    def _validate(self) -> None:
        """Subclasses check scalars and cross-array consistency here."""

    def _scalar_fields(self) -> dict[str, Scalar]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in self.ARRAYS}

    def pack(self) -> bytes:
        return encode_frame(
            self.COMMAND, self._scalar_fields(), {name: getattr(self, name) for name in self.ARRAYS}
        )

    @classmethod
    def _from_frame(cls, frame: Frame) -> Any:
        expected_fields = {f.name for f in fields(cls) if f.name not in cls.ARRAYS}
        if set(frame.arrays) != set(cls.ARRAYS) or not set(frame.fields) <= expected_fields:
            raise ProtocolError(
                f"malformed {frame.command.name} message: arrays {sorted(frame.arrays)} and fields "
                f"{sorted(frame.fields)}; expected arrays {sorted(cls.ARRAYS)} and fields "
                f"{sorted(expected_fields)}"
            )
        arrays = {
            name: arr if name in cls.ZERO_COPY else arr.copy()  # copies never alias a reused buffer
            for name, arr in frame.arrays.items()
        }
        try:
            return cls(**frame.fields, **arrays)
        except TypeError as exc:  # a required scalar field is missing
            raise ProtocolError(f"malformed {frame.command.name} message: {exc}") from None

    @classmethod
    def unpack(cls, data: bytes | bytearray | memoryview) -> Any:
        frame = decode_frame(data)
        if frame.command != cls.COMMAND:
            raise ProtocolError(f"expected a {cls.COMMAND.name} message, got {frame.command.name}")
        return cls._from_frame(frame)
