"""A draft server (``ssd draft-serve``'s) in a child process for tests: started on a free loopback port."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
from pathlib import Path


def _serve(model: str, token: bytes, conn, handshake_timeout_s: float, max_seqs: int, port: int,
           target: str | None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s draft-server %(levelname)s %(name)s: %(message)s")
    from ssd.speculative.async_draft.remote.server import DraftServer, ServerOptions, describe_draft

    server = DraftServer(describe_draft(model, threads=1, target=target),
                         ServerOptions(token=token, handshake_timeout_s=handshake_timeout_s, max_seqs=max_seqs,
                                       port=port))
    signal.signal(signal.SIGTERM, lambda *_: server.shutdown())
    conn.send(server.url)
    conn.close()
    server.serve_forever()


def proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of a process from /proc (None: it is gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    state, ppid = stat.rsplit(")", 1)[1].split()[:2]  # after the command's name: fields 3 and 4
    return state, int(ppid)


class ServerProcess:
    """``ssd draft-serve`` for ``model`` in a child process; ``url`` once it listens."""

    def __init__(self, model: Path, token: bytes, handshake_timeout_s: float = 10.0, max_seqs: int = 16,
                 port: int = 0, target: Path | None = None) -> None:
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe(duplex=False)
        self.process = ctx.Process(target=_serve, args=(str(model), token, child, handshake_timeout_s, max_seqs, port,
                                                                  None if target is None else str(target)),
                                   name="ssd-draft-server")  # not a daemon: it starts session processes
        self.process.start()
        child.close()
        if not parent.poll(120):
            self.kill()
            raise RuntimeError("the draft server did not start within 120 s")
        self.url: str = parent.recv()

    def session_pids(self) -> list[int]:
        """The server's session processes (its children)."""
        pids = [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]
        return [pid for pid in pids if (proc_stat(pid) or ("", -1))[1] == self.process.pid]

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM (a graceful shutdown); the exit code."""
        if self.process.is_alive():
            os.kill(self.process.pid, signal.SIGTERM)
        self.process.join(timeout)
        return self.process.exitcode

    def kill(self) -> None:
        if self.process.is_alive():
            os.kill(self.process.pid, signal.SIGCONT)  # a stopped process must run to die
            self.process.kill()
        self.process.join(10)
