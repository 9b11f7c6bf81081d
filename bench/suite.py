"""Benchmark suite: AR, SD, SSD (jit / random / auto fallback), transformers and (optionally) vLLM on several prompt
sets.

Built on bench_spec.py (placements, engine and HF workers, per-mode metrics): every configuration is a
worker process, repeats interleave configurations, ratios are paired within a repeat. On top it adds prompt
sets (HumanEval, chat, code, random), a float32 exactness check, a sweep over K / fan-out / saguaro_c, vLLM as a
peer (``vllm_peer.py``), plots, and ``bench/results/latest.json`` with the headline numbers. See bench/README.md.

    python bench/suite.py                                   # the default benchmark (writes latest.json)
    python bench/suite.py --num-prompts 1 --output-len 8 --repeats 1 --batch-sizes 1   # smoke run
    python bench/suite.py --sweep-only --sweep-k 2,4 --sweep-fan-out 1,2,3 --sweep-saguaro-c 0.5,1
"""

from __future__ import annotations

import argparse
import itertools
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from ssd.config import EngineConfig  # noqa: E402
from ssd.dtypes import resolve_dtype  # noqa: E402
from ssd.options import Dtype, option_help  # noqa: E402

from bench_spec import LAYOUTS, batch_prompts, build_specs, pair_description, placements, run_metrics, summarise  # noqa: E402
from bench_spec import speculative_config  # noqa: E402
from cli_args import (  # noqa: E402
    add_filler_padding_arg,
    add_weight_format_args,
    parse_int_list,
    resolve_weight_formats,
)
from engine_runner import EngineRunner  # noqa: E402
from inputs import RESULTS_DIR, resolve_model  # noqa: E402
from machine import available_cpus, machine_info  # noqa: E402
from report import median, print_table, write_json  # noqa: E402
from workers import WorkerSpec, close_workers, rotated, start_workers  # noqa: E402
from prompt_sets import DATASETS, PromptSet, load_prompt_set  # noqa: E402
from vllm_peer import add_vllm_args, report_vllm, suite_vllm  # noqa: E402
from suite_summary import (  # noqa: E402
    EXTRA,
    HF,
    HF_ASSISTED,
    SweepSetting,
    best_settings,
    dataset_headline,
    exactness_report,
    headline,
    run_key,
)

REPO = Path(__file__).resolve().parent.parent
DEFAULT_DRAFT = REPO / "models" / "smollm2-draft"
DEFAULT_EAGLE3 = REPO / "models" / "smollm2-eagle3"
ALL_MODES = ("ar", "sd", "sd-adaptive", "ngram", "eagle3", "ssd-jit", "ssd-random", "ssd-auto", "ssd-adaptive",
             "ssd-eagle3")
