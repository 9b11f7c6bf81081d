"""How the SSD client reaches its draft: a worker process it spawns on this host (the default), or a draft
server elsewhere (``ssd draft-serve``, ``speculative_config["draft_url"]``). Either way the client gets a
connection with ``send_bytes`` / ``recv_bytes`` / ``poll`` and speaks the same wire protocol over it; the
link only starts and stops the other end."""

from __future__ import annotations

import multiprocessing as mp
import time
from typing import Protocol

from ssd.speculative.async_draft.remote.channel import SocketChannel, connect
from ssd.speculative.async_draft.remote.session import SessionSettings
from ssd.speculative.async_draft.wire import protocol as wire
from ssd.speculative.async_draft.worker import WorkerConfig, run_draft_worker


class Connection(Protocol):
    def send_bytes(self, data: bytes) -> None: ...

    def recv_bytes(self) -> bytes | bytearray: ...

    def poll(self, timeout: float | None = 0.0) -> bool: ...

    def close(self) -> None: ...


class DraftLink(Protocol):
    conn: Connection
    name: str  # how log lines name the other end
    hello_sent_at: float | None  # a remote session: when HELLO left (READY reports the server's setup time)

    def alive(self) -> bool: ...

    def stop(self, graceful: bool) -> None:
        """``graceful``: the other end was told to shut down; give it time. Else end the link at once."""

    @property
    def pid(self) -> int | None: ...


class LocalDraftLink:
    """The draft worker as a child process, reached through a pipe; it sends READY (or ERROR) once started."""

    name = "draft worker"
    hello_sent_at = None

    def __init__(self, config: WorkerConfig) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe(duplex=True)
        self._process = ctx.Process(target=run_draft_worker, args=(child, config), name="ssd-draft", daemon=True)
        self._process.start()
        child.close()

    def alive(self) -> bool:
        return self._process.is_alive()

    def stop(self, graceful: bool) -> None:
        """A failed worker (dead, hung, stopped) is killed at once: waiting would only stall the engine, and
        SIGTERM stays pending on a stopped process."""
        process = self._process
        if graceful:
            process.join(timeout=5)
            if process.is_alive():
                process.terminate()
                process.join(timeout=5)
        if process.is_alive():
            process.kill()
        process.join()
        self.conn.close()

    @property
    def pid(self) -> int | None:
        return self._process.pid


class RemoteDraftLink:
    """A session with a draft server: an authenticated socket, then HELLO with the session's settings; the
    server answers READY (or ERROR). Every blocking send or receive is bounded by ``timeout_s``."""

    def __init__(self, url: str, token: bytes, settings: SessionSettings, timeout_s: float) -> None:
        self.name = f"draft server at {url}"
        self.conn: SocketChannel = connect(url, token, timeout_s)
        self.conn.settimeout(timeout_s)
        self.hello_sent_at = time.perf_counter()
        self.conn.send_bytes(wire.HelloMsg(settings.to_json()).pack())

    def alive(self) -> bool:
        return not self.conn.closed

    def stop(self, graceful: bool) -> None:
        """The server keeps running; its session ends when the socket closes (SHUTDOWN or not)."""
        self.conn.close()

    @property
    def pid(self) -> int | None:
        return None
