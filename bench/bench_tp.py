"""Tensor-parallel decode speed: TP = 1 vs TP = 2 (or any sizes) on the same random Llama, side by side.

Each configuration lives in its own process (the TP = 2 one spawns its worker rank) and configurations are
interleaved repeat by repeat; the reported ratio is the median of per-repeat ratios. The model is a random
Llama-shaped checkpoint built once (16 heads / 8 KV heads so that TP = 2 splits evenly; the default target
SmolLM2-135M has 9 heads and cannot be split in two). On a 2-core CPU, TP = 2 gives each rank one core
where TP = 1 runs two threads, so the ratio measures the cost of the all-reduces against OpenMP threading;
on GPUs it measures the real scaling.

    python bench/bench_tp.py --tp 1,2 --batch-sizes 1,4 --output-len 32 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH_DIR.parent / "tests"))  # tests/checkpoints.py builds random checkpoints


def build_model(folder: Path, hidden: int, layers: int) -> Path:
    from checkpoints import make_checkpoint

    return make_checkpoint(
        folder, "llama", vocab_size=32000, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
        num_layers=layers, num_heads=16, num_kv_heads=8,
    )


def worker(conn, model: str, tp: int, threads: int, dtype: str, device: str) -> None:
    from ssd import LLM, SamplingParams

    llm = LLM(model, dtype=dtype, device=device, tensor_parallel_size=tp, num_threads=threads, kv_cache_memory="256MiB")
    conn.send("ready")
    try:
        while True:
            job = conn.recv()
            if job is None:
                break
            prompts, output_len = job
            params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
            engine = llm.engine
            for p in prompts:
                engine.add_request(p, params)
            first_step_end, outputs = None, {}
            start = time.perf_counter()
            while engine.has_unfinished():
                for out in engine.step():
                    if out.finished:
                        outputs[out.request_id] = out.token_ids
                if first_step_end is None:
                    first_step_end = time.perf_counter()
            end = time.perf_counter()
            decode_tokens = len(prompts) * (output_len - 1)
            conn.send(dict(decode_tok_s=decode_tokens / (end - first_step_end), ttft_s=first_step_end - start,
                           tokens=[outputs[k] for k in sorted(outputs, key=int)]))
    finally:
        llm.shutdown()


def agreeing_prefix(a: list[list[int]], b: list[list[int]]) -> list[int]:
    """Per prompt, how many leading tokens two runs share (bf16 sums in a different order may flip a
    near-tie; float32 runs are asserted token-equal in tests/test_tensor_parallel.py)."""
    lengths = []
    for x, y in zip(a, b):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        lengths.append(n)
    return lengths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint folder (default: a random Llama built once)")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--tp", default="1,2")
    ap.add_argument("--threads", type=int, default=None, help="threads per rank (default: cores / tp)")
    ap.add_argument("--batch-sizes", default="1,4")
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", default=str(BENCH_DIR / "results" / "tp_latest.json"))
    args = ap.parse_args()
    cores = len(os.sched_getaffinity(0))
    sizes = [int(x) for x in args.tp.split(",")]
    batches = [int(x) for x in args.batch_sizes.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(build_model(Path(tmp) / "model", args.hidden, args.layers))
        ctx = mp.get_context("spawn")
        workers = {}
        for tp in sizes:
            threads = args.threads or max(1, cores // tp)
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=worker, args=(child, model, tp, threads, args.dtype, args.device))
            proc.start()
            assert parent.recv() == "ready"
            workers[tp] = (parent, proc, threads)
        results: dict[str, list[dict]] = {}
        try:
            for r in range(args.repeats):
                for b in batches:
                    prompts = [[(7 * i + 13 * j) % 30000 + 100 for j in range(16)] for i in range(b)]
                    order = sizes[r % len(sizes):] + sizes[: r % len(sizes)]
                    for tp in order:
                        workers[tp][0].send((prompts, args.output_len))
                        results.setdefault(f"tp{tp}-b{b}", []).append(workers[tp][0].recv())
        finally:
            for conn, proc, _ in workers.values():
                conn.send(None)
                proc.join()

    base = sizes[0]
    summary = {"command": " ".join(sys.argv), "machine": f"{platform.machine()}, {cores} cores", "model": model,
               "dtype": args.dtype, "device": args.device, "configs": {}, "ratios": {}}
    print(f"{'config':<12} {'threads':>7} {'decode tok/s':>13} {'TTFT ms':>8}")
    for key, runs in results.items():
        tp = int(key.split("-")[0][2:])
        tok_s = statistics.median(x["decode_tok_s"] for x in runs)
        ttft = statistics.median(x["ttft_s"] for x in runs) * 1e3
        summary["configs"][key] = dict(decode_tok_s=tok_s, ttft_ms=ttft, per_repeat=[x["decode_tok_s"] for x in runs])
        print(f"{key:<12} {workers[tp][2]:>7} {tok_s:>13.1f} {ttft:>8.1f}")
    for b in batches:
        for tp in sizes[1:]:
            pairs = zip(results[f"tp{tp}-b{b}"], results[f"tp{base}-b{b}"])
            ratio = statistics.median(x["decode_tok_s"] / y["decode_tok_s"] for x, y in pairs)
            agree = agreeing_prefix(results[f"tp{tp}-b{b}"][0]["tokens"], results[f"tp{base}-b{b}"][0]["tokens"])
            summary["ratios"][f"tp{tp}_over_tp{base}_b{b}"] = ratio
            summary["configs"][f"tp{tp}-b{b}"]["agreeing_prefix"] = agree
            print(f"tp{tp}/tp{base} decode, batch {b}: {ratio:.2f}x  (greedy agreeing prefix per prompt: {agree})")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