HEAD_MODES = ("eagle3", "ssd-eagle3")
# the head's modes run by default where it is present (it is committed; a checkout without it skips them)
DEFAULT_MODES = tuple(m for m in ALL_MODES if m not in HEAD_MODES or DEFAULT_EAGLE3.is_dir())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=None, help="target checkpoint folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--draft", default=None,
                   help=f"draft checkpoint folder (default: {DEFAULT_DRAFT.relative_to(REPO)}, else the target)")
    p.add_argument("--eagle3-head", default=str(DEFAULT_EAGLE3),
                   help="EAGLE-3 head of modes eagle3 and ssd-eagle3 (default: models/smollm2-eagle3, trained by "
                        "train/eagle3_head.py)")
    p.add_argument("--datasets", default="humaneval,chat", help=f"comma-separated subset of {','.join(DATASETS)}")
    p.add_argument("--random", action="store_true", help="add the random-token-id prompt set")
    p.add_argument("--num-prompts", type=int, default=4, help="prompts per prompt set")
    p.add_argument("--output-len", type=int, default=64, help="new tokens per prompt (EOS ignored)")
    p.add_argument("--batch-sizes", "--batch-size", default="1,4", help="comma-separated batch sizes")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (exactness is checked only then)")
    p.add_argument("--seed", type=int, default=0, help="random prompts; per-request sampling seeds")
    p.add_argument("--k", type=int, default=4, help="draft tokens per round (num_speculative_tokens)")
    p.add_argument("--fan-out", default="dynamic",
                   help="SSD fan-out: 'dynamic' (default), 'auto', an integer, or a list 'a,b,..' (K+1)")
    p.add_argument("--saguaro-c", type=float, default=1.0, help="SSD Saguaro scaling constant in (0, 1]")
    add_filler_padding_arg(p)
    p.add_argument("--no-prompt-lookup", dest="prompt_lookup", action="store_false",
                   help="SD and SSD draft with the model only (default: prompt lookup copies where it can)")
    p.add_argument("--modes", default=",".join(DEFAULT_MODES),
                   help=f"subset of {','.join(ALL_MODES)} (ar and sd required)")
    p.add_argument("--headline-ssd", default="ssd-auto", help="SSD mode whose ratios go into latest.json (default: the engine's default fallback)")
    p.add_argument("--target-threads", type=int, default=1, help="target threads in the extra-device layout")
    p.add_argument("--layouts", default=",".join(LAYOUTS), help=f"subset of {','.join(LAYOUTS)}")
    p.add_argument("--repeats", type=int, default=2, help="interleaved repeats of every configuration")
    p.add_argument("--hf-threads", type=int, default=None, help="threads of transformers (default --target-threads)")
    p.add_argument("--no-hf", action="store_true", help="skip transformers generate / assisted generation")
    p.add_argument("--dtype", default="auto", choices=Dtype.values(),
                   help=f"dtype of target and draft; {option_help(EngineConfig, 'dtype')} (float32 also makes greedy output "
                        "independent of batch shape)")
    add_weight_format_args(p)
    p.add_argument("--exact-dtype", default="float32", choices=["float32", "bfloat16", "none"],
                   help="dtype of the separate greedy exactness check ('none': judge exactness on the main run)")
    p.add_argument("--exact-num-prompts", type=int, default=1, help="prompts per set in the exactness check")
    p.add_argument("--exact-output-len", type=int, default=32, help="new tokens per prompt in the exactness check")
    p.add_argument("--kv-cache-memory", default="256MiB", help="KV cache budget of the target")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--sweep", action="store_true", help="also sweep K x fan-out x saguaro_c (extra-device SSD)")
    p.add_argument("--sweep-only", action="store_true", help="only the sweep (no mode comparison, no latest.json)")
    p.add_argument("--sweep-k", default="2,4", help="K values of the sweep")
    p.add_argument("--sweep-fan-out", default="1,2,3",
                   help="fan-outs of the sweep: '1,2,3' or 'auto', or per-k lists separated by ';'")
    p.add_argument("--sweep-saguaro-c", default="1.0", help="saguaro_c values of the sweep")
    p.add_argument("--sweep-fallback", default="jit", choices=["jit", "random", "auto"])
    p.add_argument("--sweep-workers", type=int, default=3, help="SSD sweep workers alive at a time (memory)")
    add_vllm_args(p)
    p.add_argument("--json", default=str(RESULTS_DIR / "suite_latest.json"), help="full results")
    p.add_argument("--latest", default=str(RESULTS_DIR / "latest.json"), help="headline results ('' to skip)")
    p.add_argument("--plots-dir", default=str(RESULTS_DIR / "plots"), help="PNG plots ('' to skip)")
    args = p.parse_args(argv)
    requested_dtype, args.dtype = args.dtype, resolve_dtype(args.dtype, "cpu")  # the concrete dtype, recorded
    resolve_weight_formats(args, requested_dtype)
    args.batch_sizes = parse_int_list(args.batch_sizes)
    args.layouts = [x.strip() for x in args.layouts.split(",") if x.strip()]
    args.datasets = [x.strip() for x in args.datasets.split(",") if x.strip()]
    if args.random and "random" not in args.datasets:
        args.datasets.append("random")
    args.modes = [x.strip() for x in args.modes.split(",") if x.strip()]
    if bad := sorted(set(args.layouts) - set(LAYOUTS)):
        p.error(f"unknown layouts {bad}")
    if bad := sorted(set(args.datasets) - set(DATASETS)):
        p.error(f"unknown datasets {bad}; choose from {DATASETS}")
    if bad := sorted(set(args.modes) - set(ALL_MODES)):
        p.error(f"unknown modes {bad}; choose from {ALL_MODES}")
    if not {"ar", "sd"} <= set(args.modes):
        p.error("--modes must include ar and sd (every ratio is taken against them)")
    if args.headline_ssd not in args.modes:
        args.headline_ssd = next((m for m in args.modes if m.startswith("ssd") and m not in HEAD_MODES), None)
    if min(args.k, args.num_prompts, args.repeats, args.target_threads, args.exact_num_prompts) < 1 or \
            args.output_len < 2 or args.temperature < 0:
        p.error("--k, --num-prompts, --repeats, --target-threads must be >= 1, --output-len >= 2, --temperature >= 0")
    if args.hf_threads is None:
        args.hf_threads = args.target_threads
    args.fan_out = parse_fan_out(args.fan_out)
    args.sweep_k = parse_int_list(args.sweep_k)
    # "1,2,3": three settings; "2,1,1,1,1;1,1,1,1,1": two per-k lists (';' separates settings when present)
    sep = ";" if ";" in args.sweep_fan_out else ","
    args.sweep_fan_out = [parse_fan_out(x) for x in args.sweep_fan_out.split(sep) if x.strip()]
    args.sweep_saguaro_c = [float(x) for x in args.sweep_saguaro_c.split(",") if x.strip()]
    args.command = "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv if argv is not None else sys.argv[1:])])
    return args


