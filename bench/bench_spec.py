"""Autoregressive (AR) vs speculative decoding (SD) vs speculative speculative decoding (SSD), greedy.

Two hardware layouts are measured side by side (see bench/README.md for the exact CPU assignment):

* extra-device: AR and SD get ``--target-threads`` threads on that many cores; SSD gets the same for the
  target plus one more core for its draft process (the paper's setting: the draft has its own device).
* same-hardware: every mode gets all cores; AR and SD run ``cores`` threads, SSD runs its target on
  ``cores - 1`` threads and its draft on the last core.

Each configuration is a worker process; repeats interleave the configurations and speedups are computed per
repeat, then their median is reported. ``transformers`` assisted generation (``assistant_model=``) on the
same pair at batch 1 is measured as an outside reference.

    python bench/bench_spec.py --k 4 --num-prompts 4 --output-len 64 --batch-sizes 1,4
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ssd.config import EngineConfig  # noqa: E402
from ssd.dtypes import resolve_dtype  # noqa: E402
from ssd.options import Dtype, option_help  # noqa: E402

from cli_args import (  # noqa: E402
    add_filler_padding_arg,
    add_weight_format_args,
    parse_int_list,
    resolve_weight_formats,
)
from engine_runner import ACCEPT_HIST_PREFIX, EngineRunner, hit_rate_per_k, summed_per_k  # noqa: E402
from hf_runner import HFRunner  # noqa: E402
from inputs import RESULTS_DIR, chat_prompt_ids, resolve_model  # noqa: E402
from machine import available_cpus, machine_info  # noqa: E402
from report import common_prefix_len, median, print_table, ratio, write_json  # noqa: E402
from workers import WorkerSpec, close_workers, rotated, start_workers  # noqa: E402

MODES = ("ar", "sd", "ssd-jit", "ssd-random")  # ssd-auto is available too (bench/suite.py runs it)
LAYOUTS = ("extra-device", "same-hardware")


@dataclass(frozen=True)
class Placement:
    """Where one engine configuration runs. ``cpus`` is the worker's affinity; SSD pins its target to all of
    them but the last and its draft process to the last."""

    mode: str
    target_threads: int
    cpus: tuple[int, ...]

    @property
    def name(self) -> str:
        if self.mode.startswith("ssd"):
            return f"{self.mode}-t{self.target_threads}+1"
        return f"{self.mode}-t{self.target_threads}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=None, help="target checkpoint folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--draft", default=None, help="draft checkpoint folder (default: the target itself)")
    p.add_argument("--k", type=int, default=4, help="draft tokens per round (num_speculative_tokens)")
    p.add_argument("--fan-out", default="dynamic",
                   help="SSD fan-out: dynamic (default), auto, an integer per k, or a list a,b,.. (K+1)")
    add_filler_padding_arg(p)
    p.add_argument("--num-prompts", type=int, default=4, help="prompts per measurement")
    p.add_argument("--output-len", type=int, default=64, help="new tokens per prompt (EOS ignored)")
    p.add_argument("--batch-sizes", default="1,4", help="comma-separated batch sizes (default 1,4)")
    p.add_argument("--target-threads", type=int, default=1, help="target threads in the extra-device layout")
    p.add_argument("--layouts", default=",".join(LAYOUTS), help=f"subset of {','.join(LAYOUTS)}")
    p.add_argument("--repeats", type=int, default=2, help="interleaved repeats of every configuration")
    p.add_argument("--dtype", default="auto", choices=Dtype.values(),
                   help=f"dtype of target and draft; {option_help(EngineConfig, 'dtype')} (float32 also makes greedy output "
                        "independent of batch shape)")
    add_weight_format_args(p)
    p.add_argument("--kv-cache-memory", default="256MiB", help="KV cache budget of the target")
    p.add_argument("--max-model-len", type=int, default=2048, help="max_model_len of the engines")
    p.add_argument("--hf-threads", type=int, default=None,
                   help="threads (on the first cores) of the transformers reference (default: --target-threads, "
                        "i.e. comparable with extra-device AR and SD)")
    p.add_argument("--no-hf", action="store_true", help="skip the transformers (assisted) reference")
    p.add_argument("--json", default=str(RESULTS_DIR / "spec_latest.json"), help="where to write the results")
    args = p.parse_args(argv)
    requested_dtype, args.dtype = args.dtype, resolve_dtype(args.dtype, "cpu")  # the concrete dtype, recorded
    resolve_weight_formats(args, requested_dtype)
    args.batch_sizes = parse_int_list(args.batch_sizes)
    args.layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
    bad = sorted(set(args.layouts) - set(LAYOUTS))
    if bad:
        p.error(f"unknown layouts {bad}; choose from {LAYOUTS}")
    if args.k < 1 or args.num_prompts < 1 or args.output_len < 2 or args.repeats < 1 or args.target_threads < 1:
        p.error("--k, --num-prompts, --repeats, --target-threads must be >= 1 and --output-len >= 2")
    if args.hf_threads is None:
        args.hf_threads = args.target_threads
    fan = args.fan_out
    if "," in fan:
        args.fan_out = parse_int_list(fan)
    elif fan.isdigit():
        args.fan_out = int(fan)
    return args


def placements(args: argparse.Namespace, modes: tuple[str, ...] = MODES
               ) -> tuple[dict[str, dict[str, Placement]], list[str]]:
    """Layout -> mode -> placement for ``modes`` (``ar``, ``sd``, ``ssd-<fallback>``), plus notes on what could
    not be placed as asked."""
    cpus = available_cpus()
    n, t = len(cpus), args.target_threads
    layouts: dict[str, dict[str, Placement]] = {}
    notes: list[str] = []

    def layout(plain_threads: int, plain_cpus: list[int], ssd_threads: int, ssd_cpus: list[int]):
        return {mode: Placement(mode, ssd_threads, tuple(ssd_cpus)) if mode.startswith("ssd")
                else Placement(mode, plain_threads, tuple(plain_cpus)) for mode in modes}

    if "extra-device" in args.layouts:
        if t + 1 > n:
            notes.append(f"extra-device layout skipped: {t} target threads + 1 draft core need {t + 1} cores, "
                         f"only {n} available")
        else:
            layouts["extra-device"] = layout(t, cpus[:t], t, cpus[: t + 1])
    if "same-hardware" in args.layouts:
        if n < 2:
            notes.append("same-hardware layout skipped: SSD needs at least 2 cores (target + draft)")
        else:
            layouts["same-hardware"] = layout(n, cpus, n - 1, cpus)
    if {"extra-device", "same-hardware"} <= set(layouts) and n - 1 == t:
        notes.append(f"with {n} cores and --target-threads {t}, SSD is configured identically in both layouts "
                     f"(target {t} thread(s) + 1 draft core): it is measured once and reported in both")
    return layouts, notes


def speculative_config(mode: str, args: argparse.Namespace, draft: str) -> dict[str, Any] | None:
    """The engine's ``speculative_config`` for a mode name: ``ar``, ``sd``, ``sd-adaptive``, ``ngram`` (prompt
    lookup alone, no draft model), ``eagle3`` (SD with ``args.eagle3_head``), ``ssd-<fallback>``, ``ssd-adaptive``
    (the auto fallback with an adaptive lookahead) or ``ssd-eagle3`` (SSD with ``args.eagle3_head`` as the draft)."""
    if mode == "ar":
        return None
    if mode == "ngram":
        return {"method": "ngram", "num_speculative_tokens": args.k, "adaptive_lookahead": False}
    if mode == "eagle3":  # SD with an EAGLE-3 head instead of a draft model, a fixed K like sd
        return {"method": "eagle3", "model": args.eagle3_head, "num_speculative_tokens": args.k,
                "prompt_lookup": getattr(args, "prompt_lookup", True), "adaptive_lookahead": False}
    if mode.startswith("ssd"):
        ssd_options = {"fan_out": args.fan_out, "saguaro_c": getattr(args, "saguaro_c", 1.0),
                       "filler_padding": args.filler_padding}
    if mode == "ssd-eagle3":  # SSD with the EAGLE-3 head as its draft, the engine's default (auto) fallback
        return {"method": "ssd", "model": args.eagle3_head, "num_speculative_tokens": args.k,
                "prompt_lookup": getattr(args, "prompt_lookup", True), "fallback": "auto", "adaptive_lookahead": False,
                **ssd_options}
    common = {"model": draft, "num_speculative_tokens": args.k, "prompt_lookup": getattr(args, "prompt_lookup", True),
              "draft_weight_format": args.draft_weight_format}
    if mode == "sd":  # a fixed K at every batch size (the engine's default "auto" adapts K)
        return {"method": "draft_model", **common, "adaptive_lookahead": False}
    if mode == "sd-adaptive":  # K chosen each step in 0..K from measured acceptance and step times
        return {"method": "draft_model", **common, "adaptive_lookahead": True}
    adaptive = mode == "ssd-adaptive"
    fallback = "auto" if adaptive else mode.split("-", 1)[1]
    return {"method": "ssd", **common, "fallback": fallback, "adaptive_lookahead": adaptive, **ssd_options}


def build_specs(args, target: str, draft: str, prompts, layouts) -> list[WorkerSpec]:
    specs: dict[str, WorkerSpec] = {}
    for layout in layouts.values():
        for mode, pl in layout.items():
            if pl.name in specs:
                continue
            specs[pl.name] = WorkerSpec(
                pl.name, EngineRunner,
                dict(model=target, threads=pl.target_threads, kv_cache_memory=args.kv_cache_memory,
                     max_model_len=args.max_model_len, speculative_config=speculative_config(mode, args, draft),
                     warmup_prompt=prompts[0], warmup_batch=1, dtype=args.dtype,
                     weight_format=args.weight_format),
                cpus=list(pl.cpus), threads=pl.target_threads,
            )
    if not args.no_hf:
        cpus = available_cpus()[: args.hf_threads]
        specs["hf"] = WorkerSpec(
            "hf", HFRunner, dict(model=target, assistant=draft, num_assistant_tokens=args.k,
                                 warmup_prompt=prompts[0], dtype=args.dtype),
            cpus=cpus, threads=len(cpus),
        )
    return list(specs.values())


def batch_prompts(prompts: list[list[int]], bs: int) -> list[list[int]]:
    """The prompts, cycled up to a whole number of batches of ``bs``."""
    total = -(-len(prompts) // bs) * bs
    return [prompts[i % len(prompts)] for i in range(total)]


def run(args: argparse.Namespace) -> dict[str, Any]:
    target = resolve_model(args.target)
    draft = resolve_model(args.draft) if args.draft else target
    prompts = chat_prompt_ids(target, args.num_prompts)
    layouts, notes = placements(args)
    pair_note = pair_description(target, draft)
    print(f"{pair_note}\nK={args.k}, fan_out={args.fan_out}, output_len {args.output_len}, batch sizes "
          f"{args.batch_sizes}, {len(prompts)} prompts, {args.repeats} repeats, cores {available_cpus()}")
    for note in notes:
        print(f"note: {note}")
    specs = build_specs(args, target, draft, prompts, layouts)
    print("starting workers ...", flush=True)
    workers = start_workers(specs)
    names = [s.name for s in specs]
    per_repeat: list[dict[str, Any]] = []
    try:
        where = {name: workers[name].call("describe") for name in names if name != "hf"}
        for r in range(args.repeats):
            rep: dict[str, Any] = {}
            started = time.perf_counter()
            for name in rotated(names, r):
                if name == "hf":
                    rep["hf"] = workers[name].call("generate", prompts=prompts, output_len=args.output_len, batch=1)
                    rep["hf-assisted"] = workers[name].call("generate", prompts=prompts, output_len=args.output_len,
                                                            batch=1, assisted=True)
                    continue
                for bs in args.batch_sizes:
                    rep[f"{name}@b{bs}"] = workers[name].call("generate", prompts=batch_prompts(prompts, bs),
                                                              output_len=args.output_len, batch=bs)
            per_repeat.append(rep)
            line = ", ".join(f"{k} {v['decode_tok_s']:.1f}" for k, v in rep.items() if v.get("decode_tok_s"))
            print(f"repeat {r + 1}/{args.repeats} ({time.perf_counter() - started:.0f} s): decode tok/s {line}",
                  flush=True)
        memory = {name: workers[name].peak_rss_mib() for name in names}
        draft_memory = {name: workers[name].call("draft_peak_rss_mib") for name in names if name.startswith("ssd")}
    finally:
        close_workers(workers)
    return summarise(args, target, draft, pair_note, notes, prompts, layouts, where, per_repeat, memory,
                     draft_memory)


def pair_description(target: str, draft: str) -> str:
    if Path(target).resolve() == Path(draft).resolve():
        return (f"PAIR: draft == target ({Path(target).name}). Acceptance is full by construction: this shows the "
                "mechanics and overheads of SD/SSD, NOT a realistic speedup (a real draft is much smaller and "
                "sometimes wrong).")
    return f"PAIR: target {Path(target).name}, draft {Path(draft).name}"


def run_metrics(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over repeats of one (configuration, batch size)."""
    def per_round_ms(seconds: list[float], rounds: list[int]) -> float | None:
        return median([1e3 * t / n if n else None for t, n in zip(seconds, rounds)])

    def spec_ratio(num: str, den: str) -> list[float | None]:
        return [x["spec"].get(num, 0.0) / x["spec"][den] if x["spec"].get(den) else None for x in runs]

    return {
        "decode_tok_s": median([x["decode_tok_s"] for x in runs]),
        "decode_tok_s_runs": [x["decode_tok_s"] for x in runs],
        "e2e_tok_s": median([x["e2e_tok_s"] for x in runs]),
        "ttft_s": median([x["ttft_s"] for x in runs]),
        "cpu_share": median([x["cpu_share"] for x in runs]),
        "draft_cpu_share": median([x.get("draft_cpu_share") for x in runs]),
        "load_avg_1m": [x["load_avg_1m"] for x in runs],
        "rounds": median([x["spec"].get("num_drafts") for x in runs]),
        "mean_acceptance_length": median(spec_ratio("num_emitted_tokens", "num_drafts")),
        "acceptance_rate": median(spec_ratio("num_accepted_tokens", "num_draft_tokens")),
        "cache_hit_rate": median(spec_ratio("cache_hits", "cache_lookups")),
        # SSD: hits per lookup by the previous round's acceptance length k, over repeats
        "cache_hit_rate_per_k": hit_rate_per_k([x["spec"] for x in runs]),
        "fallbacks": {k.removeprefix("fallback_"): median([x["spec"].get(k) for x in runs])
                      for k in runs[0]["spec"] if k.startswith("fallback_")},
        # rounds that accepted exactly k drafts, summed over repeats (acceptance length k + 1)
        "acceptance_histogram": summed_per_k([x["spec"] for x in runs], ACCEPT_HIST_PREFIX),
        # per verification round, in ms
        "verify_ms_per_round": per_round_ms([x["decode_forward_s"] for x in runs],
                                            [x["decode_forward_calls"] for x in runs]),
        # CPU time of the same forwards: far below the wall time means the target was descheduled
        "verify_cpu_ms_per_round": per_round_ms([x["decode_forward_cpu_s"] for x in runs],
                                                [x["decode_forward_calls"] for x in runs]),
        # time the target waited for draft tokens (SD: K draft steps; SSD: cache lookup, or the fallback)
        "draft_wait_ms_per_round": per_round_ms([x["propose_s"] for x in runs], [x["propose_calls"] for x in runs]),
        # the engine's own counters (SpecStats.verify_time_s / num_drafts; includes the first step's prefill)
        "engine_verify_ms_per_round": per_round_ms([x["spec"].get("verify_time_s", 0.0) for x in runs],
                                                   [int(x["spec"].get("num_drafts", 0)) for x in runs]),
        # SSD: the draft worker's cache build for the next round, overlapped with the target's verify
        "draft_build_ms_per_round": per_round_ms([x["spec"].get("draft_build_time_s", 0.0) for x in runs],
                                                 [x["propose_calls"] for x in runs]),
        # SSD: tree branches built per sequence and round (the 'auto' fan-out steers this)
        "branches_per_sequence_round": ratio(sum(x["spec"].get("draft_build_branches", 0.0) for x in runs),
                                             sum(x["spec"].get("cache_lookups", 0.0) for x in runs)),
    }


