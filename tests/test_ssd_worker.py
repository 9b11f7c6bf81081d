"""The SSD draft worker's dispatch (ssd/speculative/async_draft/worker.py): one handler per message, a clear
error for a message it does not take, SHUTDOWN ends it. The handlers' work is covered end to end by the SSD
tests (tests/test_ssd.py); here the engine and planner are stand-ins."""

from __future__ import annotations

import numpy as np
import pytest

from ssd.speculative.async_draft.wire import protocol as wire
from ssd.speculative.async_draft.worker import DraftWorker


class FakeConn:
    def __init__(self, messages: list) -> None:
        self.inbox = [m.pack() for m in messages]
        self.sent: list = []

    def recv_bytes(self) -> bytes:
        if not self.inbox:
            raise EOFError
        return self.inbox.pop(0)

    def send_bytes(self, data: bytes) -> None:
        self.sent.append(wire.decode_message(data))

    def poll(self) -> bool:
        return bool(self.inbox)


class FakeEngine:
    def __init__(self) -> None:
        self.released: list[int] = []
        self.last_build = type("Build", (), {"num_branches": 0, "seconds": 0.0})()

    def release(self, seq_id: int) -> None:
        self.released.append(seq_id)


def _worker(messages: list) -> tuple[DraftWorker, FakeConn, FakeEngine]:
    conn, engine = FakeConn(messages), FakeEngine()
    return DraftWorker(conn, engine, planner=None, clock=None), conn, engine


def test_release_then_shutdown():
    worker, conn, engine = _worker([wire.ReleaseMsg(seq_ids=np.array([3, 5])), wire.ShutdownMsg()])
    worker.built[3] = object()
    worker.first_round[5] = 2
    worker.run()  # returns at SHUTDOWN
    assert engine.released == [3, 5] and worker.built == {} and worker.first_round == {}
    assert conn.sent == []  # RELEASE is not answered


@pytest.mark.parametrize("message", [wire.ReadyMsg(), wire.ErrorMsg("x")])
def test_a_message_the_worker_does_not_take_is_a_clear_error(message):
    worker, _, _ = _worker([message])
    with pytest.raises(ValueError, match=f"does not handle {type(message).__name__}"):
        worker.run()


def test_a_closed_connection_ends_the_loop_with_eoferror():
    worker, _, _ = _worker([])
    with pytest.raises(EOFError):
        worker.run()
