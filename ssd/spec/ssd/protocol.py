"""The wire protocol between the target-side SSD client and the draft worker process.

Messages travel as one bytes buffer each over a `multiprocessing` Connection (`send_bytes` / `recv_bytes`).
A SPECULATE / SPECULATION exchange happens on every decode round, so arrays are never pickled: a frame is
a fixed prefix, a small JSON header (scalar fields, and the name/dtype/shape of each array in order) and
the raw array bytes, each array starting at an 8-byte aligned offset. Offsets are derived from the header
while decoding, so no byte layout is maintained by hand and adding a field is a one-line change.

    prefix   "<4sHHI": magic b"SSDw", protocol version, command, header length
    header   JSON {"f": {name: scalar}, "a": [[name, dtype.str, shape], ...]}
    data     arrays back to back, each padded to start at a multiple of 8 bytes; no trailing bytes

`decode_frame` returns zero-copy views into the received buffer (`np.frombuffer`): read-only when the
buffer is `bytes` (what `recv_bytes` returns), writable when it is a `bytearray` (`recv_bytes_into`).
The typed messages copy their small arrays (a few microseconds), so callers own writable arrays that
never alias a reused receive buffer, and `torch.from_numpy` works without warnings; only the large ones
named in a class's ZERO_COPY (SpeculationMsg.probs) stay views, and `SpeculationMsg.dense_probs()`
returns a fresh array.

This module imports numpy only; the typed messages validate shapes and dtypes on construction and on
decoding, so a malformed message fails here with a `ProtocolError` instead of deep inside the worker.
"""

from __future__ import annotations

import enum
import json
import logging
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from multiprocessing.connection import Connection
from typing import Any, ClassVar, Union

import numpy as np

logger = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
_MAGIC = b"SSDw"
_PREFIX = struct.Struct("<4sHHI")  # magic, version, command, header length
_ALIGN = 8
_ARRAY_KINDS = "biuf"  # bool, signed, unsigned, float: plain numbers only, never objects

Scalar = Union[None, bool, int, float, str]


class ProtocolError(ValueError):
    """A message that cannot be encoded or decoded: wrong types, inconsistent shapes, truncated bytes."""


class Command(enum.IntEnum):
    """Message kinds. Requests go client -> worker, responses worker -> client."""

    PREFILL = 1
    SPECULATE = 2
    RELEASE = 3
    SHUTDOWN = 4
    PING = 5
    READY = 16
    SPECULATION = 17
    ERROR = 18
    PONG = 19


class FallbackKind(enum.IntEnum):
    """How a row of a SPECULATION was produced when the cache missed (NONE for a hit)."""

    NONE = 0
    JIT = 1
    RANDOM = 2


@dataclass
class Frame:
    """A decoded message before it is given a type: command, scalar fields and named arrays."""

    command: Command
    fields: dict[str, Scalar]
    arrays: dict[str, np.ndarray]


def _align(offset: int) -> int:
    return (offset + _ALIGN - 1) // _ALIGN * _ALIGN


def _check_scalar(name: str, value: object) -> Scalar:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value  # type: ignore[return-value]
    if isinstance(value, np.generic) and value.dtype.kind in _ARRAY_KINDS:
        return value.item()  # type: ignore[no-any-return]
    raise ProtocolError(
        f"field {name!r} must be None, bool, int, float or str, got {type(value).__name__}"
    )


def encode_frame(
    command: Command,
    fields: dict[str, Scalar] | None = None,
    arrays: dict[str, np.ndarray] | None = None,
) -> bytes:
    """One message as bytes; each array is copied exactly once (into the result)."""
    scalars = {str(k): _check_scalar(k, v) for k, v in (fields or {}).items()}
    specs: list[list[Any]] = []
    buffers: list[np.ndarray] = []
    for name, value in (arrays or {}).items():
        arr = np.asarray(value)
        if not arr.flags.c_contiguous:
            arr = np.ascontiguousarray(arr)  # (ascontiguousarray alone would turn 0-d into 1-d)
        if arr.dtype.kind not in _ARRAY_KINDS or arr.dtype.fields is not None:
            raise ProtocolError(
                f"array {name!r} must have a bool, integer or float dtype, got {arr.dtype}"
            )
        specs.append([name, arr.dtype.str, list(arr.shape)])
        buffers.append(arr)
    header = json.dumps({"f": scalars, "a": specs}, separators=(",", ":")).encode("utf-8")
    parts: list[Any] = [_PREFIX.pack(_MAGIC, PROTOCOL_VERSION, int(command), len(header)), header]
    offset = _PREFIX.size + len(header)
    for arr in buffers:
        start = _align(offset)
        if start > offset:
            parts.append(bytes(start - offset))
        if arr.nbytes:
            parts.append(arr.reshape(-1).view(np.uint8))  # flat bytes view: join needs a simple buffer
        offset = start + arr.nbytes
    return b"".join(parts)