def parse_fan_out(text: str) -> int | str | list[int]:
    text = text.strip()
    if "," in text:
        return parse_int_list(text)
    return int(text) if text.isdigit() else text


# ----------------------------------------------------------------------------------------------- measuring
@dataclass
class Measurement:
    """Raw results of one set of workers: per repeat, per prompt set, per worker run key -> generate() result."""

    layouts: dict[str, Any]
    notes: list[str]
    where: dict[str, Any]
    per_repeat: list[dict[str, dict[str, dict[str, Any]]]]
    memory: dict[str, float]
    draft_memory: dict[str, float | None]

    def dataset_runs(self, ds: str) -> list[dict[str, dict[str, Any]]]:
        return [rep[ds] for rep in self.per_repeat]

    def keyed(self, ds: str, field: str, repeat: int | None = None) -> list[dict[str, Any]]:
        """Per repeat (or only ``repeat``): suite run key (layout/mode@b) -> the run's ``field``."""
        out = []
        for rep in self.dataset_runs(ds) if repeat is None else [self.per_repeat[repeat][ds]]:
            row: dict[str, Any] = {}
            for layout, modes in self.layouts.items():
                for mode, pl in modes.items():
                    for key, run in rep.items():
                        name, _, batch = key.rpartition("@b")
                        if name == pl.name:
                            row[run_key(layout, mode, int(batch))] = run.get(field)
            for key in (HF, HF_ASSISTED):
                if key in rep:
                    row[key] = rep[key].get(field)
            out.append(row)
        return out


def measure(ns: argparse.Namespace, target: str, draft: str, sets: dict[str, PromptSet], label: str) -> Measurement:
    """Start the workers of ``ns`` (modes, layouts, dtype, HF), run every prompt set, interleaved."""
    layouts, notes = placements(ns, tuple(ns.modes))
    first = next(iter(sets.values())).prompts
    specs = build_specs(ns, target, draft, first, layouts)
    print(f"[{label}] starting {len(specs)} workers ({ns.dtype}) ...", flush=True)
    workers = start_workers(specs)
    names = [s.name for s in specs]
    gen = dict(output_len=ns.output_len, temperature=ns.temperature, seed=ns.seed)
    per_repeat = []
    try:
        where = {name: workers[name].call("describe") for name in names if name != "hf"}
        for r in range(ns.repeats):
            started = time.perf_counter()
            rep: dict[str, dict[str, Any]] = {}
            for i, (ds, pset) in enumerate(sets.items()):
                runs = rep[ds] = {}
                for name in rotated(names, r + i):
                    if name == "hf":
                        runs[HF] = workers[name].call("generate", prompts=pset.prompts, batch=1, **gen)
                        runs[HF_ASSISTED] = workers[name].call("generate", prompts=pset.prompts, batch=1,
                                                               assisted=True, **gen)
                        continue
                    for bs in ns.batch_sizes:
                        runs[f"{name}@b{bs}"] = workers[name].call("generate", prompts=batch_prompts(pset.prompts, bs),
                                                                   batch=bs, **gen)
            per_repeat.append(rep)
            print(f"[{label}] repeat {r + 1}/{ns.repeats} done in {time.perf_counter() - started:.0f} s", flush=True)
        memory = {name: workers[name].peak_rss_mib() for name in names}
        draft_memory = {name: workers[name].call("draft_peak_rss_mib") for name in names if name.startswith("ssd")}
    finally:
        close_workers(workers)
    return Measurement(layouts, notes, where, per_repeat, memory, draft_memory)


