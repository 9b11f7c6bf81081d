"""A TCP forwarder that delays every byte by a fixed time in each direction: a link of known latency on one host.

For benchmarks where ``tc netem`` is not available (containers without the ``sch_netem`` kernel module or the
privilege to load it). Each direction has a reader thread that timestamps what arrives and a writer thread that
sends it on once ``delay`` has passed since, so the delay is added once per direction without limiting
throughput. Python's sleep overshoots by tens of microseconds, so the effective delay is a little longer than
asked; benchmarks report the round trip measured through it.

    python bench/delay_proxy.py --to 127.0.0.1:7070 --delay-ms 0.5    # prints the port it listens on
"""

from __future__ import annotations

import argparse
import queue
import socket
import threading
import time


def _pump(src: socket.socket, dst: socket.socket, delay_s: float) -> None:
    pending: queue.Queue[tuple[float, bytes] | None] = queue.Queue()

    def read() -> None:
        try:
            while data := src.recv(1 << 20):
                pending.put((time.monotonic(), data))
        except OSError:
            pass
        pending.put(None)

    def write() -> None:
        try:
            while (item := pending.get()) is not None:
                arrived, data = item
                wait = arrived + delay_s - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                dst.sendall(data)
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    for target in (read, write):
        threading.Thread(target=target, daemon=True).start()


def serve(to: tuple[str, int], delay_s: float, listener: socket.socket) -> None:
    while True:
        client, _ = listener.accept()
        upstream = socket.create_connection(to)
        for sock in (client, upstream):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        _pump(client, upstream, delay_s)
        _pump(upstream, client, delay_s)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--to", required=True, help="HOST:PORT to forward to")
    parser.add_argument("--delay-ms", type=float, required=True, help="added one way, in each direction")
    parser.add_argument("--port", type=int, default=0)
    args = parser.parse_args()
    host, port = args.to.rsplit(":", 1)
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", args.port))
    listener.listen(16)
    print(listener.getsockname()[1], flush=True)
    serve((host, int(port)), args.delay_ms / 1e3, listener)


if __name__ == "__main__":
    main()