def decode_frame(data: bytes | bytearray | memoryview) -> Frame:
    """Parse a frame; arrays are views into `data` (see the module docstring)."""
    view = memoryview(data).cast("B") if not isinstance(data, (bytes, bytearray)) else memoryview(data)
    total = len(view)
    if total < _PREFIX.size:
        raise ProtocolError(f"truncated message: {total} bytes, shorter than the {_PREFIX.size}-byte prefix")
    magic, version, raw_command, header_len = _PREFIX.unpack_from(view, 0)
    if magic != _MAGIC:
        raise ProtocolError(f"not an SSD protocol message (magic {bytes(magic)!r}, expected {_MAGIC!r})")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            f"protocol version {version} is not supported (this side speaks {PROTOCOL_VERSION})"
        )
    try:
        command = Command(raw_command)
    except ValueError:
        allowed = ", ".join(f"{c.name}={c.value}" for c in Command)
        raise ProtocolError(f"unknown command {raw_command}; known commands: {allowed}") from None
    offset = _PREFIX.size + header_len
    if offset > total:
        raise ProtocolError(f"truncated {command.name} message: header needs {offset} bytes, got {total}")
    try:
        header = json.loads(bytes(view[_PREFIX.size : offset]).decode("utf-8"))
        scalars = header["f"]
        specs = header["a"]
        if not isinstance(scalars, dict) or not isinstance(specs, list):
            raise TypeError("header fields must be a dict and arrays a list")
    except (ValueError, KeyError, TypeError) as exc:
        raise ProtocolError(f"corrupt {command.name} header: {exc}") from None
    arrays: dict[str, np.ndarray] = {}
    for spec in specs:
        try:
            name, dtype_str, shape = spec
            dtype = np.dtype(dtype_str)
            shape = tuple(int(n) for n in shape)
            if not isinstance(name, str) or name in arrays:
                raise ValueError("array names must be distinct strings")
        except (ValueError, TypeError) as exc:
            raise ProtocolError(f"corrupt {command.name} header: bad array spec {spec!r}: {exc}") from None
        if dtype.kind not in _ARRAY_KINDS or dtype.fields is not None or any(n < 0 for n in shape):
            raise ProtocolError(f"corrupt {command.name} header: bad array spec {spec!r}")
        count = math.prod(shape)
        start = _align(offset)
        end = start + count * dtype.itemsize
        if end > total:
            raise ProtocolError(
                f"truncated {command.name} message: array {name!r} needs bytes up to {end}, got {total}"
            )
        if count:
            arrays[name] = np.frombuffer(view, dtype=dtype, count=count, offset=start).reshape(shape)
        else:
            arrays[name] = np.empty(shape, dtype=dtype)
        offset = end
    if offset != total:
        raise ProtocolError(f"{command.name} message has {total - offset} unexpected trailing bytes")
    return Frame(command, scalars, arrays)


# ---------------------------------------------------------------------------------------------------
# Typed messages


def _coerce_array(owner: str, name: str, value: object, dtype: np.dtype, ndim: int) -> np.ndarray:
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


def _check_int(owner: str, name: str, value: object) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ProtocolError(f"{owner}.{name} must be an integer, got {value!r}")
    return int(value)


def _check_float(owner: str, name: str, value: object) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ProtocolError(f"{owner}.{name} must be a number, got {value!r}")
    return float(value)


def _check_ragged(owner: str, flat: str, lengths: str, msg: Any) -> None:
    flat_arr: np.ndarray = getattr(msg, flat)
    len_arr: np.ndarray = getattr(msg, lengths)
    if len_arr.size and len_arr.min() < 0:
        raise ProtocolError(f"{owner}.{lengths} must be >= 0")
    if int(len_arr.sum()) != flat_arr.size:
        raise ProtocolError(
            f"{owner}.{lengths} sums to {int(len_arr.sum())} but {owner}.{flat} has {flat_arr.size} tokens"
        )


def _check_rows(owner: str, batch: int, msg: Any, names: Sequence[str]) -> None:
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


