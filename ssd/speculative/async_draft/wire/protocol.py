"""Typed messages of the wire protocol between the target-side SSD client and the draft worker process.

Each message is a dataclass whose array fields (named in ``ARRAYS`` with dtype and rank) travel as raw arrays
and whose other fields travel as scalars of one :mod:`frame <ssd.speculative.async_draft.wire.frames>`.
Messages validate shapes and dtypes on construction and on decoding, so a malformed message fails here with a
`ProtocolError` instead of deep inside the worker. The small arrays of a decoded message are copies (callers own
writable arrays that never alias a reused receive buffer); only those named in a class's ZERO_COPY
(SpeculationMsg.probs) stay views, and `SpeculationMsg.dense_probs()` returns a fresh array.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import ClassVar, Union

import numpy as np

from ssd.options import Fallback
from ssd.speculative.async_draft.wire.frames import (  # noqa: F401 - re-exported: the protocol's names
    PROTOCOL_VERSION,
    Command,
    Frame,
    ProtocolError,
    Scalar,
    check_scalar,
    decode_frame,
    encode_frame,
)
from ssd.speculative.async_draft.wire.message_base import (  # noqa: F401 - re-exported: this module's API
    BOOL,
    F32,
    I32,
    I64,
    U8,
    U64,
    WireMessage,
    check_float,
    check_int,
    check_ragged,
    check_rows,
    pack_ragged,
    scatter_prob_rows,
    split_ragged,
)
from ssd.speculative.async_draft.wire.prefill import PrefillMsg  # noqa: F401 - re-exported: a message

logger = logging.getLogger(__name__)


FALLBACK_CODES: dict[Fallback | None, int] = {None: 0, Fallback.JIT: 1, Fallback.RANDOM: 2}
"""How a SPECULATION's ``fallback`` array spells the :class:`~ssd.options.Fallback` that served each row (0: none,
the row hit the cache)."""
_FALLBACK_OF_CODE = {code: fallback for fallback, code in FALLBACK_CODES.items()}
MISS_FALLBACKS = (Fallback.JIT, Fallback.RANDOM)  # what a SPECULATE may ask to serve misses with


def encode_fallbacks(fallbacks: Sequence[Fallback | None]) -> np.ndarray:
    """Each row's fallback (None: a hit) as the ``fallback`` array of a SPECULATION ([B] uint8)."""
    return np.array([FALLBACK_CODES[f] for f in fallbacks], dtype=np.uint8)