def variant(args: argparse.Namespace, **changes: Any) -> argparse.Namespace:
    return argparse.Namespace(**{**vars(args), **changes})


def truncated(sets: dict[str, PromptSet], num: int) -> dict[str, PromptSet]:
    return {k: PromptSet(s.name, s.prompts[:num], s.description) for k, s in sets.items()}


# ----------------------------------------------------------------------------------------------- the suite
def run(args: argparse.Namespace) -> dict[str, Any]:
    target = resolve_model(args.target)
    draft = resolve_model(args.draft) if args.draft else (str(DEFAULT_DRAFT) if DEFAULT_DRAFT.is_dir() else target)
    sets = {ds: load_prompt_set(ds, target, args.num_prompts, seed=args.seed) for ds in args.datasets}
    pair_note = pair_description(target, draft)
    print(f"{pair_note}\nweights: target {args.weight_format}, draft {args.draft_weight_format} ({args.dtype})\n"
          f"K={args.k}, fan_out={args.fan_out}, saguaro_c={args.saguaro_c}, prompt_lookup={args.prompt_lookup}, "
          f"output_len {args.output_len}, "
          f"batch sizes {args.batch_sizes}, temperature {args.temperature}, {args.repeats} repeats, cores "
          f"{available_cpus()}")
    for s in sets.values():
        print(f"  prompt set {s.name}: {s.description} ({min(s.num_tokens)}-{max(s.num_tokens)} prompt tokens)")
    result: dict[str, Any] = {
        "benchmark": "suite",
        "command": args.command,
        "pair": {"target": target, "draft": draft, "note": pair_note},
        "args": vars(args),
        "datasets": {k: {"description": s.description, "num_prompt_tokens": s.num_tokens} for k, s in sets.items()},
    }
    if not args.sweep_only:
        result.update(compare_modes(args, target, draft, sets))
        prompts = {ds: p.prompts for ds, p in sets.items()}
        result["vllm"] = suite_vllm(args, result.pop("ar_tokens"), prompts, target, draft, result)
    if args.sweep or args.sweep_only:
        result["sweep"] = sweep(args, target, draft, sets)
    result["machine"] = machine_info()
    return result


