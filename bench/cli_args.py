"""Command-line options the benchmark scripts share: integer lists, the engine's weight formats and SSD filler
padding."""

from __future__ import annotations

import argparse


def parse_int_list(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError as exc:
        raise SystemExit(f"expected a comma-separated list of integers, got {text!r}") from exc
    if not values or any(v < 1 for v in values):
        raise SystemExit(f"expected positive integers, got {text!r}")
    return values


def add_filler_padding_arg(p: argparse.ArgumentParser) -> None:
    from ssd.options import FillerPadding

    p.add_argument("--filler-padding", default="auto", choices=FillerPadding.values(),
                   help="SSD random fillers past prompt lookup's copies (as the engine: auto = none on CPU)")


def add_weight_format_args(p: argparse.ArgumentParser) -> None:
    from ssd.options import TARGET_WEIGHT_FORMATS, WeightFormat

    p.add_argument("--weight-format", default="auto", choices=[f.value for f in TARGET_WEIGHT_FORMATS],
                   help="the target's weights (as the engine: auto = fp16-packed when --dtype auto chose float32)")
    p.add_argument("--draft-weight-format", default="auto", choices=WeightFormat.values(),
                   help="the draft's weights (as the engine: auto = q8_0 in float32 on CPUs with AVX-512 VNNI)")


def resolve_weight_formats(args: argparse.Namespace, requested_dtype: str) -> None:
    """Concrete ``args.weight_format`` / ``args.draft_weight_format`` for ``args.dtype`` (already resolved from
    ``requested_dtype``), as the engine resolves them, so that they are recorded with the results."""
    from ssd.models.weight_formats import resolve_weight_format

    args.weight_format = resolve_weight_format(args.weight_format, "cpu", args.dtype,
                                               explicit_dtype=requested_dtype != "auto")
    args.draft_weight_format = resolve_weight_format(args.draft_weight_format, "cpu", args.dtype, draft=True)