@dataclass(eq=False)
class SpeculateMsg(WireMessage):
    """One decode round: per row, the committed tokens the worker has not seen and last round's outcome.

    num_accepted is k of the previous round (-1 when there was none or it is unknown; 0 for the first round
    after a prefill with first_round_drafts, whose 'previous round' is the prompt step with no drafts); with
    the last new token (the recovery/bonus token t*) it forms the cache key (k, t*). num_drafts is this round's K_i;
    tree_depth (>= num_drafts) is how many drafts each branch of the cache built during this round prepares,
    the most the next round may ask for (more than K_i when the target chooses its round drafts per round).
    """

    COMMAND: ClassVar[Command] = Command.SPECULATE
    ARRAYS: ClassVar[dict[str, tuple[np.dtype, int]]] = {
        "seq_ids": (I64, 1),
        "new_token_ids": (I64, 1),
        "new_lengths": (I64, 1),
        "num_accepted": (I64, 1),
        "num_drafts": (I32, 1),
        "tree_depth": (I32, 1),
        "feature_start": (I64, 1),
        "feature_lengths": (I64, 1),
        "features": (F32, 2),
    }

    round_id: int
    seq_ids: np.ndarray  # [B] int64
    new_token_ids: np.ndarray  # [N] int64
    new_lengths: np.ndarray  # [B] int64, sum == N
    num_accepted: np.ndarray  # [B] int64, -1 = no previous round / unknown
    num_drafts: np.ndarray  # [B] int32, K_i
    tree_depth: np.ndarray  # [B] int32, drafts per branch of the next cache, >= K_i
    # An EAGLE-3 head's input: row i's target features of positions feature_start[i].., feature_lengths[i] of them,
    # back to back in features [N, F] (F = 3 Ht; float32, what the target computed). Empty for a draft model.
    feature_start: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # [B] int64
    feature_lengths: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # [B] int64
    features: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.float32))  # [N, F] float32
    fallback: Fallback = Fallback.JIT  # what serves the rows that miss (JIT or RANDOM), chosen by the client

    def _validate(self) -> None:
        self.round_id = check_int("SpeculateMsg", "round_id", self.round_id)
        if self.fallback not in MISS_FALLBACKS:
            raise ProtocolError(f"SpeculateMsg.fallback must be one of {[f.value for f in MISS_FALLBACKS]}, "
                                f"got {self.fallback!r}")
        self.fallback = Fallback(self.fallback)  # travels as its name
        B = self.seq_ids.shape[0]
        if self.feature_lengths.size == 0:  # none given: no features in any row
            self.feature_start, self.feature_lengths = np.zeros(B, np.int64), np.zeros(B, np.int64)
        per_row = ("new_lengths", "num_accepted", "num_drafts", "tree_depth", "feature_start", "feature_lengths")
        check_rows("SpeculateMsg", B, self, per_row)
        if self.feature_lengths.size and self.feature_lengths.min() < 0:
            raise ProtocolError("SpeculateMsg.feature_lengths must be >= 0")
        if int(self.feature_lengths.sum()) != self.features.shape[0]:
            raise ProtocolError(f"SpeculateMsg.feature_lengths sums to {int(self.feature_lengths.sum())} but "
                                f"SpeculateMsg.features has {self.features.shape[0]} rows")
        check_ragged("SpeculateMsg", "new_token_ids", "new_lengths", self)
        if self.num_accepted.size and self.num_accepted.min() < -1:
            raise ProtocolError("SpeculateMsg.num_accepted must be >= -1 (-1 = no previous round)")
        if self.num_drafts.size and self.num_drafts.min() < 0:
            raise ProtocolError("SpeculateMsg.num_drafts must be >= 0")
        if (self.tree_depth < self.num_drafts).any():
            raise ProtocolError("SpeculateMsg.tree_depth must be >= num_drafts in every row")

    @classmethod
    def from_lists(
        cls,
        round_id: int,
        seq_ids: Sequence[int],
        new_token_ids: Sequence[Sequence[int]],
        num_accepted: Sequence[int],
        num_drafts: Sequence[int],
        tree_depth: Sequence[int] | None = None,
        target_features: Sequence[tuple[int, np.ndarray]] | None = None,
    ) -> SpeculateMsg:
        """``tree_depth`` defaults to ``num_drafts`` (the next cache prepares as many drafts as this round's);
        ``target_features`` (an EAGLE-3 head's) gives per row (first position, features ``[m, F]``)."""
        flat, lengths = pack_ragged(new_token_ids)
        msg = cls(
            round_id=round_id, seq_ids=np.asarray(seq_ids, dtype=np.int64), new_token_ids=flat,
            new_lengths=lengths, num_accepted=np.asarray(num_accepted, dtype=np.int64),
            num_drafts=np.asarray(num_drafts, dtype=np.int32),
            tree_depth=np.asarray(num_drafts if tree_depth is None else tree_depth, dtype=np.int32),
        )
        if target_features is not None:
            msg.feature_start = np.array([start for start, _ in target_features], dtype=np.int64)
            msg.feature_lengths = np.array([len(rows) for _, rows in target_features], dtype=np.int64)
            msg.features = np.concatenate([rows for _, rows in target_features]).astype(np.float32, copy=False)
            msg._validate()
        return msg

    @property
    def batch_size(self) -> int:
        return int(self.seq_ids.shape[0])

    def new_token_lists(self) -> list[np.ndarray]:
        return split_ragged(self.new_token_ids, self.new_lengths)

    def target_features(self) -> list[tuple[int, np.ndarray] | None]:
        """Per row, (first position, its features ``[m, F]``) or None where it has none."""
        ends = np.cumsum(self.feature_lengths).tolist()
        return [(int(start), self.features[end - n : end]) if n else None
                for start, n, end in zip(self.feature_start.tolist(), self.feature_lengths.tolist(), ends)]


