"""Frames of the SSD wire protocol: how one message becomes bytes and back (the typed messages built on
them live in :mod:`ssd.speculative.async_draft.wire.protocol`).

Messages travel as one bytes buffer each over a `multiprocessing` Connection (`send_bytes` / `recv_bytes`) to a
local worker, or over the framed socket of ``remote/channel.py`` to a draft server.
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

This module imports numpy only. A frame that is truncated, has a foreign magic or version, an unknown
command or a corrupt header fails here with a `ProtocolError`.
"""

from __future__ import annotations

import enum
import json
import math
import struct
from dataclasses import dataclass
from typing import Any, Union

import numpy as np

PROTOCOL_VERSION = 6  # 2: PING and PONG left the wire (nothing sent them); 3: SPECULATE's tree_depth;
# 4: SPECULATE's target features (EAGLE-3 heads); 5: PREFILL's output constraints (structured outputs);
# 6: HELLO (a remote draft server's session settings)
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
    HELLO = 5
    READY = 16
    SPECULATION = 17
    ERROR = 18


@dataclass
class Frame:
    """A decoded message before it is given a type: command, scalar fields and named arrays."""

    command: Command
    fields: dict[str, Scalar]
    arrays: dict[str, np.ndarray]


def _align(offset: int) -> int:
    return (offset + _ALIGN - 1) // _ALIGN * _ALIGN


def check_scalar(name: str, value: object) -> Scalar:
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
    scalars = {str(k): check_scalar(k, v) for k, v in (fields or {}).items()}
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
