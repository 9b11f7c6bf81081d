"""Engine and sampling flags shared by the ``ssd`` subcommands."""

from __future__ import annotations

import argparse
from typing import Any

from ssd.sampling_params import SamplingParams


def _fan_out(value: str) -> int | list[int] | str:
    if value == "auto":
        return value
    parts = [int(p) for p in value.split(",")]
    return parts[0] if len(parts) == 1 else parts


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None, help="target checkpoint folder (default: the fetched SmolLM2-135M)")
    g.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    g.add_argument("--device", default="cpu")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=16)
    g.add_argument("--kv-cache-memory", default=None, help="KV cache size, e.g. 1GiB (default: share of free memory)")
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--threads", type=int, default=None, help="torch threads for the target process")
    g.add_argument("--seed", type=int, default=0)
    s = parser.add_argument_group("speculative decoding")
    s.add_argument("--draft", default=None, help="draft checkpoint folder; enables speculation")
    s.add_argument("--method", default="ssd", choices=["ssd", "draft_model"], help="with --draft (default ssd)")
    s.add_argument("--k", type=int, default=4, help="draft tokens per round (lookahead K)")
    s.add_argument("--fan-out", type=_fan_out, default=2, help="SSD fan-out: an int, a comma list per k, or auto")
    s.add_argument("--fan-out-miss", type=_fan_out, default=None, help="SSD fan-out for rounds after a miss")
    s.add_argument("--fallback", default="jit", choices=["jit", "random", "auto"])
    s.add_argument("--saguaro-c", type=float, default=1.0)
    s.add_argument("--draft-device", default=None)
    s.add_argument("--draft-threads", type=int, default=None)
    p = parser.add_argument_group("sampling")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--sampling-seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")


def default_model() -> str:
    from ssd.models.fetch import fetch_default_target

    return str(fetch_default_target())


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    kwargs: dict[str, Any] = dict(
        model=args.model or default_model(),
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        kv_cache_memory=args.kv_cache_memory,
        enable_prefix_caching=not args.no_prefix_caching,
        num_threads=args.threads,
        seed=args.seed,
    )
    if args.draft:
        spec: dict[str, Any] = dict(method=args.method, model=args.draft, num_speculative_tokens=args.k)
        if args.method == "ssd":
            spec.update(
                fan_out=args.fan_out,
                fan_out_miss=args.fan_out_miss,
                fallback=args.fallback,
                saguaro_c=args.saguaro_c,
                draft_device=args.draft_device,
                draft_threads=args.draft_threads,
            )
        kwargs["speculative_config"] = spec
    return kwargs


def sampling_from_args(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.sampling_seed,
        ignore_eos=args.ignore_eos,
    )