def summarise(args, target, draft, pair_note, notes, prompts, layouts, where, per_repeat, memory,
              draft_memory) -> dict[str, Any]:
    results: dict[str, Any] = {}
    first_ar: list[list[int]] | None = None  # AR tokens of the first layout and batch size, per prompt
    ar_agreement: dict[str, list[int]] = {}
    exact_all = True
    for layout_name, layout in layouts.items():
        results[layout_name] = {}
        for bs in args.batch_sizes:
            key = {mode: f"{pl.name}@b{bs}" for mode, pl in layout.items()}
            rows = {}
            reference = per_repeat[0][key["ar"]]["tokens"]
            # Across thread counts and batch sizes AR itself may drift in bf16 (GEMMs of another shape round
            # differently): reported as agreeing prefixes, not counted against exactness.
            if first_ar is None:
                first_ar = reference[: len(prompts)]
            ar_agreement[f"{layout_name}/b{bs}"] = [common_prefix_len(a, b) for a, b in zip(first_ar, reference)]
            for mode, run_key in key.items():
                runs = [rep[run_key] for rep in per_repeat]
                m = run_metrics(runs)
                m["config"] = layout[mode].name
                m["placement"] = where[layout[mode].name]
                m["speedup_vs_ar"] = median([ratio(rep[run_key]["decode_tok_s"], rep[key["ar"]]["decode_tok_s"])
                                             for rep in per_repeat])
                m["speedup_vs_sd"] = median([ratio(rep[run_key]["decode_tok_s"], rep[key["sd"]]["decode_tok_s"])
                                             for rep in per_repeat])
                # exact: the same greedy tokens as AR in the same layout and batch size, in every repeat
                m["exact"] = all(rep[run_key]["tokens"] == reference for rep in per_repeat)
                m["agreeing_prefix_vs_ar"] = [common_prefix_len(a, b) for a, b in zip(reference, runs[0]["tokens"])]
                exact_all &= m["exact"]
                m["peak_rss_mib"] = memory[layout[mode].name]
                m["draft_peak_rss_mib"] = draft_memory.get(layout[mode].name)
                rows[mode] = m
            results[layout_name][f"b{bs}"] = rows
    hf = None
    if "hf" in per_repeat[0]:
        plain = [rep["hf"] for rep in per_repeat]
        assisted = [rep["hf-assisted"] for rep in per_repeat]
        hf = {
            "threads": args.hf_threads,
            "cpu_share": median([x["cpu_share"] for x in plain + assisted]),
            "plain_decode_tok_s": median([x["decode_tok_s"] for x in plain]),
            "assisted_decode_tok_s": median([x["decode_tok_s"] for x in assisted]),
            "assisted_speedup": median([ratio(a["decode_tok_s"], p["decode_tok_s"]) for a, p in zip(assisted, plain)]),
            "assisted_mean_acceptance_length": median([x.get("mean_acceptance_length") for x in assisted]),
            "assisted_exact_vs_plain": all(a["tokens"] == p["tokens"] for a, p in zip(assisted, plain)),
            "agreeing_prefix_vs_our_ar": [common_prefix_len(a, b) for a, b in zip(first_ar or [], plain[0]["tokens"])],
            "peak_rss_mib": memory.get("hf"),
        }
    return {
        "benchmark": "spec",
        "pair": {"target": target, "draft": draft, "note": pair_note},
        "machine": machine_info(),
        "args": {k: v for k, v in vars(args).items()},
        "notes": notes,
        "num_prompt_tokens": [len(p) for p in prompts],
        "layouts": results,
        "exact_all_modes": exact_all,
        "ar_agreeing_prefix_vs_first": ar_agreement,
        "transformers": hf,
    }


