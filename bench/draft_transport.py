"""Round-trip time of the transports a remote SSD draft could use, measured side by side (issue 30).

An echo process answers every message with one of the same size; the client times request -> reply for the
sizes SSD's messages have (a greedy SPECULATE / SPECULATION at batch 1 is a few hundred bytes; a PREFILL of a
long prompt or an EAGLE-3 round's features tens of kilobytes; a sampled round's draft probabilities about a
megabyte at K = 4 and a 49k vocabulary). Transports:

- ``pipe``: ``multiprocessing.Pipe``, today's local worker link (a Unix socket pair);
- ``mp-tcp``: ``multiprocessing.connection`` Listener / Client over TCP on loopback, HMAC-authenticated with
  an authkey, with TCP_NODELAY;
- ``mp-tcp-nagle``: the same without TCP_NODELAY (the library's default);
- ``socket``: the framed, token-authenticated socket channel ``ssd draft-serve`` speaks
  (``ssd/speculative/async_draft/remote/channel.py``: one system call per small message, TCP_NODELAY);
- ``zmq``: pyzmq PAIR sockets over TCP on loopback (only if pyzmq is installed).

    python bench/draft_transport.py --iters 2000 --json bench/results/draft_transport.json
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import secrets
import socket
import statistics
import sys
import time
from multiprocessing.connection import Client, Listener

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.machine import machine_info  # noqa: E402
from ssd.speculative.async_draft.remote.channel import SocketChannel, authenticate, listen  # noqa: E402

SIZES = (256, 4096, 65536, 1 << 20)


def _nodelay(conn) -> None:
    sock = socket.socket(fileno=os.dup(conn.fileno()))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.close()


def _echo_conn(conn) -> None:
    try:
        while True:
            conn.send_bytes(conn.recv_bytes())
    except (EOFError, OSError):
        pass


def _pipe_echo(conn) -> None:
    _echo_conn(conn)


def _tcp_echo(address, authkey: bytes, nodelay: bool, ready) -> None:
    with Listener(address, authkey=authkey) as listener:
        ready.send(listener.address)
        conn = listener.accept()
        if nodelay:
            _nodelay(conn)
        _echo_conn(conn)


def _socket_echo(token: bytes, ready) -> None:
    server = listen("127.0.0.1", 0)
    ready.send(server.getsockname()[1])
    sock, _ = server.accept()
    channel = SocketChannel(sock)
    authenticate(channel, token, server=True)
    _echo_conn(channel)
    channel.close()
    server.close()


def _zmq_echo(ready) -> None:
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    ready.send(port)
    try:
        while True:
            msg = sock.recv(copy=False)
            if len(msg) == 0:
                break
            sock.send(msg, copy=False)
    finally:
        sock.close(linger=0)
        ctx.term()


def _payloads() -> dict[int, bytes]:
    return {size: secrets.token_bytes(size) for size in SIZES}


def _round_trips(send, recv, payload: bytes, iters: int) -> list[float]:
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        send(payload)
        reply = recv()
        times.append(time.perf_counter() - start)
        assert len(reply) == len(payload)
    return times


class Link:
    """One transport's client end, its echo process started."""

    def __init__(self, send, recv, close) -> None:
        self.send, self.recv, self.close = send, recv, close


def open_pipe(ctx) -> Link:
    parent, child = ctx.Pipe(duplex=True)
    proc = ctx.Process(target=_pipe_echo, args=(child,), daemon=True)
    proc.start()
    child.close()
    return Link(parent.send_bytes, parent.recv_bytes, lambda: (parent.close(), proc.join(5)))


def open_mp_tcp(ctx, nodelay: bool) -> Link:
    authkey = secrets.token_bytes(32)
    ready, child = ctx.Pipe()
    proc = ctx.Process(target=_tcp_echo, args=(("127.0.0.1", 0), authkey, nodelay, child), daemon=True)
    proc.start()
    conn = Client(ready.recv(), authkey=authkey)
    if nodelay:
        _nodelay(conn)
    return Link(conn.send_bytes, conn.recv_bytes, lambda: (conn.close(), proc.join(5)))


def open_socket(ctx) -> Link:
    token = secrets.token_bytes(16)
    ready, child = ctx.Pipe()
    proc = ctx.Process(target=_socket_echo, args=(token, child), daemon=True)
    proc.start()
    channel = SocketChannel(socket.create_connection(("127.0.0.1", ready.recv())))
    authenticate(channel, token, server=False)
    return Link(channel.send_bytes, channel.recv_bytes, lambda: (channel.close(), proc.join(5)))


def open_zmq(ctx) -> Link:
    import zmq

    ready, child = ctx.Pipe()
    proc = ctx.Process(target=_zmq_echo, args=(child,), daemon=True)
    proc.start()
    zctx = zmq.Context()
    sock = zctx.socket(zmq.PAIR)
    sock.connect(f"tcp://127.0.0.1:{ready.recv()}")

    def close() -> None:
        sock.send(b"")
        proc.join(5)
        sock.close(linger=0)
        zctx.term()

    return Link(lambda b: sock.send(b, copy=False), lambda: sock.recv(copy=False).buffer, close)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=20, help="bursts per transport, taking turns")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    links = {"pipe": open_pipe(ctx), "mp-tcp": open_mp_tcp(ctx, nodelay=True),
             "mp-tcp-nagle": open_mp_tcp(ctx, nodelay=False), "socket": open_socket(ctx)}
    try:
        links["zmq"] = open_zmq(ctx)
    except ImportError:
        pass
    # The host's noise drifts over seconds (frequency, other load): transports take turns in short bursts, and
    # each one's median is over all its bursts.
    payloads = _payloads()
    times: dict[str, dict[int, list[float]]] = {name: {s: [] for s in SIZES} for name in links}
    burst = max(10, args.iters // args.rounds)
    for name, link in links.items():  # warm-up
        for payload in payloads.values():
            _round_trips(link.send, link.recv, payload, 20)
    for _ in range(args.rounds):
        for name, link in links.items():
            for size, payload in payloads.items():
                times[name][size] += _round_trips(link.send, link.recv, payload, burst)
    for link in links.values():
        link.close()
    results: dict[str, object] = {
        name: {s: {"median_us": round(statistics.median(t) * 1e6, 1),
                   "p90_us": round(sorted(t)[int(0.9 * len(t))] * 1e6, 1)} for s, t in by_size.items()}
        for name, by_size in times.items()
    }
    if "zmq" not in links:
        results["zmq"] = "pyzmq not installed"
    print(f"{'transport':14s}" + "".join(f"{s:>14d} B" for s in SIZES) + "   (median round trip, us)")
    for name, by_size in results.items():
        if isinstance(by_size, str):
            print(f"{name:14s} {by_size}")
            continue
        print(f"{name:14s}" + "".join(f"{by_size[s]['median_us']:>16.1f}" for s in SIZES))
    if args.json:
        out = {"machine": machine_info(), "command": "python " + " ".join(sys.argv), "iters": args.iters,
               "round_trip": {name: by_size if isinstance(by_size, str) else {str(s): v for s, v in by_size.items()}
                              for name, by_size in results.items()}}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