@dataclass(eq=False)
class SpeculationMsg(WireMessage):
    """The worker's answer to SPECULATE: up to K drafts per row, whether they came from the cache, and q.

    Probabilities travel only for the rows that need them (sampled rows; greedy rows are one-hot and the
    client rebuilds them), as `probs[s]` for row `prob_rows[s]`; `dense_probs` restores [B, K, V].
    """

    COMMAND: ClassVar[Command] = Command.SPECULATION
    ARRAYS: ClassVar[dict[str, tuple[np.dtype, int]]] = {
        "draft_tokens": (I64, 2),
        "hit": (BOOL, 1),
        "fallback": (U8, 1),
        "prob_rows": (I32, 1),
        "probs": (F32, 3),
        "copied": (BOOL, 2),
        "num_drafts": (I32, 1),
    }
    ZERO_COPY: ClassVar[frozenset[str]] = frozenset({"probs"})

    round_id: int
    draft_tokens: np.ndarray  # [B, K] int64
    hit: np.ndarray  # [B] bool
    fallback: np.ndarray  # [B] uint8, the fallback that served each row (FALLBACK_CODES; 0 on a hit)
    prob_rows: np.ndarray  # [S] int32, distinct rows in [0, B)
    probs: np.ndarray  # [S, K, V] float32
    copied: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), np.bool_))  # [B, K]: prompt lookup's
    # [B] drafts per row (<= K; a random filler may hold fewer), the row's tokens are draft_tokens[i, :n];
    # empty = K for every row
    num_drafts: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))
    cache_build_s: float = 0.0  # how long the worker's last cache build took
    cache_branches: int = 0  # tree branches of that build, all sequences together
    cache_cut_short: int = 0  # 1 when that build stopped early: this request was waiting or due
    serve_s: float = 0.0  # time the worker spent serving this request

    def _validate(self) -> None:
        owner = "SpeculationMsg"
        self.round_id = check_int(owner, "round_id", self.round_id)
        self.cache_build_s = check_float(owner, "cache_build_s", self.cache_build_s)
        self.cache_branches = check_int(owner, "cache_branches", self.cache_branches)
        self.cache_cut_short = check_int(owner, "cache_cut_short", self.cache_cut_short)
        if self.cache_cut_short not in (0, 1):
            raise ProtocolError(f"{owner}.cache_cut_short must be 0 or 1, got {self.cache_cut_short}")
        self.serve_s = check_float(owner, "serve_s", self.serve_s)
        B, K = self.draft_tokens.shape
        check_rows(owner, B, self, ("hit", "fallback"))
        if self.copied.size == 0:
            self.copied = np.zeros((B, K), np.bool_)  # none given: no draft was copied
        if self.copied.shape != (B, K):
            raise ProtocolError(f"{owner}.copied must have the shape of draft_tokens {(B, K)}, got {self.copied.shape}")
        if self.num_drafts.size == 0:
            self.num_drafts = np.full(B, K, np.int32)
        check_rows(owner, B, self, ("num_drafts",))
        if B and (self.num_drafts.min() < 0 or self.num_drafts.max() > K):
            raise ProtocolError(f"{owner}.num_drafts must lie in [0, K={K}], got {self.num_drafts.tolist()}")
        if B and not set(self.fallback.tolist()) <= set(_FALLBACK_OF_CODE):
            raise ProtocolError(f"{owner}.fallback values must be FALLBACK_CODES {sorted(_FALLBACK_OF_CODE)}, got "
                                f"{self.fallback.tolist()}")
        if np.any(self.hit & (self.fallback != FALLBACK_CODES[None])):
            raise ProtocolError(f"{owner}: a row that hit the cache must have no fallback, code 0")
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

    def fallbacks(self) -> list[Fallback | None]:
        """The fallback that served each row (None: the row hit the cache)."""
        return [_FALLBACK_OF_CODE[code] for code in self.fallback.tolist()]

    def dense_probs(self, vocab_size: int | None = None, out: np.ndarray | None = None) -> np.ndarray:
        """[B, K, V] float32, zeros in the rows that sent no probabilities (see `scatter_prob_rows`)."""
        return scatter_prob_rows(self.prob_rows, self.probs, self.batch_size, vocab_size, out)