def report(result: dict[str, Any]) -> None:
    print(f"\n{result['pair']['note']}")
    for note in result["notes"]:
        print(f"note: {note}")
    headers = ["mode", "config", "tok/s", "vs AR", "vs SD", "MAL", "hit", "verify ms (cpu)", "draft wait ms",
               "draft build ms", "branches", "exact", "CPU share (draft)", "RSS MiB (+draft)"]
    for layout_name, by_batch in result["layouts"].items():
        for batch, rows in by_batch.items():
            table = []
            for mode, m in rows.items():
                rss = fmt_mem(m["peak_rss_mib"], m["draft_peak_rss_mib"])
                table.append([mode, m["config"], m["decode_tok_s"], m["speedup_vs_ar"], m["speedup_vs_sd"],
                              m["mean_acceptance_length"], m["cache_hit_rate"] if mode.startswith("ssd") else None,
                              fmt_share(m["verify_ms_per_round"], m["verify_cpu_ms_per_round"], 1),
                              m["draft_wait_ms_per_round"],
                              m["draft_build_ms_per_round"] if mode.startswith("ssd") else None,
                              m["branches_per_sequence_round"] if mode.startswith("ssd") else None,
                              m["exact"], fmt_share(m["cpu_share"], m["draft_cpu_share"]), rss])
            print_table(headers, table, title=f"{layout_name}, batch {batch[1:]} (decode tok/s, medians; "
                                              "ms are per verification round)")
    hf = result["transformers"]
    if hf:
        print_table(
            ["transformers (batch 1)", "value"],
            [["threads", hf["threads"]], ["CPU share", hf["cpu_share"]], ["plain decode tok/s", hf["plain_decode_tok_s"]],
             ["assisted decode tok/s", hf["assisted_decode_tok_s"]], ["assisted / plain", hf["assisted_speedup"]],
             ["assisted mean acceptance length", hf["assisted_mean_acceptance_length"]],
             ["assisted tokens == plain", hf["assisted_exact_vs_plain"]],
             ["plain vs our AR: agreeing prefix", " ".join(map(str, hf["agreeing_prefix_vs_our_ar"]))], ["peak RSS MiB", hf["peak_rss_mib"]]],
            title="transformers reference",
        )
    print(f"\nevery mode produced the same tokens as AR (same layout and batch size): {result['exact_all_modes']}")
    print(f"AR agreeing prefix vs the first AR configuration, per prompt (of {result['args']['output_len']}): "
          f"{result['ar_agreeing_prefix_vs_first']}")
    for layout_name, by_batch in result["layouts"].items():
        for batch, rows in by_batch.items():
            for mode, m in rows.items():
                if not m["exact"]:
                    print(f"  NOT EXACT: {layout_name} {batch} {mode}: agreeing prefix vs AR {m['agreeing_prefix_vs_ar']}")


def fmt_share(main: float | None, extra: float | None, digits: int = 2) -> str:
    if main is None:
        return "-"
    return f"{main:.{digits}f}" + (f" ({extra:.{digits}f})" if extra is not None else "")


def fmt_mem(main: float | None, draft: float | None) -> str:
    if main is None:
        return "-"
    return f"{main:.0f}" + (f" (+{draft:.0f})" if draft is not None else "")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    result = run(args)
    report(result)
    path = write_json(result, args.json)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