def compare_modes(args: argparse.Namespace, target: str, draft: str, sets: dict[str, PromptSet]) -> dict[str, Any]:
    main = measure(args, target, draft, sets, "main")
    sampling = args.temperature > 0
    per_dataset: dict[str, Any] = {}
    main_exact: dict[str, Any] = {}
    for ds, pset in sets.items():
        summary = summarise(args, target, draft, "", main.notes, pset.prompts, main.layouts, main.where,
                            main.dataset_runs(ds), main.memory, main.draft_memory)
        for key in ("benchmark", "pair", "machine", "args"):
            summary.pop(key, None)
        if sampling:  # sampled outputs are equal in distribution, not token by token
            for rows in summary["layouts"].values():
                for by_mode in rows.values():
                    for m in by_mode.values():
                        m["exact"] = None
            summary["exact_all_modes"] = None
        else:
            main_exact[ds] = exactness_report(main.keyed(ds, "tokens", repeat=0)[0], len(pset.prompts))
        per_dataset[ds] = summary
    check = None
    if sampling:
        exact, basis = None, f"not checked: temperature {args.temperature} > 0 (sampling is exact in distribution only)"
    elif args.exact_dtype in ("none", args.dtype):
        exact = (all(r["exact"] for r in main_exact.values())
                 and all(s["exact_all_modes"] for s in per_dataset.values()))
        basis = (f"main run ({args.dtype}): every mode equals AR of the same layout and batch size in every repeat, "
                 "transformers assisted equals transformers plain")
    else:
        check = exactness_check(args, target, draft, sets)
        exact = check["exact"]
        basis = (f"separate {args.exact_dtype} run (extra-device layout, {args.exact_num_prompts} prompt(s) per set, "
                 f"{check['output_len']} tokens, batch sizes {args.batch_sizes}): every mode equals AR of the same "
                 "batch size, transformers assisted equals plain")
    heads = {}
    for ds in sets:
        rows = {layout: per_dataset[ds]["layouts"][layout].get(f"b{args.batch_sizes[0]}", {})
                for layout in per_dataset[ds]["layouts"]}
        heads[ds] = dataset_headline(main.keyed(ds, "decode_tok_s"), rows, args.batch_sizes[0], args.headline_ssd)
    main_verdict = (all(r["exact"] for r in main_exact.values())  # first repeat, incl. transformers
                    and all(s["exact_all_modes"] for s in per_dataset.values())) if main_exact else None  # every repeat
    prefixes = [p for r in main_exact.values() for a in r["vs_ar_same_shape"].values() for p in a["agreeing_prefix"]]
    latest = headline(heads, exact, basis, {
        "exact_main_dtype": main_verdict,
        "exact_main_dtype_min_agreeing_prefix": min(prefixes) if prefixes else None,
        "dtype": args.dtype,
        "weight_format": args.weight_format,
        "draft_weight_format": args.draft_weight_format,
        "batch_size": args.batch_sizes[0],
        "ssd_mode": args.headline_ssd,
        "k": args.k, "fan_out": args.fan_out, "saguaro_c": args.saguaro_c, "prompt_lookup": args.prompt_lookup,
        "output_len": args.output_len, "num_prompts": args.num_prompts, "repeats": args.repeats,
        "datasets": list(sets),
        "pair": {"target": target, "draft": draft},
        "command": args.command,
        "machine": machine_info(),
    })
    ar_tokens = {ds: main.keyed(ds, "tokens", repeat=0)[0].get(run_key(EXTRA, "ar", 1)) for ds in sets}
    return {"notes": main.notes, "per_dataset": per_dataset, "exactness_main": main_exact,
            "exactness_check": check, "headline": latest, "ar_tokens": ar_tokens}


def exactness_check(args: argparse.Namespace, target: str, draft: str, sets: dict[str, PromptSet]) -> dict[str, Any]:
    """Greedy outputs of every mode in ``--exact-dtype`` (float32: batch shape no longer changes rounding)."""
    formats = {} if args.exact_dtype == "float32" else {"weight_format": "dense", "draft_weight_format": "dense"}
    ns = variant(args, dtype=args.exact_dtype, layouts=[EXTRA], repeats=1,
                 output_len=min(args.exact_output_len, args.output_len), **formats)
    small = truncated(sets, args.exact_num_prompts)
    m = measure(ns, target, draft, small, f"exactness {args.exact_dtype}")
    reports = {ds: exactness_report(m.keyed(ds, "tokens", repeat=0)[0], len(s.prompts)) for ds, s in small.items()}
    return {"dtype": args.exact_dtype, "output_len": ns.output_len, "num_prompts": args.exact_num_prompts,
            "exact": all(r["exact"] for r in reports.values()), "by_dataset": reports}


