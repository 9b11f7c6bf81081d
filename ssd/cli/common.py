"""Engine and sampling flags shared by the ``ssd`` subcommands."""

from __future__ import annotations

import argparse
import logging
from typing import Any

from ssd.cli.option_flags import add_option_flags, options_from_args
from ssd.config import EngineConfig, SpeculativeConfig
from ssd.options import SpecMethod
from ssd.sampling_params import SamplingParams


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The engine's and speculative decoding's options (every one declared in ``ssd/config.py``) and sampling."""
    add_option_flags(parser.add_argument_group("engine"), EngineConfig)
    add_option_flags(parser.add_argument_group("speculative decoding (with --draft, or --method ngram)"),
                     SpeculativeConfig)
    p = parser.add_argument_group("sampling")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--sampling-seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--structured-outputs", type=_constraint, default=None, metavar="JSON",
                   help='an output constraint, e.g. \'{"regex": "[0-9]+"}\' or \'{"json": {"type": "object"}}\' '
                        "(one of json, json_object, regex, grammar, choice; SamplingParams.structured_outputs)")


def _constraint(text: str) -> Any:
    from ssd.structured.spec import StructuredOutputs

    try:
        return StructuredOutputs.from_json(text)
    except ValueError as exc:  # json.JSONDecodeError is a ValueError too
        raise argparse.ArgumentTypeError(str(exc)) from None


def default_model() -> str:
    from ssd.models.fetch import fetch_default_target

    return str(fetch_default_target())


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """``EngineConfig`` keyword arguments from parsed flags; speculation where a draft or ``--method ngram``
    asks for it."""
    kwargs = options_from_args(args, EngineConfig)
    kwargs["model"] = kwargs["model"] or default_model()
    if args.draft or args.draft_url or args.method is SpecMethod.NGRAM:
        kwargs["speculative_config"] = options_from_args(args, SpeculativeConfig)
    return kwargs


def serve_as_torchrun_worker(args: argparse.Namespace) -> bool:
    """Under ``torchrun``, ranks other than 0 become tensor-parallel workers of rank 0's engine: run that
    loop and return True (the command itself runs on rank 0 only)."""
    from ssd.distributed.layout import torchrun_rank

    launched = torchrun_rank()
    if launched is None or launched[0] == 0 or not hasattr(args, "tensor_parallel_size"):
        return False
    from ssd.distributed.launcher import run_worker_from_env
    from ssd.distributed.worker import RunnerArgs
    from ssd.placement import plan_engine_layout
    from ssd.resolve import resolve_config

    config = resolve_config(EngineConfig(**engine_kwargs(args)))
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
        min_p=args.min_p,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty,
        seed=args.sampling_seed,
        ignore_eos=args.ignore_eos,
        structured_outputs=args.structured_outputs,
    )
