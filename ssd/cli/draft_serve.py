"""``ssd draft-serve``: run SSD's draft as a server (``ssd/speculative/async_draft/remote/server.py``)."""

from __future__ import annotations

import argparse
import signal
import sys

from ssd.options import Dtype, SpecMethod, WeightFormat
from ssd.speculative.async_draft.remote.channel import TOKEN_ENV


def add_draft_serve_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True,
                        help="the draft model folder (e.g. models/smollm2-draft), or an EAGLE-3 head's with --target")
    parser.add_argument("--target", default=None,
                        help="with an EAGLE-3 head: the target checkpoint folder (its embedding and tokenizer; "
                             "engines must run this target)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to listen on (default loopback; 0.0.0.0 for every interface)")
    parser.add_argument("--port", type=int, default=0, help="port to listen on (default 0: a free port, printed)")
    parser.add_argument("--port-file", default=None, help="also write the port listened on to this file")
    parser.add_argument("--device", default="cpu", help="the draft's device (cpu, cuda, cuda:1, ...)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads of the draft (default: its cores)")
    parser.add_argument("--cpus", default=None, help="comma list of cores to run on (default: all)")
    parser.add_argument("--dtype", default=None, choices=Dtype.values(),
                        help="the draft's dtype (default: auto for its device)")
    parser.add_argument("--weight-format", default=WeightFormat.AUTO.value, choices=WeightFormat.values(),
                        help="the draft's weight format (as ssd generate's --draft-weight-format)")
    parser.add_argument("--max-seqs", type=int, default=64,
                        help="sequences of all engines together: each engine's session reserves its max_num_seqs, "
                             "and one that would pass this is refused (default 64)")
    parser.add_argument("--token", default=None,
                        help=f"the token engines must present (default: the {TOKEN_ENV} environment variable, "
                             "which keeps it out of the process list); required")


def cmd_draft_serve(args: argparse.Namespace) -> int:
    from ssd.speculative.async_draft.remote.channel import token_bytes
    from ssd.speculative.async_draft.remote.server import DraftServer, ServerOptions, describe_draft

    token = token_bytes(args.token)
    cpus = None if args.cpus is None else [int(c) for c in args.cpus.split(",") if c.strip()]
    draft = describe_draft(args.model, args.device, args.threads, args.dtype, args.weight_format, args.target)
    server = DraftServer(draft, ServerOptions(token=token, host=args.host, port=args.port, max_seqs=args.max_seqs,
                                              cpus=cpus))
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: server.shutdown())
    if args.port_file:
        with open(args.port_file, "w", encoding="utf-8") as f:
            f.write(f"{server.address[1]}\n")
    print(f"draft server for {args.model} listening at {server.url}; engines connect with "
          f'speculative_config={{"method": "{SpecMethod.SSD.value}", "draft_url": "{server.url}"}}', flush=True)
    server.serve_forever()
    print(f"draft server stopped after {server.sessions_served} session(s)", file=sys.stderr)
    return 0
