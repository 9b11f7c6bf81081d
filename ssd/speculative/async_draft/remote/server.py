"""``ssd draft-serve``: SSD's draft worker as a server that engines on other machines connect to.

A session per engine connection: the peer authenticates with the shared token (``channel.authenticate``),
sends HELLO with its settings (``session.SessionSettings``), and the server builds the draft engine those
settings and its own model and hardware describe, answers READY, and runs the same :class:`DraftWorker` loop as
a local worker process, over the socket. The session ends when the engine sends SHUTDOWN or its connection
closes; the server then frees the draft's memory and waits for the next engine.

One engine is served at a time for now: a connection that arrives during a session is authenticated and
refused with a clear ERROR ("busy"); its engine decodes without speculation. A peer without the token is
dropped before it can send a message, and logged.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import time
from dataclasses import dataclass

import torch

from ssd.models.eagle3 import is_eagle3_head
from ssd.models.loader import load_arch_config
from ssd.speculative.async_draft.planning.build_clock import BuildClock
from ssd.speculative.async_draft.remote.channel import AuthenticationError, SocketChannel, authenticate, listen
from ssd.speculative.async_draft.remote.session import ServerDraft, SessionSettings, worker_config
from ssd.speculative.async_draft.wire import protocol as wire
from ssd.speculative.async_draft.worker import DraftWorker, FanOutPlanner, build_draft_engine
from ssd.speculative.draft_fit import vocabulary_digest
from ssd.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerOptions:
    """How the server listens and who it lets in (the draft itself: :class:`ServerDraft`)."""

    token: bytes
    host: str = "127.0.0.1"
    port: int = 0  # 0: a free port (DraftServer.address says which)
    cpus: list[int] | None = None  # cores to run on (default: all this process may use)
    handshake_timeout_s: float = 10.0  # authentication and HELLO must finish within this


def describe_draft(model: str, device: str = "cpu", threads: int | None = None, dtype: str | None = None,
                   weight_format: str = "auto") -> ServerDraft:
    """The server's draft, checked before it listens: a draft model folder with a tokenizer (EAGLE-3 heads
    read the target's features and embedding, which a remote session does not carry yet)."""
    load_arch_config(model)  # a missing folder or a broken config.json is reported as such
    if is_eagle3_head(model):
        raise ValueError(f"{model} is an EAGLE-3 head; a draft server runs a draft model (heads need the "
                         "target's features and embedding, which a remote session does not carry yet)")
    tokenizer = Tokenizer(model)
    return ServerDraft(model=model, device=device, threads=threads, dtype=dtype, weight_format=weight_format,
                       vocab_digest=vocabulary_digest(tokenizer), tokens=len(tokenizer))


class DraftServer:
    """Listens at construction (``address``); :meth:`serve_forever` serves sessions until :meth:`shutdown`."""

    def __init__(self, draft: ServerDraft, options: ServerOptions) -> None:
        if not options.token:
            raise ValueError("a draft server needs a shared token")
        self.draft, self.options = draft, options
        if options.cpus and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, options.cpus)
        threads = draft.threads or (len(options.cpus) if options.cpus else None)
        if threads:
            torch.set_num_threads(threads)
        self._listener = listen(options.host, options.port)
        self.address: tuple[str, int] = self._listener.getsockname()[:2]
        self._pending: queue.Queue[SocketChannel] = queue.Queue()
        self._stopping = threading.Event()
        self._busy = threading.Event()
        self._session: SocketChannel | None = None
        self.sessions_served = 0
        self._acceptor = threading.Thread(target=self._accept_loop, name="ssd-draft-accept", daemon=True)

    @property
    def url(self) -> str:
        host, port = self.address
        return f"tcp://{host}:{port}"

    def serve_forever(self) -> None:
        logger.info("draft server for %s on %s serving at %s", self.draft.model, self.draft.device, self.url)
        self._acceptor.start()
        try:
            while not self._stopping.is_set():
                try:
                    channel = self._pending.get(timeout=0.2)
                except queue.Empty:
                    continue
                self._serve_session(channel)
        finally:
            self._close_listener()
            self._acceptor.join(timeout=5)
            while not self._pending.empty():
                self._pending.get_nowait().close()

    def shutdown(self) -> None:
        """Stop accepting and end the current session (its engine decodes on without speculation); safe from
        another thread or a signal handler."""
        self._stopping.set()
        self._close_listener()
        session = self._session
        if session is not None:
            session.close()  # wakes the session's blocking receive

    def _close_listener(self) -> None:
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes a blocking accept
        except OSError:
            pass
        self._listener.close()

    # ------------------------------------------------------------------ connections
    def _accept_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return  # the listener closed: shutting down
            channel = SocketChannel(sock)
            try:
                authenticate(channel, self.options.token, server=True, timeout_s=self.options.handshake_timeout_s)
            except AuthenticationError as exc:
                logger.warning("refused a connection: %s", exc)
                channel.close()
                continue
            if self._busy.is_set() or not self._pending.empty():
                _refuse(channel, "draft server busy: it serves one engine at a time")
                continue
            self._busy.set()
            self._pending.put(channel)

    def _serve_session(self, channel: SocketChannel) -> None:
        peer = channel.peer
        self._session = channel
        try:
            worker = self._open_session(channel)
            if worker is None:
                return
            self.sessions_served += 1
            logger.info("serving the engine at %s", peer)
            try:
                worker.run()
                logger.info("the engine at %s ended its session", peer)
            except (EOFError, OSError):
                if not self._stopping.is_set():
                    logger.warning("lost the engine at %s; session ended", peer)
            except Exception as exc:  # tell the engine (it decodes on without speculation), keep serving others
                logger.exception("session with %s failed", peer)
                _refuse(channel, f"draft server failed: {exc!r}")
        finally:
            self._session = None
            channel.close()
            self._busy.clear()

    def _open_session(self, channel: SocketChannel) -> DraftWorker | None:
        """HELLO -> the session's draft engine, READY; None (after an ERROR naming the reason) if refused."""
        channel.settimeout(self.options.handshake_timeout_s)
        try:
            hello = wire.decode_message(channel.recv_bytes())
            started = time.perf_counter()
            if not isinstance(hello, wire.HelloMsg):
                raise ValueError(f"expected HELLO first, got {type(hello).__name__}")
            config = worker_config(SessionSettings.from_json(hello.settings), self.draft)
            engine = build_draft_engine(config)
        except (EOFError, OSError) as exc:
            logger.warning("the engine at %s left before its session started: %s", channel.peer, exc)
            return None
        except Exception as exc:  # a foreign protocol version, settings that do not fit this draft, ...
            logger.error("refused the session of %s: %s", channel.peer, exc)
            _refuse(channel, f"draft server refused the session: {exc}")
            return None
        channel.settimeout(None)
        setup_s = time.perf_counter() - started  # the engine subtracts it from its wait: the link's round trip
        channel.send_bytes(wire.ReadyMsg(info={"model": self.draft.model, "device": self.draft.device,
                                               "setup_s": setup_s}).pack())
        spec = config.spec
        return DraftWorker(channel, engine, FanOutPlanner(spec),
                           BuildClock(channel.poll) if spec.interruptible_build else None)


def _refuse(channel: SocketChannel, reason: str) -> None:
    try:
        channel.send_bytes(wire.ErrorMsg(reason).pack())
    except OSError:
        pass
    channel.close()