@dataclass(eq=False)
class _Message:
    """Shared pack/unpack: dataclass fields named in ARRAYS travel as arrays, the others as scalars."""

    COMMAND: ClassVar[Command]
    ARRAYS: ClassVar[dict[str, tuple[np.dtype, int]]] = {}  # name -> (dtype, ndim)
    ZERO_COPY: ClassVar[frozenset[str]] = frozenset()  # arrays left as views into the buffer when decoded

    def __post_init__(self) -> None:
        owner = type(self).__name__
        for name, (dtype, ndim) in self.ARRAYS.items():
            setattr(self, name, _coerce_array(owner, name, getattr(self, name), dtype, ndim))
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


_I64 = np.dtype(np.int64)
_I32 = np.dtype(np.int32)
_U64 = np.dtype(np.uint64)
_U8 = np.dtype(np.uint8)
_F32 = np.dtype(np.float32)
_BOOL = np.dtype(np.bool_)


@dataclass(eq=False)
class PrefillMsg(_Message):
    """New sequences for the worker: their tokens so far and the sampling options drafts must follow.

    Seeds are uint64 with a `has_seed` mask rather than int64 with -1 = none, because requests may use
    any seed in [0, 2**64 - 1] (SamplingParams allows it).
    """

    COMMAND: ClassVar[Command] = Command.PREFILL
    ARRAYS: ClassVar[dict[str, tuple[np.dtype, int]]] = {
        "seq_ids": (_I64, 1),
        "token_ids": (_I64, 1),
        "lengths": (_I64, 1),
        "temperature": (_F32, 1),
        "top_k": (_I32, 1),
        "top_p": (_F32, 1),
        "greedy": (_BOOL, 1),
        "seed": (_U64, 1),
        "has_seed": (_BOOL, 1),
    }

    seq_ids: np.ndarray  # [B] int64
    token_ids: np.ndarray  # [N] int64, every sequence's tokens back to back
    lengths: np.ndarray  # [B] int64, sum == N
    temperature: np.ndarray  # [B] float32
    top_k: np.ndarray  # [B] int32, 0 = disabled
    top_p: np.ndarray  # [B] float32, 1 = disabled
    greedy: np.ndarray  # [B] bool
    seed: np.ndarray  # [B] uint64, meaningful where has_seed
    has_seed: np.ndarray  # [B] bool

    def _validate(self) -> None:
        per_row = ("lengths", "temperature", "top_k", "top_p", "greedy", "seed", "has_seed")
        _check_rows("PrefillMsg", self.seq_ids.shape[0], self, per_row)
        _check_ragged("PrefillMsg", "token_ids", "lengths", self)

    @classmethod
    def from_lists(
        cls,
        seq_ids: Sequence[int],
        token_ids: Sequence[Sequence[int]],
        temperature: Sequence[float],
        top_k: Sequence[int],
        top_p: Sequence[float],
        greedy: Sequence[bool],
        seeds: Sequence[int | None],
    ) -> PrefillMsg:
        flat, lengths = pack_ragged(token_ids)
        seed = np.array([0 if s is None else s for s in seeds], dtype=np.uint64)  # [B]
        has_seed = np.array([s is not None for s in seeds], dtype=np.bool_)  # [B]
        return cls(
            seq_ids=np.asarray(seq_ids, dtype=np.int64), token_ids=flat, lengths=lengths,
            temperature=np.asarray(temperature, dtype=np.float32), top_k=np.asarray(top_k, dtype=np.int32),
            top_p=np.asarray(top_p, dtype=np.float32), greedy=np.asarray(greedy, dtype=np.bool_),
            seed=seed, has_seed=has_seed,
        )

    @property
    def batch_size(self) -> int:
        return int(self.seq_ids.shape[0])

    def token_lists(self) -> list[np.ndarray]:
        return split_ragged(self.token_ids, self.lengths)

    def seed_of(self, row: int) -> int | None:
        return int(self.seed[row]) if self.has_seed[row] else None


