"""``ssd`` command: generate, fetch, serve, chat, draft-serve."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import replace

from ssd.cli.chat import add_chat_args, cmd_chat
from ssd.cli.draft_serve import add_draft_serve_args, cmd_draft_serve
from ssd.cli.common import add_engine_args, engine_kwargs, sampling_from_args, serve_as_torchrun_worker
from ssd.cli.serve import add_serve_args, cmd_serve

WARMUP_PROMPT = "Count from one to twenty:"  # not the user's prompts: their prefixes stay uncached


def _cmd_generate(args: argparse.Namespace) -> int:
    from ssd.llm import LLM
    from ssd.outputs import SpecStats
    from ssd.sampling_params import SamplingParams

    prompts = list(args.prompt or [])
    if args.prompts_file:
        with open(args.prompts_file, encoding="utf-8") as f:
            prompts.extend(line.rstrip("\n") for line in f if line.strip())
    if not prompts:
        print("error: give --prompt (repeatable) or --prompts-file", file=sys.stderr)
        return 2
    params = sampling_from_args(args)
    llm = LLM(**engine_kwargs(args))
    try:
        if args.warmup_tokens > 0:  # first calls pay one-time costs (kernel choice, allocation): not timed
            warmup = SamplingParams(temperature=params.temperature, max_tokens=args.warmup_tokens, ignore_eos=True)
            llm.generate([WARMUP_PROMPT], warmup)
        before = replace(llm.engine.spec_stats)  # engine-wide counters (the draft's timings) before the timed run
        start = time.perf_counter()
        if args.chat:
            outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=len(prompts) > 1)
        else:
            outputs = llm.generate(prompts, params, use_tqdm=len(prompts) > 1)
        elapsed = time.perf_counter() - start
        after = replace(llm.engine.spec_stats)
    finally:
        llm.shutdown()
    total_tokens = sum(len(o.token_ids) for o in outputs)
    for prompt, out in zip(prompts, outputs):
        if args.json:
            print(json.dumps({"prompt": prompt, "text": out.text, "finish_reason": out.finish_reason,
                              "num_tokens": len(out.token_ids)}))
        else:
            print(f"=== {prompt!r}\n{out.text}\n[{len(out.token_ids)} tokens, finish={out.finish_reason}]")
    summary = f"{len(outputs)} requests, {total_tokens} tokens in {elapsed:.2f} s ({total_tokens / elapsed:.1f} tok/s)"
    timed = "generation only" if args.warmup_tokens <= 0 else f"generation only, after a {args.warmup_tokens}-token warm-up"
    summary += f" [timed: {timed}; model load not timed]"
    if llm.engine.spec is not None:
        s = SpecStats()  # the timed requests' counters (the warm-up's are left out)
        for out in outputs:
            s.merge(out.spec_stats)
        summary += f"; mean acceptance length {s.mean_acceptance_length:.2f}"
        if s.num_copied_tokens:
            summary += (f", {s.num_copied_tokens / s.num_draft_tokens:.0%} of drafts copied by prompt lookup "
                        f"({s.num_accepted_copied_tokens / s.num_copied_tokens:.0%} accepted)")
        if s.cache_lookups:
            summary += f", SSD cache hit rate {s.cache_hit_rate:.1%}"
        summary += _draft_link_summary(before, after)
    print(summary, file=sys.stderr)
    return 0


def _draft_link_summary(before, after) -> str:
    """SSD's per-round wait for the draft over the timed requests, split into the draft's serving and the rest."""
    rounds = after.draft_rounds - before.draft_rounds
    if rounds <= 0:
        return ""
    wait = (after.draft_reply_wait_s - before.draft_reply_wait_s) / rounds
    serve = (after.draft_serve_s - before.draft_serve_s) / rounds
    rtt = "" if after.draft_link_rtt_s is None else f"; draft server round trip {after.draft_link_rtt_s * 1e3:.2f} ms"
    return (f"; draft reply {wait * 1e3:.2f} ms/round (serving {serve * 1e3:.2f}, link and queue "
            f"{max(0.0, wait - serve) * 1e3:.2f}){rtt}")


def _cmd_fetch(args: argparse.Namespace) -> int:
    from ssd.models.fetch import fetch_default_target

    dtype = "float32" if args.keep_blocks else args.dtype
    path = fetch_default_target(args.cache_dir, dtype=dtype, keep_blocks=args.keep_blocks)
    print(path)
    return 0


def _cmd_import_gguf(args: argparse.Namespace) -> int:
    from ssd.models.gguf_import import convert_gguf

    dtype = "float32" if args.keep_blocks else args.dtype
    try:
        path = convert_gguf(args.gguf, args.out, dtype, overwrite=args.overwrite, keep_blocks=args.keep_blocks)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


KEEP_BLOCKS_HELP = ("keep the file's Q8_0 / Q4_0 / Q4_1 / Q4_K projections as stored (float32 for the rest); the "
                    "folder runs in weight format gguf on CPU, as llama.cpp runs the file")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ssd", description="LLM inference with speculative speculative decoding")
    parser.add_argument("--log-level", default="WARNING", help="logging level (DEBUG, INFO, WARNING, ...)")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for one or more prompts")
    add_engine_args(gen)
    gen.add_argument("--prompt", action="append", help="a prompt (repeat for several)")
    gen.add_argument("--prompts-file", help="a text file with one prompt per line")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user message (chat template)")
    gen.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    gen.add_argument("--warmup-tokens", type=int, default=16,
                     help="generate this many tokens for a fixed prompt first, untimed, so the figures printed "
                          "leave out one-time start-up costs (0: time the first generation cold)")
    gen.set_defaults(func=_cmd_generate)

    fetch = sub.add_parser("fetch", help="download and convert the default target model (SmolLM2-135M-Instruct)")
    fetch.add_argument("--cache-dir", default=None, help="where converted models live (default: user cache)")
    fetch.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    fetch.add_argument("--keep-blocks", action="store_true", help=KEEP_BLOCKS_HELP)
    fetch.set_defaults(func=_cmd_fetch)

    imp = sub.add_parser("import-gguf", help="convert a GGUF file (llama.cpp's format) into a model folder")
    imp.add_argument("gguf", help="the GGUF file")
    imp.add_argument("out", help="the model folder to write")
    imp.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                     help="dtype of the dequantized tensors")
    imp.add_argument("--keep-blocks", action="store_true", help=KEEP_BLOCKS_HELP)
    imp.add_argument("--overwrite", action="store_true", help="replace the folder if it exists")
    imp.set_defaults(func=_cmd_import_gguf)

    serve = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    add_serve_args(serve)
    serve.set_defaults(func=cmd_serve)

    chat = sub.add_parser("chat", help="interactive streaming chat (in-process engine or --url of a server)")
    add_chat_args(chat)
    chat.set_defaults(func=cmd_chat)

    draft = sub.add_parser("draft-serve", help="run SSD's draft as a server that engines elsewhere connect to "
                                               "(speculative_config draft_url)")
    add_draft_serve_args(draft)
    draft.set_defaults(func=cmd_draft_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if serve_as_torchrun_worker(args):
            return 0
        return args.func(args)
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
