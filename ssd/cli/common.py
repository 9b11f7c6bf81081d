"""Engine and sampling flags shared by the ``ssd`` subcommands."""

from __future__ import annotations

import argparse
import logging
from typing import Any

from ssd.dtypes import AUTO_DTYPE_HELP, DTYPE_NAMES
from ssd.models.weight_formats import DRAFT_WEIGHT_FORMATS, WEIGHT_FORMATS
from ssd.sampling_params import SamplingParams
from ssd.spec.ssd.fallback_policy import FILLER_PADDINGS


def _fan_out(value: str) -> int | list[int] | str:
    if value in ("auto", "dynamic"):
        return value
    parts = [int(p) for p in value.split(",")]
    return parts[0] if len(parts) == 1 else parts


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=None, help="target checkpoint folder (default: the fetched SmolLM2-135M)")
    g.add_argument("--dtype", default="auto", choices=list(DTYPE_NAMES), help=AUTO_DTYPE_HELP)
    g.add_argument("--weight-format", default="auto", choices=list(WEIGHT_FORMATS),
                   help="fp16-packed: float16 weights in FBGEMM's packed GEMM (CPU, float32); auto (default): "
                        "that where --dtype auto chose float32, else dense")
    g.add_argument("--device", default="cpu")
    g.add_argument("--max-model-len", type=int, default=None)
    g.add_argument("--max-num-seqs", type=int, default=16)
    g.add_argument("--kv-cache-memory", default=None, help="KV cache size, e.g. 1GiB (default: share of free memory)")
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--threads", type=int, default=None, help="torch threads per target rank")
    g.add_argument(
        "--tensor-parallel-size", "-tp", type=int, default=1,
        help="target ranks; ranks 1.. are spawned on this host, or started by torchrun (see README)",
    )
    g.add_argument("--seed", type=int, default=0)
    s = parser.add_argument_group("speculative decoding")
    s.add_argument("--draft", default=None, help="draft checkpoint folder; enables speculation")
    s.add_argument("--method", default="ssd", choices=["ssd", "draft_model", "ngram"],
                   help="with --draft (default ssd); ngram (prompt lookup alone) needs no --draft")
    s.add_argument("--k", type=int, default=4, help="draft tokens per round (lookahead K)")
    s.add_argument("--adaptive-lookahead", nargs="?", const="on", default="auto", choices=["auto", "on", "off"],
                   help="choose each round's K in 0..--k from measured acceptance and step times (SSD still caches "
                        "K): on, off (always --k), or auto (default: on, for SSD from two decoding sequences)")
    s.add_argument("--draft-weight-format", default="auto", choices=list(DRAFT_WEIGHT_FORMATS),
                   help="the draft's weights (default auto: fp16-packed on CPU in float32; int8-packed: int8 "
                        "attention and gate/up projections, faster multi-branch tree steps)")
    s.add_argument("--prompt-step-speculation", action=argparse.BooleanOptionalAction, default=False,
                   help="the step that finishes a prompt also verifies drafts (default: it emits its one token "
                        "without waiting for the draft, a lower time to first token)")
    s.add_argument("--no-prompt-lookup", action="store_true",
                   help="draft with the model only (default: copy a token that followed an earlier match)")
    s.add_argument("--prompt-lookup-min", type=int, default=2, help="shortest context match prompt lookup copies after")
    s.add_argument("--prompt-lookup-max", type=int, default=8, help="longest match prompt lookup compares")
    s.add_argument("--fan-out", type=_fan_out, default="dynamic",
                   help="SSD fan-out: dynamic (default: per sequence), auto (geometric), an int, or a comma list per k")
    s.add_argument("--fan-out-miss", type=_fan_out, default=None, help="SSD fan-out for rounds after a miss")
    s.add_argument("--fan-out-budget", type=int, default=None,
                   help="branches per sequence of 'auto' and 'dynamic' fan-outs (default: adapted so the draft "
                        "keeps up)")
    s.add_argument("--fallback", default="auto", choices=["jit", "random", "auto"])
    s.add_argument("--filler-padding", default="auto", choices=list(FILLER_PADDINGS),
                   help="random fillers past prompt lookup's copies (default auto: none on CPU, repeat on CUDA)")
    s.add_argument("--saguaro-c", type=float, default=1.0)
    s.add_argument("--full-builds", action="store_true",
                   help="SSD: always build the speculation cache K deep (default: stop when the next request arrives)")
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
        weight_format=args.weight_format,
        device=args.device,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        kv_cache_memory=args.kv_cache_memory,
        enable_prefix_caching=not args.no_prefix_caching,
        num_threads=args.threads,
        tensor_parallel_size=args.tensor_parallel_size,
        seed=args.seed,
    )
    if args.draft or args.method == "ngram":
        spec: dict[str, Any] = dict(
            method=args.method, model=args.draft, num_speculative_tokens=args.k,
            prompt_lookup=not args.no_prompt_lookup, prompt_lookup_min=args.prompt_lookup_min,
            prompt_lookup_max=args.prompt_lookup_max, draft_weight_format=args.draft_weight_format,
            prompt_step_speculation=args.prompt_step_speculation,
        )
        spec["adaptive_lookahead"] = {"on": True, "off": False}.get(args.adaptive_lookahead, args.adaptive_lookahead)
        if args.method == "ssd":
            spec.update(
                fan_out=args.fan_out,
                fan_out_miss=args.fan_out_miss,
                fan_out_budget=args.fan_out_budget,
                fallback=args.fallback,
                filler_padding=args.filler_padding,
                saguaro_c=args.saguaro_c,
                interruptible_build=not args.full_builds,
                draft_device=args.draft_device,
                draft_threads=args.draft_threads,
            )
        kwargs["speculative_config"] = spec
    return kwargs


def serve_as_torchrun_worker(args: argparse.Namespace) -> bool:
    """Under ``torchrun``, ranks other than 0 become tensor-parallel workers of rank 0's engine: run that
    loop and return True (the command itself runs on rank 0 only)."""
    from ssd.distributed.layout import torchrun_rank

    launched = torchrun_rank()
    if launched is None or launched[0] == 0 or not hasattr(args, "tensor_parallel_size"):
        return False
    from ssd.config import EngineConfig
    from ssd.distributed.launcher import run_worker_from_env
    from ssd.distributed.worker import RunnerArgs
    from ssd.placement import plan_engine_layout

    config = EngineConfig(**engine_kwargs(args))
    run_worker_from_env(
        RunnerArgs.from_config(config), plan_engine_layout(config), config.distributed_timeout_s,
        logging.getLogger().level,
    )
    return True


def sampling_from_args(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.sampling_seed,
        ignore_eos=args.ignore_eos,
    )