def sweep(args: argparse.Namespace, target: str, draft: str, sets: dict[str, PromptSet]) -> dict[str, Any]:
    """SSD (``--sweep-fallback``) over K x fan-out x saguaro_c in the extra-device layout, at the first batch
    size, each setting paired with an AR worker measured in the same repeat. Settings run in groups of
    ``--sweep-workers`` (each SSD worker holds a target and a draft process); AR stays up throughout."""
    settings = [SweepSetting(k, tuple(f) if isinstance(f, list) else f, c)
                for k, f, c in itertools.product(args.sweep_k, args.sweep_fan_out, args.sweep_saguaro_c)]
    layouts, notes = placements(variant(args, layouts=[EXTRA]), ("ar", f"ssd-{args.sweep_fallback}"))
    if EXTRA not in layouts:
        raise SystemExit(f"sweep needs the extra-device layout: {notes}")
    ar_pl, ssd_pl = layouts[EXTRA]["ar"], layouts[EXTRA][f"ssd-{args.sweep_fallback}"]
    bs = args.batch_sizes[0]
    first = next(iter(sets.values())).prompts[0]
    gen = dict(output_len=args.output_len, temperature=args.temperature, seed=args.seed, batch=bs)

    def engine_spec(name: str, pl, config: dict[str, Any] | None) -> WorkerSpec:
        return WorkerSpec(name, EngineRunner, dict(model=target, threads=pl.target_threads,
                                                   kv_cache_memory=args.kv_cache_memory,
                                                   max_model_len=args.max_model_len, speculative_config=config,
                                                   warmup_prompt=first, dtype=args.dtype,
                                                   weight_format=args.weight_format),
                          cpus=list(pl.cpus), threads=pl.target_threads)

    rows: list[dict[str, Any]] = []
    ar = start_workers([engine_spec("sweep-ar", ar_pl, None)])
    try:
        for g in range(0, len(settings), max(args.sweep_workers, 1)):
            group = settings[g : g + max(args.sweep_workers, 1)]
            specs = []
            for s in group:
                ns = variant(args, k=s.k, fan_out=s.engine_fan_out(), saguaro_c=s.saguaro_c)
                specs.append(engine_spec(s.label, ssd_pl, speculative_config(ssd_pl.mode, ns, draft)))
            workers = start_workers(specs)
            try:
                runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
                for r in range(args.repeats):
                    for i, (ds, pset) in enumerate(sets.items()):
                        prompts = batch_prompts(pset.prompts, bs)
                        for name in rotated(["sweep-ar"] + [s.label for s in group], r + i):
                            worker = ar[name] if name == "sweep-ar" else workers[name]
                            runs.setdefault((ds, name), []).append(worker.call("generate", prompts=prompts, **gen))
                    print(f"[sweep] settings {g + 1}-{g + len(group)}/{len(settings)}: repeat {r + 1} done", flush=True)
            finally:
                close_workers(workers)
            for s in group:
                for ds in sets:
                    ssd_runs, ar_runs = runs[(ds, s.label)], runs[(ds, "sweep-ar")][-args.repeats:]
                    m = run_metrics(ssd_runs)
                    rows.append({
                        "dataset": ds, "setting": s.label, "k": s.k, "fan_out": s.fan_out, "saguaro_c": s.saguaro_c,
                        "decode_tok_s": m["decode_tok_s"], "ar_decode_tok_s": median([x["decode_tok_s"] for x in ar_runs]),
                        "speedup_vs_ar": median([a["decode_tok_s"] / b["decode_tok_s"] for a, b in zip(ssd_runs, ar_runs)
                                                 if a["decode_tok_s"] and b["decode_tok_s"]]),
                        "mean_acceptance_length": m["mean_acceptance_length"], "cache_hit_rate": m["cache_hit_rate"],
                        "exact_vs_ar": None if args.temperature > 0 else
                        all(x["tokens"] == ar_runs[0]["tokens"] for x in ssd_runs),
                    })
    finally:
        close_workers(ar)
    return {"fallback": args.sweep_fallback, "batch_size": bs, "rows": rows, "best": best_settings(rows)}


# ----------------------------------------------------------------------------------------------- printing
def _per_k(rates: list[float | None] | None) -> str | None:
    """SSD hit rates by the previous round's acceptance length k, as 'k=0/1/..' fractions ('-': no lookup)."""
    return "/".join("-" if r is None else f"{r:.2f}" for r in rates) if rates else None


