"""``ssd serve``: the OpenAI-compatible HTTP server under uvicorn.

The engine (and, with ``--method ssd``, its draft worker process) is built before the socket opens, so a
bad model path or option fails at once with a clear message instead of after the server claims the port.
``--port 0`` picks a free port; the address actually bound is printed on stdout as the first line
(``ssd: serving MODEL at http://HOST:PORT/v1``) for scripts and tests to read.
"""

from __future__ import annotations

import argparse
import logging

from ssd.cli.common import add_engine_args, engine_kwargs

logger = logging.getLogger(__name__)


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser)
    g = parser.add_argument_group("server (sampling flags above are ignored: each request carries its own)")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    g.add_argument("--port", type=int, default=8000, help="TCP port; 0 picks a free one")
    g.add_argument("--served-model-name", default=None, help="model id clients pass (default: the model path)")
    g.add_argument("--max-waiting-requests", type=int, default=256,
                   help="requests that may wait beyond --max-num-seqs before new ones get 503 (default 256)")
    g.add_argument("--max-body-bytes", type=int, default=8 * 1024 * 1024, help="largest request body (413 above)")
    g.add_argument("--uvicorn-log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"])


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from ssd.config import EngineConfig
    from ssd.engine import LLMEngine
    from ssd.server.app import bind_socket, create_app

    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    engine = LLMEngine(EngineConfig(**engine_kwargs(args)))
    try:
        app = create_app(
            engine,
            args.served_model_name,
            max_waiting_requests=args.max_waiting_requests,
            max_body_bytes=args.max_body_bytes,
        )
        sock = bind_socket(args.host, args.port)
        port = sock.getsockname()[1]
        host = f"[{args.host}]" if ":" in args.host else args.host
        print(f"ssd: serving {app.state.model_name} at http://{host}:{port}/v1", flush=True)
        server = uvicorn.Server(
            uvicorn.Config(app, log_level=args.uvicorn_log_level, timeout_graceful_shutdown=5, access_log=False)
        )
        server.run(sockets=[sock])
    finally:
        engine.shutdown()  # idempotent; the app's shutdown normally did it already
    return 0
