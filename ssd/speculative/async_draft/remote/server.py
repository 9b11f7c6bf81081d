"""``ssd draft-serve``: SSD's draft worker as a server that engines on other machines connect to.

A session per engine connection: the peer authenticates with the shared token (``channel.authenticate``) and
sends HELLO with its settings (``session.SessionSettings``); the server checks them against its draft (the
vocabulary above all) and admits the session if the sequences it may run (its ``max_num_seqs``) fit the
server's bound beside the other sessions', else refuses it with a clear ERROR. An admitted session runs in a
process of its own (``run_session``): it builds the draft engine the settings and the server's model and
hardware describe, answers READY, and runs the same :class:`DraftWorker` loop a local worker runs, over the
socket. So several engines share one draft server, each with its own sequences, draft KV and speculation
cache, and one session's failure touches no other. A session ends when its engine sends SHUTDOWN or its
connection closes; a peer without the token is dropped before it can send a message, and logged.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import socket
import threading
import time
from dataclasses import dataclass, replace

from ssd.models.eagle3 import is_eagle3_head
from ssd.models.loader import load_arch_config
from ssd.speculative.async_draft.remote.channel import AuthenticationError, SocketChannel, authenticate, listen
from ssd.speculative.async_draft.remote.session import ServerDraft, SessionSettings, head_layers, worker_config
from ssd.speculative.async_draft.wire import protocol as wire
from ssd.speculative.async_draft.worker import WorkerConfig, run_draft_worker
from ssd.speculative.draft_fit import vocabulary_digest
from ssd.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerOptions:
    """How the server listens, whom it lets in and how much it takes on (the draft itself: :class:`ServerDraft`)."""

    token: bytes
    host: str = "127.0.0.1"
    port: int = 0  # 0: a free port (DraftServer.address says which)
    max_seqs: int = 64  # sequences of all sessions together (each engine declares its max_num_seqs)
    cpus: list[int] | None = None  # cores the sessions run on (default: all this process may use)
    handshake_timeout_s: float = 10.0  # authentication and HELLO must finish within this


def describe_draft(model: str, device: str = "cpu", threads: int | None = None, dtype: str | None = None,
                   weight_format: str = "auto", target: str | None = None) -> ServerDraft:
    """The server's draft, checked before it listens: a draft model folder with a tokenizer, or an EAGLE-3 head
    with ``target``, the target checkpoint folder whose embedding and tokenizer it reads (engines must run that
    target: they send its features)."""
    if is_eagle3_head(model):
        if target is None:
            raise ValueError(f"{model} is an EAGLE-3 head: give --target, the folder of the target it drafts for "
                             "(the head reads its embedding and tokenizer)")
        load_arch_config(target)
    else:
        load_arch_config(model)  # a missing folder or a broken config.json is reported as such
        if target is not None:
            raise ValueError(f"--target is for EAGLE-3 heads; {model} is a draft model")
    tokenizer = Tokenizer(target or model)
    return ServerDraft(model=model, device=device, threads=threads, dtype=dtype, weight_format=weight_format,
                       vocab_digest=vocabulary_digest(tokenizer), tokens=len(tokenizer), target=target)


@dataclass
class _Session:
    process: mp.process.BaseProcess
    peer: str
    seqs: int  # sequences reserved for it (its engine's max_num_seqs)


class DraftServer:
    """Listens at construction (``address``); :meth:`serve_forever` admits sessions until :meth:`shutdown`."""

    def __init__(self, draft: ServerDraft, options: ServerOptions) -> None:
        if not options.token:
            raise ValueError("a draft server needs a shared token")
        if options.max_seqs < 1:
            raise ValueError(f"max_seqs must be at least 1, got {options.max_seqs}")
        self.draft, self.options = draft, options
        self._listener = listen(options.host, options.port)
        self._listener.settimeout(0.5)  # wakes the accept loop to reap finished sessions
        self.address: tuple[str, int] = self._listener.getsockname()[:2]
        self._stopping = threading.Event()
        self._lock = threading.Lock()  # guards _sessions: handshakes admit from their own threads
        self._sessions: list[_Session] = []
        self.sessions_served = 0

    @property
    def url(self) -> str:
        host, port = self.address
        return f"tcp://{host}:{port}"

    def serve_forever(self) -> None:
        logger.info("draft server for %s on %s serving at %s (at most %d sequences)", self.draft.model,
                    self.draft.device, self.url, self.options.max_seqs)
        try:
            while not self._stopping.is_set():
                self._reap()
                try:
                    sock, _ = self._listener.accept()
                except TimeoutError:
                    continue
                except OSError:
                    break  # the listener closed: shutting down
                sock.settimeout(None)
                threading.Thread(target=self._handshake, args=(sock,), name="ssd-draft-handshake",
                                 daemon=True).start()
        finally:
            self._close_listener()
            self._stop_sessions()

    def shutdown(self) -> None:
        """Stop accepting and end every session (their engines decode on without speculation); safe from a
        signal handler or another thread."""
        self._stopping.set()
        self._close_listener()

    @property
    def active_sessions(self) -> int:
        with self._lock:
            return sum(s.process.is_alive() for s in self._sessions)

    def _close_listener(self) -> None:
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes a blocking accept
        except OSError:
            pass
        self._listener.close()

    def _reap(self) -> None:
        with self._lock:
            for session in [s for s in self._sessions if not s.process.is_alive()]:
                session.process.join()
                self._sessions.remove(session)
                logger.info("session of %s ended (exit code %s)", session.peer, session.process.exitcode)

    def _stop_sessions(self) -> None:
        with self._lock:
            sessions, self._sessions = self._sessions, []
        for session in sessions:
            session.process.terminate()
        for session in sessions:
            session.process.join(timeout=10)
            if session.process.is_alive():
                session.process.kill()
                session.process.join()

    def _taken(self) -> int:
        """Sequences reserved by sessions still running (the caller holds the lock)."""
        return sum(s.seqs for s in self._sessions if s.process.is_alive())

    def _wait_for_room(self, seqs: int, grace_s: float = 2.0) -> None:
        """Give sessions that are ending (their engine just sent SHUTDOWN) a moment to exit before refusing."""
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline and not self._stopping.is_set():
            with self._lock:
                if self._taken() + seqs <= self.options.max_seqs:
                    return
            time.sleep(0.05)

    # ------------------------------------------------------------------ one connection
    def _handshake(self, sock: socket.socket) -> None:
        """Authenticate, read HELLO, admit: start the session's process, or refuse with the reason."""
        channel = SocketChannel(sock)
        try:
            authenticate(channel, self.options.token, server=True, timeout_s=self.options.handshake_timeout_s)
            channel.settimeout(self.options.handshake_timeout_s)
            hello = wire.decode_message(channel.recv_bytes())
            received = time.monotonic()
            if not isinstance(hello, wire.HelloMsg):
                raise ValueError(f"expected HELLO first, got {type(hello).__name__}")
            settings = SessionSettings.from_json(hello.settings)
            config = replace(worker_config(settings, self.draft), cpu_affinity=self.options.cpus,
                             log_level=logging.getLogger().level)
            layers = head_layers(config)
        except AuthenticationError as exc:
            logger.warning("refused a connection: %s", exc)
            channel.close()
            return
        except (EOFError, OSError) as exc:
            logger.warning("the engine at %s left before its session started: %s", channel.peer, exc)
            channel.close()
            return
        except Exception as exc:  # a foreign protocol version, settings that do not fit this draft, ...
            logger.error("refused the session of %s: %s", channel.peer, exc)
            _refuse(channel, f"draft server refused the session: {exc}")
            return
        self._wait_for_room(settings.max_num_seqs)
        with self._lock:
            if self._stopping.is_set():
                _refuse(channel, "draft server shutting down")
                return
            taken = self._taken()
            if taken + settings.max_num_seqs > self.options.max_seqs:
                logger.warning("refused the session of %s: %d sequences asked, %d of %d taken", channel.peer,
                               settings.max_num_seqs, taken, self.options.max_seqs)
                _refuse(channel, f"draft server full: it serves at most {self.options.max_seqs} sequences, "
                                 f"{taken} are taken and this engine may run {settings.max_num_seqs}")
                return
            channel.settimeout(None)  # blocking, for the session's process too (they share the socket's state)
            try:
                process = mp.get_context("spawn").Process(
                    target=run_session, name="ssd-draft-session", daemon=True,
                    args=(sock, config, layers, received))
                process.start()
            except Exception as exc:
                logger.exception("cannot start a session process")
                _refuse(channel, f"draft server cannot start a session: {exc!r}")
                return
            self._sessions.append(_Session(process, channel.peer, settings.max_num_seqs))
            self.sessions_served += 1
        logger.info("serving the engine at %s (%d sequences) in process %d", channel.peer, settings.max_num_seqs,
                    process.pid)
        sock.close()  # the session's process holds its own copy


