"""GPU check: exactness of the CUDA path and decode step time against the memory-bandwidth floor, one run.

    python bench/gpu_check.py                         # on a GPU machine: a few minutes
    python bench/gpu_check.py --device cpu --tiny     # CI smoke test of the same logic: seconds

Three parts, each printed and written to one JSON file:

(a) exactness on tiny random checkpoints (float32): the device's eager reference forward and the GraphRunner
    (CUDA graphs on CUDA, its static forward eagerly on CPU), on CUDA both again with the fused Triton kernels
    (ssd/models/fused_kernels.py), against the CPU reference forward for prefill,
    batched decode, K+1 verification and an SSD tree step (logits within 1e-4 relative on CUDA, 1e-5 on CPU;
    greedy argmax identical), and the engine's greedy generations (``LLM(device=...)``) against
    ``transformers`` greedy generation on CPU;
(b) AR == SD == SSD greedy tokens through ``LLM`` on the device (SSD's draft on a second GPU when there is
    one, else sharing the first);
(c) timing: a Llama-3-8B-shaped random bf16 target and a Llama-3.2-1B-shaped draft (built on the meta device,
    materialised on the device, random-initialised in place: no checkpoint on disk). The copy bandwidth is
    measured with a device-to-device copy (bytes read + written per second); the floor of a step is the
    weight bytes it must read divided by that bandwidth (the embedding table is read in full only when it is
    tied to the LM head). Reported for the AR decode step at batch 1, the K+1 = 8 verify step, and the draft
    tree step (M branches of one sequence), each eagerly, with the static forward run eagerly, with CUDA
    graphs, and with fused kernels (eagerly and under graphs: the engine's default on CUDA); ``--compile``
    adds torch.compile under graphs, ``--attention-splits`` other key splits of the fused attention,
    ``--profile`` the kernels of one target AR step. Step times are model forwards including host-side input
    preparation, synchronised per step, median of ``--iters``. Each timing row is printed as it is measured.

(d) the engine's own cost: greedy decoding through ``LLM`` at batch 1 on a Llama-3.2-1B-shaped body against
    the bare AR step of the same model (fused kernels and graphs, as the engine runs it).

Targets (issue 8), judged on the fastest graph mode: AR step <= 1.3x floor; verify step <= 1.2x the AR step;
all checks pass. Exit status 1 when a check fails; a part that raises becomes a failed check and the other
parts still run.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR))
sys.path.insert(0, str(BENCH_DIR.parent / "tests"))  # checkpoint builders shared with the test suite

from inputs import RESULTS_DIR  # noqa: E402
from machine import machine_info  # noqa: E402
from report import print_table, write_json  # noqa: E402
from gpu_steps import (  # noqa: E402
    BLOCK,
    LLAMA3_8B,
    LLAMA32_1B,
    TINY_DRAFT,
    TINY_TARGET,
    Driver,
    copy_bandwidth,
    print_profile,
    profile_step,
    random_model,
    scenario,
    step_inputs,
    sync,
    time_step,
    timing_modes,
    weight_bytes_read,
)

from ssd.models.attention_layout import build_attention_metadata  # noqa: E402
from ssd.runtime.cuda_graphs import GraphRunnerConfig  # noqa: E402
from ssd.runtime.static_batch import pack_step  # noqa: E402
from ssd.models.decoder import DecoderLM, fused_kernels_usable  # noqa: E402

AR_TARGET, VERIFY_TARGET = 1.3, 1.2
logger = logging.getLogger("gpu_check")


@dataclass
class Check:
    name: str
    passed: bool
    detail: str = ""


@dataclass
class Timing:
    model: str
    step: str
    batch: int
    queries: int
    kv_len: int
    mode: str
    step_ms: float
    floor_ms: float
    x_floor: float
    vs_ar: float | None = None


@dataclass
class Report:
    device: str
    tiny: bool
    checks: list[Check] = field(default_factory=list)
    timings: list[Timing] = field(default_factory=list)
    bandwidth_gbps: float | None = None
    weight_bytes: dict[str, int] = field(default_factory=dict)
    targets: dict[str, Any] = field(default_factory=dict)
    profiles: dict[str, dict[str, Any]] = field(default_factory=dict)  # mode -> kernel breakdown of an AR step
    engine: dict[str, dict[str, Any]] = field(default_factory=dict)
    engine_overhead: dict[str, Any] | None = None  # part (d)

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)


# ------------------------------------------------------------------------------------------- exactness
def compare_drivers(name: str, reference: Driver, others: dict[str, Driver], vocab: int, rtol: float) -> list[Check]:
    """Run the scenario on every driver; one check per driver: max relative error and greedy agreement."""
    steps = scenario(vocab)
    errors = {k: 0.0 for k in others}
    agree = {k: True for k in others}
    prev = None
    while (inputs := steps(prev)) is not None:
        ref = reference.step(inputs).float().cpu()
        scale = max(1.0, ref.abs().max().item())
        for key, driver in others.items():
            out = driver.step(inputs).float().cpu()
            errors[key] = max(errors[key], (out - ref).abs().max().item() / scale)
            agree[key] &= out.argmax(-1).tolist() == ref.argmax(-1).tolist()
        prev = ref
    return [
        Check(f"{name}: {key} vs CPU reference logits", errors[key] <= rtol and agree[key],
              f"max rel err {errors[key]:.2e} (tol {rtol:.0e}), greedy argmax {'same' if agree[key] else 'DIFFERENT'}"
              + (f", {others[key].fallbacks} eager fallbacks" if others[key].runner is not None else ""))
        for key in others
    ]


# ------------------------------------------------------------------------------------------- part (a), (b)
def part_exactness(report: Report, work: Path, device: torch.device, tiny: bool, llama: Path | None) -> Path:
    """Part (a); ``llama`` is an existing tiny Llama checkpoint to reuse (made here when None)."""
    from checkpoints import make_checkpoint

    from ssd.models.loader import load_model

    capture = device.type == "cuda"
    rtol = 1e-4 if device.type == "cuda" else 1e-5
    archs = ["llama"] if tiny else ["llama", "qwen3"]
    target = None
    for arch in archs:
        path = llama if arch == "llama" and llama is not None else make_checkpoint(work / arch, arch)
        target = target or path
        cpu_model = load_model(path, dtype=torch.float32, device="cpu")[0].eval()
        dev_model = load_model(path, dtype=torch.float32, device=device)[0].eval()
        graphs = GraphRunnerConfig(max_batch_size=4, max_query_len=8, max_kv_len=256, capture=capture)
        drivers = {f"{device.type} eager": Driver(dev_model, 64),
                   f"{device.type} graph runner": Driver(dev_model, 64, graphs)}
        if fused_kernels_usable(device, dev_model.head_dim):
            fused_model = load_model(path, dtype=torch.float32, device=device)[0].eval()
            fused_model.enable_fused_kernels()
            drivers[f"{device.type} fused eager"] = Driver(fused_model, 64)
            drivers[f"{device.type} fused graph runner"] = Driver(fused_model, 64, graphs)
        report.checks += compare_drivers(arch, Driver(cpu_model, 64), drivers, cpu_model.config.vocab_size, rtol)
        if device.type == "cuda":
            report.checks.append(check_no_host_sync(arch, dev_model, device))
    report.checks.append(check_generation_vs_hf(target, device, tiny))
    return target


def check_no_host_sync(
    name: str, model: DecoderLM, device: torch.device, set_mode: Callable[[str], None] | None = None
) -> Check:
    """The per-layer forward (reference and static layouts) must not synchronise with the host: run it under
    ``torch.cuda.set_sync_debug_mode("error")``, which raises on any synchronising call (``set_mode`` replaces
    that switch, so the CPU smoke test can exercise this function)."""
    set_mode = set_mode or torch.cuda.set_sync_debug_mode
    steps = scenario(model.config.vocab_size)
    flat = steps(None)  # prefill of three sequences (reference layout with a mask)
    ids, positions, layouts, rows = flat.token_ids, flat.positions, flat.layouts, flat.logit_rows
    errors = []
    driver = Driver(model, 64, GraphRunnerConfig(max_batch_size=4, max_query_len=64, max_kv_len=256, capture=False))
    with torch.inference_mode():
        meta = build_attention_metadata(layouts, device)
        input_ids = torch.tensor(ids, device=device)
        pos = torch.tensor(positions, device=device)
        shape = driver.runner.policy.select(len(layouts), max(len(s.write_slots) for s in layouts),
                                            max(len(s.read_slots) for s in layouts))
        views = driver.runner.inputs.load(pack_step(shape, ids, positions, layouts, rows, driver.runner.pad_slot))
        sync(device)
        for label, fn in (("reference", lambda: model(input_ids, pos, meta, driver.caches)),
                          ("static", lambda: driver.runner._forward(views))):
            set_mode("error")
            try:
                fn()
            except RuntimeError as err:
                errors.append(f"{label}: {err}")
            finally:
                set_mode("default")
    return Check(f"{name}: forward without host synchronisation", not errors, "; ".join(errors) or "no sync")


def _gen_prompts(n: int, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1234)
    return [torch.randint(3, vocab, (3 + 7 * i,), generator=gen).tolist() for i in range(n)]


def check_generation_vs_hf(path: Path, device: torch.device, tiny: bool) -> Check:
    import transformers

    from ssd import LLM, SamplingParams

    new = 12 if tiny else 32
    prompts = _gen_prompts(3, 500)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    expected = []
    with torch.inference_mode():
        for p in prompts:
            out = hf.generate(torch.tensor([p]), max_new_tokens=new, do_sample=False, min_new_tokens=new,
                              pad_token_id=0)
            expected.append(out[0, len(p):].tolist())
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    with LLM(str(path), device=str(device), dtype="float32", kv_cache_memory="16MiB", max_model_len=256,
             block_size=BLOCK) as llm:
        got = [o.token_ids for o in llm.generate(prompts, params)]
    same = got == expected
    return Check(f"LLM greedy on {device.type} == transformers greedy (CPU)", same,
                 f"{len(prompts)} prompts x {new} tokens" + ("" if same else f"; ours {got} vs hf {expected}"))


def part_spec_modes(report: Report, target: Path, work: Path, device: torch.device, tiny: bool) -> None:
    from ssd_utils import make_perturbed_draft

    from ssd import LLM, SamplingParams

    draft = make_perturbed_draft(target, work / "draft", sigma=0.04)
    new = 12 if tiny else 40
    prompts = _gen_prompts(3, 500)
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    base = dict(device=str(device), dtype="float32", kv_cache_memory="16MiB", max_model_len=256, block_size=BLOCK)
    draft_device = "cuda:1" if device.type == "cuda" and torch.cuda.device_count() > 1 else str(device)
    modes = {
        "AR": {},
        "SD": {"speculative_config": {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 4}},
        "SSD": {"speculative_config": {"method": "ssd", "model": str(draft), "num_speculative_tokens": 4,
                                       "fan_out": 2, "draft_device": draft_device}},
    }
    tokens = {}
    for mode, extra in modes.items():
        with LLM(str(target), **base, **extra) as llm:
            tokens[mode] = [o.token_ids for o in llm.generate(prompts, params)]
            # second pass: graphs captured; on a tiny model this is the engine's own per-token cost
            started = time.perf_counter()
            again = [o.token_ids for o in llm.generate(prompts, params)]
            elapsed = time.perf_counter() - started
        report.engine[mode] = {"tok_per_s": len(prompts) * new / elapsed, "repeat_same": again == tokens[mode]}
        print(f"  engine {mode} on {device.type}: {report.engine[mode]['tok_per_s']:.1f} tok/s "
              f"({len(prompts)} prompts in one batch, tiny model)", flush=True)
    same = tokens["AR"] == tokens["SD"] == tokens["SSD"]
    report.checks.append(Check(f"AR == SD == SSD greedy on {device.type} (SSD draft on {draft_device})", same,
                               f"{len(prompts)} prompts x {new} tokens"
                               + ("" if same else f"; {tokens}")))


# ------------------------------------------------------------------------------------------- part (c)
def part_timing(report: Report, device: torch.device, args: argparse.Namespace) -> None:
    tiny, iters, kv_len = args.tiny, args.iters, args.kv_len
    dtype = torch.bfloat16
    nbytes = (64 << 20) if tiny else (1 << 30)
    bandwidth = copy_bandwidth(device, nbytes, 3 if tiny else 10)
    report.bandwidth_gbps = bandwidth / 1e9
    print(f"copy bandwidth {report.bandwidth_gbps:.1f} GB/s (read + write)", flush=True)
    K = 7
    tree_width = 2 * (K + 1)  # fan-out 2 at every acceptance length
    plans = [  # (model name, step, queries, tree)
        ("target", "AR decode", 1, False),
        ("target", f"verify K+1={K + 1}", K + 1, False),
        ("draft", f"tree M={tree_width}", tree_width, True),
        ("draft", "AR decode", 1, False),
    ]
    # the draft first: the target's optional compile comes last, so a slow compile loses no other rows
    shapes = {"draft": TINY_DRAFT if tiny else LLAMA32_1B, "target": TINY_TARGET if tiny else LLAMA3_8B}
    num_blocks = -(-kv_len // BLOCK) + 1
    for name, shape in shapes.items():
        model = random_model(shape, dtype, device)
        report.weight_bytes[name] = weight_bytes_read(model)
        floor_ms = report.weight_bytes[name] / bandwidth * 1e3
        fused = fused_kernels_usable(device, model.head_dim)
        for timing in timing_modes(device, args.compile and name == "target", fused, args.attention_splits):
            mode = timing.name
            graphs = None if timing.graphs is None else GraphRunnerConfig(
                max_batch_size=1, max_query_len=tree_width, max_kv_len=kv_len, **timing.graphs)
            model.enable_fused_kernels(timing.fused, timing.cols_per_split)
            started = time.perf_counter()
            driver = Driver(model, num_blocks, graphs)
            ar_ms = None
            for model_name, step, queries, tree in plans:
                if model_name != name:
                    continue
                inputs = step_inputs(queries, kv_len, tree, shape["vocab_size"])
                ms = time_step(driver, inputs, warmup=2 if tiny else 5, iters=iters, device=device)
                if step == "AR decode":
                    ar_ms = ms
                row = Timing(name, step, 1, queries, kv_len, mode, ms, floor_ms, ms / floor_ms)
                report.timings.append(row)
                print(f"  {name} {step} {mode}: {ms:.3f} ms ({row.x_floor:.2f}x floor)", flush=True)
            for t in report.timings:
                if t.model == name and t.mode == mode and ar_ms:
                    t.vs_ar = t.step_ms / ar_ms
            logger.info("%s %s: %.1f s including capture/compile", name, mode, time.perf_counter() - started)
            if args.profile and name == "target" and mode.endswith("static eager"):
                report.profiles[mode] = profile_step(driver, step_inputs(1, kv_len, False, shape["vocab_size"]),
                                                     device)
                print_profile(mode, report.profiles[mode])
            del driver
        del model
        if device.type == "cuda":
            torch.cuda.empty_cache()
    # judged on the faster graph mode (compile is optional), verify against the AR step of the same mode
    ar_rows = [t for t in report.timings if t.model == "target" and t.step == "AR decode" and "graphs" in t.mode
               and "keys/split" not in t.mode]  # a sweep's settings are not the engine's
    graph_mode = min(ar_rows, key=lambda t: t.step_ms).mode if ar_rows else None
    graph_rows = {(t.model, t.step): t for t in report.timings if t.mode == graph_mode}
    ar = graph_rows.get(("target", "AR decode"))
    verify = graph_rows.get(("target", f"verify K+1={K + 1}"))
    report.targets = {
        "mode": graph_mode,
        "ar_x_floor_with_graphs": None if ar is None else ar.x_floor,
        "ar_target": AR_TARGET,
        "ar_met": None if ar is None else ar.x_floor <= AR_TARGET,
        "verify_vs_ar_with_graphs": None if verify is None else verify.vs_ar,
        "verify_target": VERIFY_TARGET,
        "verify_met": None if verify is None else verify.vs_ar <= VERIFY_TARGET,
    }


# ------------------------------------------------------------------------------------------- part (d)
ENGINE_BODY = dict(hidden_size=2048, intermediate_size=8192, num_layers=16, num_heads=32, num_kv_heads=8)
TINY_BODY = dict(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2)


def part_engine(report: Report, work: Path, device: torch.device, args: argparse.Namespace) -> None:
    """(d) Does the engine keep up with the device? Greedy decoding through ``LLM`` at batch 1 on a
    Llama-3.2-1B-shaped body (the tiny checkpoints' 512-token vocabulary, so their tokenizer fits), against the
    bare AR step of the same model as part (c) times it (fused kernels and graphs as the engine uses them)."""
    from checkpoints import make_checkpoint

    from ssd import LLM, SamplingParams
    from ssd.models.loader import load_model

    path = make_checkpoint(work / "engine_model", "llama", **(TINY_BODY if args.tiny else ENGINE_BODY))
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    new = 12 if args.tiny else 96
    prompt = _gen_prompts(1, 500)[0]
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    with LLM(str(path), device=str(device), dtype=dtype, kv_cache_memory="64MiB", max_model_len=256,
             block_size=BLOCK) as llm:
        llm.generate([prompt], params)  # captures the graphs
        output = llm.generate([prompt], params)[0]
    engine_ms = 1e3 / output.metrics.decode_tokens_per_s
    model = load_model(path, dtype=getattr(torch, dtype), device=device)[0].eval()
    model.enable_fused_kernels(fused_kernels_usable(device, model.head_dim))
    kv_len = 64  # the engine's key bucket for most of these steps
    driver = Driver(model, -(-kv_len // BLOCK) + 1, GraphRunnerConfig(
        max_batch_size=1, max_query_len=1, max_kv_len=kv_len, capture=device.type == "cuda"))
    bare_ms = time_step(driver, step_inputs(1, kv_len, False, model.config.vocab_size), warmup=3,
                        iters=args.iters, device=device)
    report.engine_overhead = {"model": "Llama-3.2-1B-shaped body, vocabulary 512" if not args.tiny else "tiny",
                              "dtype": dtype, "new_tokens": new, "engine_step_ms": engine_ms,
                              "bare_step_ms": bare_ms, "engine_over_bare": engine_ms / bare_ms}
    print(f"  engine decode step {engine_ms:.3f} ms vs bare step {bare_ms:.3f} ms "
          f"({engine_ms / bare_ms:.2f}x)", flush=True)


# ------------------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda", help="cuda, cuda:N or cpu (default cuda)")
    p.add_argument("--tiny", action="store_true", help="tiny timing models and short runs (CPU smoke test)")
    p.add_argument("--skip", default="", help="comma-separated parts to skip: exactness, spec, timing, engine")
    p.add_argument("--iters", type=int, default=None, help="timed steps per row (default 30; 3 with --tiny)")
    p.add_argument("--kv-len", type=int, default=None, help="slots each timed step reads (default 512; 64 tiny)")
    p.add_argument("--checkpoint", default=None,
                   help="tiny random Llama checkpoint folder to reuse for (a) and (b) (default: make one)")
    p.add_argument("--compile", action="store_true",
                   help="also time the target's torch.compile'd forward under CUDA graphs (one compile per bucket)")
    p.add_argument("--profile", action="store_true", help="kernel breakdown of one target AR decode step")
    p.add_argument("--attention-splits", default="",
                   help="comma-separated keys per program to time fused graphs with besides the default "
                        "(ssd.models.fused_kernels.ATTENTION_COLS_PER_SPLIT)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads during the run (default: unchanged)")
    p.add_argument("--json", default=str(RESULTS_DIR / "gpu_check.json"), help="where to write the results")
    args = p.parse_args(argv)
    args.skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    args.attention_splits = [int(n) for n in args.attention_splits.split(",") if n.strip()]
    unknown = args.skip - {"exactness", "spec", "timing", "engine"}
    if unknown:
        p.error(f"unknown parts to skip: {sorted(unknown)}")
    args.iters = args.iters or (3 if args.tiny else 30)
    args.kv_len = args.kv_len or (64 if args.tiny else 512)
    return args


def print_report(report: Report) -> None:
    print(f"\ndevice {report.device}" + (" (tiny shapes)" if report.tiny else ""))
    for c in report.checks:
        print(f"  [{'PASS' if c.passed else 'FAIL'}] {c.name}: {c.detail}")
    if report.engine_overhead:
        e = report.engine_overhead
        print(f"engine ({e['model']}, {e['dtype']}, batch 1): decode step {e['engine_step_ms']:.3f} ms, bare step "
              f"{e['bare_step_ms']:.3f} ms, {e['engine_over_bare']:.2f}x")
    if report.timings:
        print(f"copy bandwidth {report.bandwidth_gbps:.1f} GB/s (read + write); weight bytes read per step: "
              + ", ".join(f"{k} {v / 1e9:.3f} GB" for k, v in report.weight_bytes.items()))
        print_table(
            ["model", "step", "B", "Q", "kv slots", "mode", "step ms", "floor ms", "x floor", "x AR step"],
            [[t.model, t.step, t.batch, t.queries, t.kv_len, t.mode, round(t.step_ms, 3), round(t.floor_ms, 3),
              t.x_floor, t.vs_ar] for t in report.timings],
        )
        if report.targets.get("ar_met") is not None:
            print(f"targets ({report.targets['mode']}): AR {report.targets['ar_x_floor_with_graphs']:.2f}x floor "
                  f"(<= {AR_TARGET}: {'met' if report.targets['ar_met'] else 'NOT met'}); verify "
                  f"{report.targets['verify_vs_ar_with_graphs']:.2f}x AR step "
                  f"(<= {VERIFY_TARGET}: {'met' if report.targets['verify_met'] else 'NOT met'})")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("CUDA is not available here; use --device cpu --tiny for the CPU smoke test")
    report = Report(str(device), args.tiny)
    threads = torch.get_num_threads()
    if args.threads:
        torch.set_num_threads(args.threads)
    try:
        run_parts(report, args, device)
    finally:
        torch.set_num_threads(threads)
    print_report(report)
    options = {k: (sorted(v) if isinstance(v, set) else v) for k, v in vars(args).items()}
    data = {"machine": machine_info(), "args": options, **asdict(report), "passed": report.passed}
    if device.type == "cuda":
        data["gpu"] = torch.cuda.get_device_name(device)
    print(f"wrote {write_json(data, args.json)}")
    return 0 if report.passed else 1


def run_parts(report: Report, args: argparse.Namespace, device: torch.device) -> None:
    """Every part runs even when an earlier one raises (a device run is scarce: one run, the whole report);
    a part that raises becomes a failed check carrying the end of its traceback."""
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as tmp:
        work = Path(tmp)
        state = {"target": Path(args.checkpoint) if args.checkpoint else None}

        def exactness() -> None:
            state["target"] = part_exactness(report, work, device, args.tiny, state["target"])

        def spec() -> None:
            if state["target"] is None:
                from checkpoints import make_checkpoint

                state["target"] = make_checkpoint(work / "llama", "llama")
            part_spec_modes(report, state["target"], work, device, args.tiny)

        parts = {"exactness": exactness, "spec": spec, "engine": lambda: part_engine(report, work, device, args),
                 "timing": lambda: part_timing(report, device, args)}
        for name, run in parts.items():
            if name in args.skip:
                continue
            try:
                run()
            except Exception as err:  # noqa: BLE001 - reported as a failed check, the other parts still run
                logger.exception("part %s raised", name)
                tail = traceback.format_exc().strip().splitlines()[-6:]
                report.checks.append(Check(f"part {name} ran to the end", False, f"{err!r}; " + " | ".join(tail)))


if __name__ == "__main__":
    sys.exit(main())