@dataclass(eq=False)
class SpeculateMsg(_Message):
    """One decode round: per row, the committed tokens the worker has not seen and last round's outcome.

    num_accepted is k of the previous round (-1 when there was none or it is unknown); with the last new
    token (the recovery/bonus token t*) it forms the cache key (k, t*).
    """

    COMMAND: ClassVar[Command] = Command.SPECULATE
    ARRAYS: ClassVar[dict[str, tuple[np.dtype, int]]] = {
        "seq_ids": (_I64, 1),
        "new_token_ids": (_I64, 1),
        "new_lengths": (_I64, 1),
        "num_accepted": (_I64, 1),
        "num_drafts": (_I32, 1),
    }

    round_id: int
    seq_ids: np.ndarray  # [B] int64
    new_token_ids: np.ndarray  # [N] int64
    new_lengths: np.ndarray  # [B] int64, sum == N
    num_accepted: np.ndarray  # [B] int64, -1 = no previous round / unknown
    num_drafts: np.ndarray  # [B] int32, K_i
    fallback: int = 1  # FallbackKind for the rows that miss (JIT or RANDOM), chosen by the client

    def _validate(self) -> None:
        self.round_id = _check_int("SpeculateMsg", "round_id", self.round_id)
        self.fallback = _check_int("SpeculateMsg", "fallback", self.fallback)
        if self.fallback not in (FallbackKind.JIT, FallbackKind.RANDOM):
            raise ProtocolError(f"SpeculateMsg.fallback must be JIT or RANDOM, got {self.fallback}")
        per_row = ("new_lengths", "num_accepted", "num_drafts")
        _check_rows("SpeculateMsg", self.seq_ids.shape[0], self, per_row)
        _check_ragged("SpeculateMsg", "new_token_ids", "new_lengths", self)
        if self.num_accepted.size and self.num_accepted.min() < -1:
            raise ProtocolError("SpeculateMsg.num_accepted must be >= -1 (-1 = no previous round)")
        if self.num_drafts.size and self.num_drafts.min() < 0:
            raise ProtocolError("SpeculateMsg.num_drafts must be >= 0")

    @classmethod
    def from_lists(
        cls,
        round_id: int,
        seq_ids: Sequence[int],
        new_token_ids: Sequence[Sequence[int]],
        num_accepted: Sequence[int],
        num_drafts: Sequence[int],
    ) -> SpeculateMsg:
        flat, lengths = pack_ragged(new_token_ids)
        return cls(
            round_id=round_id, seq_ids=np.asarray(seq_ids, dtype=np.int64), new_token_ids=flat,
            new_lengths=lengths, num_accepted=np.asarray(num_accepted, dtype=np.int64),
            num_drafts=np.asarray(num_drafts, dtype=np.int32),
        )

    @property
    def batch_size(self) -> int:
        return int(self.seq_ids.shape[0])

    def new_token_lists(self) -> list[np.ndarray]:
        return split_ragged(self.new_token_ids, self.new_lengths)


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
class SpeculationMsg(_Message):
    """The worker's answer to SPECULATE: K drafts per row, whether they came from the cache, and q.

    Probabilities travel only for the rows that need them (sampled rows; greedy rows are one-hot and the
    client rebuilds them), as `probs[s]` for row `prob_rows[s]`; `dense_probs` restores [B, K, V].
    """

    COMMAND: ClassVar[Command] = Command.SPECULATION
    ARRAYS: ClassVar[dict[str, tuple[np.dtype, int]]] = {
        "draft_tokens": (_I64, 2),
        "hit": (_BOOL, 1),
        "fallback": (_U8, 1),
        "prob_rows": (_I32, 1),
        "probs": (_F32, 3),
    }
    ZERO_COPY: ClassVar[frozenset[str]] = frozenset({"probs"})

    round_id: int
    draft_tokens: np.ndarray  # [B, K] int64
    hit: np.ndarray  # [B] bool
    fallback: np.ndarray  # [B] uint8, FallbackKind
    prob_rows: np.ndarray  # [S] int32, distinct rows in [0, B)
    probs: np.ndarray  # [S, K, V] float32
    cache_build_s: float = 0.0  # how long the worker's last cache build took
    serve_s: float = 0.0  # time the worker spent serving this request

    def _validate(self) -> None:
        owner = "SpeculationMsg"
        self.round_id = _check_int(owner, "round_id", self.round_id)
        self.cache_build_s = _check_float(owner, "cache_build_s", self.cache_build_s)
        self.serve_s = _check_float(owner, "serve_s", self.serve_s)
        B, K = self.draft_tokens.shape
        _check_rows(owner, B, self, ("hit", "fallback"))
        if B and int(self.fallback.max()) > max(FallbackKind):
            raise ProtocolError(f"{owner}.fallback values must be FallbackKind values 0..{max(FallbackKind)}")
        if np.any(self.hit & (self.fallback != FallbackKind.NONE)):
            raise ProtocolError(f"{owner}: a row that hit the cache must have fallback NONE")
        S = self.prob_rows.shape[0]
        if self.probs.shape[0] != S:
            raise ProtocolError(f"{owner}.probs has {self.probs.shape[0]} rows but prob_rows lists {S}")
        if S == 0 and self.probs.shape[1] != K:
            self.probs = self.probs.reshape(0, K, self.probs.shape[2])  # an empty [0, ?, V] is fine
        if self.probs.shape[1] != K:
            raise ProtocolError(f"{owner}.probs has {self.probs.shape[1]} draft positions, expected K={K}")
        rows = self.prob_rows
        if S and (rows.min() < 0 or rows.max() >= B or np.unique(rows).size != S):
            raise ProtocolError(f"{owner}.prob_rows must be distinct row indices in [0, {B})")

    @property
    def batch_size(self) -> int:
        return int(self.draft_tokens.shape[0])

    def dense_probs(self, vocab_size: int | None = None, out: np.ndarray | None = None) -> np.ndarray:
        """[B, K, V] float32, zeros in the rows that sent no probabilities (see `scatter_prob_rows`)."""
        return scatter_prob_rows(self.prob_rows, self.probs, self.batch_size, vocab_size, out)