def run_session(sock: socket.socket, config: WorkerConfig, layers: tuple[int, ...] | None, received: float) -> None:
    """A session's process: the draft worker over the session's socket. READY carries the time since HELLO
    arrived (the engine tells its link's round trip from the server's work by it) and an EAGLE-3 head's feature
    ``layers``, which the engine then sends. The process does not outlive its server."""
    threading.Thread(target=_exit_with, args=(os.getppid(),), name="ssd-draft-session-watch", daemon=True).start()
    channel = SocketChannel(sock)
    channel.settimeout(None)

    def ready_info() -> dict[str, wire.Scalar]:
        info: dict[str, wire.Scalar] = {"device": config.device, "setup_s": time.monotonic() - received}
        if layers is not None:
            info["feature_layers"] = ",".join(map(str, layers))
        return info

    try:
        run_draft_worker(channel, config, ready_info)
    finally:
        channel.close()


def _exit_with(server_pid: int, period_s: float = 0.5) -> None:
    """A session does not outlive its server (killed or not): its engine then sees the link close."""
    while os.getppid() == server_pid:
        time.sleep(period_s)
    os._exit(1)


def _refuse(channel: SocketChannel, reason: str) -> None:
    try:
        channel.send_bytes(wire.ErrorMsg(reason).pack())
    except OSError:
        pass
    channel.close()