@dataclass(eq=False)
class ReleaseMsg(WireMessage):
    """Forget these sequences (finished, aborted or preempted) and free their draft KV."""

    COMMAND: ClassVar[Command] = Command.RELEASE
    ARRAYS: ClassVar[dict[str, tuple[np.dtype, int]]] = {"seq_ids": (I64, 1)}

    seq_ids: np.ndarray  # [B] int64


@dataclass(eq=False)
class ShutdownMsg(WireMessage):
    COMMAND: ClassVar[Command] = Command.SHUTDOWN


@dataclass(eq=False)
class HelloMsg(WireMessage):
    """An engine's first message to a remote draft server (after authentication): the session's settings as
    JSON (``remote/session.py: SessionSettings``); the server answers READY or ERROR."""

    COMMAND: ClassVar[Command] = Command.HELLO
    settings: str = "{}"

    def _validate(self) -> None:
        if not isinstance(self.settings, str):
            raise ProtocolError("HelloMsg.settings must be a JSON string")


@dataclass(eq=False)
class ReadyMsg(WireMessage):
    """The worker has started and serves requests (its first message); `info` is free-form."""

    COMMAND: ClassVar[Command] = Command.READY
    info: dict[str, Scalar] = field(default_factory=dict)

    def _validate(self) -> None:
        self.info = {str(k): check_scalar(str(k), v) for k, v in self.info.items()}

    def _scalar_fields(self) -> dict[str, Scalar]:
        return dict(self.info)

    @classmethod
    def _from_frame(cls, frame: Frame) -> ReadyMsg:
        if frame.arrays:
            raise ProtocolError(f"malformed READY message: unexpected arrays {sorted(frame.arrays)}")
        return cls(info=dict(frame.fields))


@dataclass(eq=False)
class ErrorMsg(WireMessage):
    """The worker failed to serve a request; the client raises with this text."""

    COMMAND: ClassVar[Command] = Command.ERROR
    message: str = ""
    traceback: str = ""

    def _validate(self) -> None:
        if not isinstance(self.message, str) or not isinstance(self.traceback, str):
            raise ProtocolError("ErrorMsg.message and ErrorMsg.traceback must be strings")


Message = Union[PrefillMsg, SpeculateMsg, SpeculationMsg, ReleaseMsg, ShutdownMsg, HelloMsg, ReadyMsg, ErrorMsg]

_MESSAGE_TYPES: dict[Command, type[WireMessage]] = {
    cls.COMMAND: cls
    for cls in (PrefillMsg, SpeculateMsg, SpeculationMsg, ReleaseMsg, ShutdownMsg, HelloMsg, ReadyMsg, ErrorMsg)
}


def decode_message(data: bytes | bytearray | memoryview) -> Message:
    """The typed message in `data`; ProtocolError (a ValueError) if it is truncated, unknown or malformed."""
    frame = decode_frame(data)
    return _MESSAGE_TYPES[frame.command]._from_frame(frame)  # type: ignore[no-any-return]


def send_message(conn: Connection, message: Message) -> None:
    conn.send_bytes(message.pack())


def recv_message(conn: Connection) -> Message:
    return decode_message(conn.recv_bytes())