@dataclass(eq=False)
class ReleaseMsg(_Message):
    """Forget these sequences (finished, aborted or preempted) and free their draft KV."""

    COMMAND: ClassVar[Command] = Command.RELEASE
    ARRAYS: ClassVar[dict[str, tuple[np.dtype, int]]] = {"seq_ids": (_I64, 1)}

    seq_ids: np.ndarray  # [B] int64


@dataclass(eq=False)
class ShutdownMsg(_Message):
    COMMAND: ClassVar[Command] = Command.SHUTDOWN


@dataclass(eq=False)
class PingMsg(_Message):
    """Liveness check; the worker answers PONG with the same nonce."""

    COMMAND: ClassVar[Command] = Command.PING
    nonce: int = 0

    def _validate(self) -> None:
        self.nonce = _check_int("PingMsg", "nonce", self.nonce)


@dataclass(eq=False)
class PongMsg(_Message):
    COMMAND: ClassVar[Command] = Command.PONG
    nonce: int = 0

    def _validate(self) -> None:
        self.nonce = _check_int("PongMsg", "nonce", self.nonce)


@dataclass(eq=False)
class ReadyMsg(_Message):
    """Acknowledges a request that returns no data (startup, PREFILL, RELEASE); `info` is free-form."""

    COMMAND: ClassVar[Command] = Command.READY
    info: dict[str, Scalar] = field(default_factory=dict)

    def _validate(self) -> None:
        self.info = {str(k): _check_scalar(str(k), v) for k, v in self.info.items()}

    def _scalar_fields(self) -> dict[str, Scalar]:
        return dict(self.info)

    @classmethod
    def _from_frame(cls, frame: Frame) -> ReadyMsg:
        if frame.arrays:
            raise ProtocolError(f"malformed READY message: unexpected arrays {sorted(frame.arrays)}")
        return cls(info=dict(frame.fields))


@dataclass(eq=False)
class ErrorMsg(_Message):
    """The worker failed to serve a request; the client raises with this text."""

    COMMAND: ClassVar[Command] = Command.ERROR
    message: str = ""
    traceback: str = ""

    def _validate(self) -> None:
        if not isinstance(self.message, str) or not isinstance(self.traceback, str):
            raise ProtocolError("ErrorMsg.message and ErrorMsg.traceback must be strings")


Message = Union[
    PrefillMsg, SpeculateMsg, SpeculationMsg, ReleaseMsg, ShutdownMsg, PingMsg, PongMsg, ReadyMsg, ErrorMsg
]

_MESSAGE_TYPES: dict[Command, type[_Message]] = {
    cls.COMMAND: cls
    for cls in (PrefillMsg, SpeculateMsg, SpeculationMsg, ReleaseMsg, ShutdownMsg)
    + (PingMsg, PongMsg, ReadyMsg, ErrorMsg)
}


def decode_message(data: bytes | bytearray | memoryview) -> Message:
    """The typed message in `data`; ProtocolError (a ValueError) if it is truncated, unknown or malformed."""
    frame = decode_frame(data)
    return _MESSAGE_TYPES[frame.command]._from_frame(frame)  # type: ignore[no-any-return]


def send_message(conn: Connection, message: Message) -> None:
    conn.send_bytes(message.pack())


def recv_message(conn: Connection) -> Message:
    return decode_message(conn.recv_bytes())
