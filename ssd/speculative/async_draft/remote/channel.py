"""A message channel over TCP for a remote SSD draft, with mutual authentication by a shared token.

:class:`SocketChannel` offers what the SSD client and draft worker use of a `multiprocessing` Connection
(``send_bytes``, ``recv_bytes``, ``poll``, ``close``), so the worker's loop runs unchanged over a pipe or a
socket. Messages are framed by an 8-byte little-endian length; the wire protocol's own frame (magic, version,
command) is inside. Sockets run with TCP_NODELAY (a round's request and reply are small and latency-bound) and
TCP keepalive (a peer that vanished without closing is noticed).

Authentication (:func:`authenticate`), before any protocol message, both ways: each side sends a random
32-byte challenge and must answer the other's with HMAC-SHA256(token, role || challenge), role naming the
side, so neither answer can be replayed to the other side. A peer that does not know the token is refused
before it can send a message. The link is not encrypted: run it on a trusted network or through a tunnel.

Chosen by measurement (``bench/draft_transport.py``): on loopback a framed socket's round trip is as short
as the local pipe's for SSD's few-hundred-byte messages, where ZeroMQ's I/O thread adds ~100-250 us.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import select
import socket
import struct

from ssd.options import parse_draft_url

_LENGTH = struct.Struct("<Q")
MAX_MESSAGE_BYTES = 1 << 31  # a length beyond this is a corrupt or hostile stream, not a message
_SMALL = 1 << 16  # messages up to this size go out as one copy with their length, in one system call
_CHALLENGE_BYTES = 32
TOKEN_ENV = "SSD_DRAFT_TOKEN"


class AuthenticationError(ConnectionError):
    """The peer does not know the shared token (or did not finish the handshake in time)."""


class SocketChannel:
    """Length-framed messages over a connected stream socket."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            _keepalive(sock)
        self.peer = _peer_name(sock)

    def settimeout(self, timeout: float | None) -> None:
        """Bound every blocking send and receive (None: wait forever); a timeout raises ``TimeoutError``."""
        self._sock.settimeout(timeout)

    def send_bytes(self, data: bytes | bytearray | memoryview) -> None:
        n = memoryview(data).nbytes
        if n <= _SMALL:
            self._sock.sendall(_LENGTH.pack(n) + bytes(data))
        else:
            self._sock.sendall(_LENGTH.pack(n))
            self._sock.sendall(data)

    def recv_bytes(self) -> bytearray:
        """The next message; EOFError when the peer closed the connection between messages."""
        header = self._recv_exact(_LENGTH.size, at_boundary=True)
        (n,) = _LENGTH.unpack(header)
        if n > MAX_MESSAGE_BYTES:
            raise ConnectionError(f"peer {self.peer} announced a {n}-byte message; the stream is corrupt")
        return self._recv_exact(n)

    def _recv_exact(self, n: int, at_boundary: bool = False) -> bytearray:
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            count = self._sock.recv_into(view[got:])
            if count == 0:
                if at_boundary and got == 0:
                    raise EOFError(f"peer {self.peer} closed the connection")
                raise ConnectionError(f"peer {self.peer} closed the connection in the middle of a message")
            got += count
        return buf

    def poll(self, timeout: float | None = 0.0) -> bool:
        """Whether a message (or the peer's close) is waiting, after up to ``timeout`` seconds."""
        readable, _, _ = select.select([self._sock], [], [], timeout)
        return bool(readable)

    def fileno(self) -> int:
        return self._sock.fileno()

    def close(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # never connected, or the peer is gone already
        self._sock.close()

    @property
    def closed(self) -> bool:
        return self._sock.fileno() < 0


def _keepalive(sock: socket.socket, idle_s: int = 10, interval_s: int = 5, count: int = 3) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", idle_s), ("TCP_KEEPINTVL", interval_s), ("TCP_KEEPCNT", count)):
        if hasattr(socket, name):  # Linux; elsewhere the system's defaults apply
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, name), value)


def _peer_name(sock: socket.socket) -> str:
    try:
        host, port = sock.getpeername()[:2]
    except (OSError, ValueError):
        return "?"
    return f"{host}:{port}"


def _answer(token: bytes, role: bytes, challenge: bytes) -> bytes:
    return hmac.new(token, role + challenge, hashlib.sha256).digest()


def authenticate(channel: SocketChannel, token: bytes, server: bool, timeout_s: float = 10.0) -> None:
    """Mutual challenge-response over a fresh channel (module docstring); AuthenticationError if the peer's
    answer is wrong, it closes, or the exchange takes longer than ``timeout_s``."""
    if not token:
        raise ValueError("the shared token must not be empty")
    mine, theirs = (b"server", b"client") if server else (b"client", b"server")
    channel.settimeout(timeout_s)
    try:
        challenge = os.urandom(_CHALLENGE_BYTES)
        channel.send_bytes(challenge)
        peer_challenge = bytes(channel.recv_bytes())
        if len(peer_challenge) != _CHALLENGE_BYTES:
            raise AuthenticationError(f"peer {channel.peer} did not send an authentication challenge")
        channel.send_bytes(_answer(token, mine, peer_challenge))
        answer = bytes(channel.recv_bytes())
    except (OSError, EOFError) as exc:  # a refused peer's side sees the connection closed
        raise AuthenticationError(f"authentication with {channel.peer} failed: {exc}") from exc
    finally:
        channel.settimeout(None)
    if not hmac.compare_digest(answer, _answer(token, theirs, challenge)):
        raise AuthenticationError(f"peer {channel.peer} does not know the shared token")


def connect(url: str, token: bytes, timeout_s: float) -> SocketChannel:
    """An authenticated channel to the draft server at ``url``."""
    host, port = parse_draft_url(url)
    sock = socket.create_connection((host, port), timeout=timeout_s)
    channel = SocketChannel(sock)
    try:
        authenticate(channel, token, server=False, timeout_s=timeout_s)
    except BaseException:
        channel.close()
        raise
    return channel


def listen(host: str, port: int, backlog: int = 16) -> socket.socket:
    """A listening TCP socket (port 0: a free port, read back with ``getsockname``)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    return sock


def token_bytes(token: str | None) -> bytes:
    """The shared token: the one given, else the environment's ``SSD_DRAFT_TOKEN``; refused when neither is set."""
    token = token if token else os.environ.get(TOKEN_ENV)
    if not token:
        raise ValueError(f"a remote draft needs a shared token: set {TOKEN_ENV} (or pass it explicitly)")
    return token.encode("utf-8")