def report(result: dict[str, Any]) -> None:
    args = result["args"]
    print(f"\n{result['pair']['note']}")
    for note in result.get("notes", []):
        print(f"note: {note}")
    headers = ["mode", "config", "tok/s", "TTFT ms", "MAL", "hit", "hit by k", "vs AR", "vs SD", "exact",
               "RSS MiB (+draft)"]
    for ds, summary in result.get("per_dataset", {}).items():
        for layout, by_batch in summary["layouts"].items():
            for batch, rows in by_batch.items():
                table = []
                for mode, m in rows.items():
                    rss = "-" if m["peak_rss_mib"] is None else f"{m['peak_rss_mib']:.0f}" + (
                        f" (+{m['draft_peak_rss_mib']:.0f})" if m["draft_peak_rss_mib"] else "")
                    exact = m["exact"] if m["exact"] is not False else \
                        f"NO (prefix {min(m['agreeing_prefix_vs_ar'])}/{args['output_len']})"
                    ssd = mode.startswith("ssd")
                    table.append([mode, m["config"], m["decode_tok_s"], 1e3 * m["ttft_s"] if m["ttft_s"] else None,
                                  m["mean_acceptance_length"], m["cache_hit_rate"] if ssd else None,
                                  _per_k(m.get("cache_hit_rate_per_k")) if ssd else None,
                                  m["speedup_vs_ar"], m["speedup_vs_sd"], exact, rss])
                print_table(headers, table, title=f"[{ds}] {layout}, batch {batch[1:]} (medians over repeats)")
        hf = summary.get("transformers")
        if hf:
            print_table(["transformers (batch 1)", "tok/s", "MAL", "assisted == plain", "RSS MiB"],
                        [["generate", hf["plain_decode_tok_s"], None, None, hf["peak_rss_mib"]],
                         ["assisted", hf["assisted_decode_tok_s"], hf["assisted_mean_acceptance_length"],
                          hf["assisted_exact_vs_plain"], None]], title=f"[{ds}] transformers, {hf['threads']} thread(s)")
    head = result.get("headline")
    if head:
        keys = ["exact", "exact_main_dtype", "exact_main_dtype_min_agreeing_prefix", "sd_mean_acceptance_length",
                "ssd_mean_acceptance_length", "ssd_cache_hit_rate", "ssd_over_ar", "ssd_over_sd", "sd_over_ar",
                "ssd_over_best_same_hardware", "sd_over_hf_assisted", "ssd_over_hf_assisted", "hf_assisted_over_hf",
                "ngram_mean_acceptance_length", "ngram_over_ar", "ssd_over_ngram", "eagle3_mean_acceptance_length",
                "eagle3_over_ar", "eagle3_over_sd", "ssd_eagle3_mean_acceptance_length", "ssd_eagle3_cache_hit_rate",
                "ssd_eagle3_over_eagle3", "ssd_eagle3_over_ar", "perfect_ssd_over_sd", "perfect_ssd_over_ar"]
        rows = [[k, head[k], *[head["by_dataset"][ds].get(k) for ds in head["by_dataset"]]] for k in keys]
        print_table(["headline", "all", *head["by_dataset"]], rows,
                    title=f"headline: batch {head['batch_size']}, SSD = {head['ssd_mode']} (ratios: paired medians, "
                          "geometric mean over prompt sets)")
        print(f"exactness basis: {head['exact_basis']}")
    report_vllm(result.get("vllm"))
    sw = result.get("sweep")
    if sw:
        print_table(["dataset", "setting", "tok/s", "vs AR", "MAL", "hit", "exact"],
                    [[r["dataset"], r["setting"], r["decode_tok_s"], r["speedup_vs_ar"], r["mean_acceptance_length"],
                      r["cache_hit_rate"], r["exact_vs_ar"]] for r in sw["rows"]],
                    title=f"sweep: SSD-{sw['fallback']}, extra-device, batch {sw['batch_size']}")
        for ds, row in sw["best"].items():
            print(f"best setting for {ds}: {row['setting']} ({row['speedup_vs_ar']:.2f}x AR)")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    started = time.perf_counter()
    result = run(args)
    result["wall_s"] = time.perf_counter() - started
    report(result)
    print(f"\nwrote {write_json(result, args.json)}")
    if result.get("headline") and args.latest:
        result["headline"]["wall_s"] = result["wall_s"]
        print(f"wrote {write_json(result['headline'], args.latest)}")
    if args.plots_dir:
        from suite_plots import write_plots

        for path in write_plots(result, args.plots_dir):
            print(f"wrote {path}")
    print(f"total {result['wall_s']:.0f} s")
    return result


if __name__ == "__main__":
    main()
