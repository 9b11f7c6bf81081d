"""Load test of the OpenAI-compatible server: N concurrent streaming requests on loopback, finite in count and time.

Starts ``ssd serve`` in a subprocess on a free loopback port (or uses ``--url``), sends ``--num-requests``
streaming chat (or completion) requests with at most ``--concurrency`` in flight from one asyncio process, and
checks every one: HTTP 200, a final ``finish_reason``, exactly ``--max-tokens`` tokens (``ignore_eos``), no
error events; with greedy decoding it also counts requests whose text differs from another request with the
same prompt (a failure in float32; in bfloat16 batch-dependent rounding can flip near-tied tokens).
Reports p50/p99 end-to-end latency, time to first token, inter-token latency, and throughput.

    python bench/bench_server.py                              # default target, AR, 64 x 64 tokens
    python bench/bench_server.py --draft D --method ssd       # SSD
    python bench/bench_server.py --url http://127.0.0.1:8000  # an already running server

Exit status 0 only if every request completed correctly. Times are reported, never asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import selectors
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from inputs import CHAT_PROMPTS, RESULTS_DIR, resolve_model  # noqa: E402
from machine import machine_info  # noqa: E402
from report import print_table, write_json  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


@dataclass
class Result:
    index: int
    prompt: str
    status: int = 0
    text: str = ""
    num_tokens: int = 0
    finish_reason: str | None = None
    start_s: float = 0.0
    ttft_s: float | None = None
    latency_s: float | None = None
    chunk_times: list[float] = field(default_factory=list)
    speculative: dict[str, Any] | None = None
    error: str | None = None


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100]); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


async def one_request(client: httpx.AsyncClient, index: int, prompt: str, args: argparse.Namespace,
                      model: str, t0: float) -> Result:
    result = Result(index, prompt)
    body: dict[str, Any] = {"model": model, "max_tokens": args.max_tokens, "temperature": args.temperature,
                            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    if args.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = prompt
        path = "/v1/completions"
    start = time.perf_counter()
    result.start_s = start - t0
    parts: list[str] = []
    try:
        async with client.stream("POST", path, json=body) as response:
            result.status = response.status_code
            if response.status_code != 200:
                result.error = (await response.aread()).decode(errors="replace")[:300]
                return result
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    result.error = event["error"].get("message", "error event")
                    break
                if event.get("usage"):
                    result.num_tokens = event["usage"]["completion_tokens"]
                    result.speculative = event["usage"].get("speculative")
                for choice in event.get("choices") or []:
                    text = (choice.get("delta") or {}).get("content") if args.endpoint == "chat" else choice["text"]
                    if text:
                        now = time.perf_counter() - start
                        result.ttft_s = now if result.ttft_s is None else result.ttft_s
                        result.chunk_times.append(now)
                        parts.append(text)
                    result.finish_reason = choice.get("finish_reason") or result.finish_reason
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    result.latency_s = time.perf_counter() - start
    result.text = "".join(parts)
    return result


async def run_load(url: str, model: str, args: argparse.Namespace) -> tuple[list[Result], float]:
    prompts = [CHAT_PROMPTS[i % len(CHAT_PROMPTS)] for i in range(args.num_requests)]
    limits = httpx.Limits(max_connections=args.concurrency, max_keepalive_connections=args.concurrency)
    semaphore = asyncio.Semaphore(args.concurrency)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=args.timeout) as client:
        t0 = time.perf_counter()

        async def bounded(i: int, prompt: str) -> Result:
            async with semaphore:
                return await one_request(client, i, prompt, args, model, t0)

        results = await asyncio.wait_for(asyncio.gather(*(bounded(i, p) for i, p in enumerate(prompts))),
                                         timeout=args.timeout)
        return list(results), time.perf_counter() - t0


def check(results: list[Result], args: argparse.Namespace) -> list[str]:
    """Every way a request can be wrong, one line each (empty: all correct)."""
    problems = []
    for r in results:
        if r.error or r.status != 200:
            problems.append(f"request {r.index}: status {r.status}, error {r.error}")
        elif r.finish_reason != "length" or r.num_tokens != args.max_tokens:
            problems.append(f"request {r.index}: finish_reason={r.finish_reason}, {r.num_tokens} tokens "
                            f"(expected length, {args.max_tokens})")
    return problems


def greedy_mismatches(results: list[Result]) -> list[int]:
    """Requests whose greedy text differs from the first request with the same prompt.

    In float32 this is an exactness check; in bfloat16 the engine's numerics vary with batch composition, so
    near-tied argmaxes can flip (reported, and a failure only with --strict-consistency).
    """
    first: dict[str, str] = {}
    return [r.index for r in results if r.error is None and first.setdefault(r.prompt, r.text) != r.text]


def summarise(results: list[Result], wall_s: float) -> dict[str, Any]:
    ok = [r for r in results if r.error is None and r.status == 200]
    latencies = [r.latency_s for r in ok if r.latency_s is not None]
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    itls = [b - a for r in ok for a, b in zip(r.chunk_times, r.chunk_times[1:])]
    tokens = sum(r.num_tokens for r in ok)
    summary: dict[str, Any] = {
        "requests": len(results),
        "completed": len(ok),
        "wall_s": wall_s,
        "output_tokens": tokens,
        "throughput_tok_s": tokens / wall_s if wall_s > 0 else None,
        "throughput_req_s": len(ok) / wall_s if wall_s > 0 else None,
        "latency_p50_s": percentile(latencies, 50),
        "latency_p99_s": percentile(latencies, 99),
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "itl_p50_s": percentile(itls, 50),
        "itl_p99_s": percentile(itls, 99),
        "latency_mean_s": statistics.fmean(latencies) if latencies else None,
    }
    specs = [r.speculative for r in ok if r.speculative]
    if specs:
        drafts = sum(s["num_drafts"] for s in specs)
        summary["mean_acceptance_length"] = sum(s["num_emitted_tokens"] for s in specs) / drafts if drafts else None
        lookups = sum(s["cache_lookups"] for s in specs)
        summary["ssd_cache_hit_rate"] = sum(s["cache_hits"] for s in specs) / lookups if lookups else None
    return summary


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "ssd.cli.main", "serve", "--model", resolve_model(args.model), "--dtype", args.dtype,
           "--host", "127.0.0.1", "--port", "0", "--max-num-seqs", str(args.max_num_seqs),
           "--max-waiting-requests", str(max(args.concurrency, args.num_requests)),
           "--served-model-name", "bench"]
    if args.max_model_len:
        cmd += ["--max-model-len", str(args.max_model_len)]
    if args.kv_cache_memory:
        cmd += ["--kv-cache-memory", args.kv_cache_memory]
    if args.draft:
        cmd += ["--draft", resolve_model(args.draft), "--method", args.method, "--k", str(args.k)]
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env, cwd=REPO)
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        line = proc.stdout.readline() if sel.select(args.timeout) else ""
    if " at http://" not in line:
        proc.kill()
        raise SystemExit(f"ssd serve did not start (exit code {proc.poll()}): {line!r}")
    url = line.split(" at ", 1)[1].strip().removesuffix("/v1")
    deadline = time.monotonic() + args.timeout
    while True:
        try:
            if httpx.get(url + "/health").status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            raise SystemExit("ssd serve never became healthy")
        time.sleep(0.1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default=None, help="use this running server instead of starting one")
    parser.add_argument("--model", default=None, help="target checkpoint (default: the fetched SmolLM2-135M)")
    parser.add_argument("--draft", default=None)
    parser.add_argument("--method", default="ssd", choices=["ssd", "draft_model"])
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--kv-cache-memory", default=None)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--endpoint", default="chat", choices=["chat", "completions"])
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--timeout", type=float, default=600.0, help="bound on the whole load (seconds)")
    parser.add_argument("--strict-consistency", action="store_true",
                        help="fail when identical greedy prompts give different text (always on for float32)")
    parser.add_argument("--json", default=None, help="write the results here (default: bench/results/)")
    args = parser.parse_args()
    if args.num_requests < 1 or args.concurrency < 1:
        raise SystemExit("--num-requests and --concurrency must be >= 1")

    proc = None
    try:
        if args.url:
            url = args.url.rstrip("/").removesuffix("/v1")
        else:
            proc, url = start_server(args)
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        results, wall_s = asyncio.run(run_load(url, model, args))
        metrics_text = httpx.get(url + "/metrics").text if httpx.get(url + "/health").status_code == 200 else ""
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()

    problems = check(results, args)
    summary = summarise(results, wall_s)
    if args.temperature == 0:
        mismatched = greedy_mismatches(results)
        summary["greedy_mismatches"] = len(mismatched)
        if mismatched and (args.strict_consistency or args.dtype == "float32"):
            problems += [f"request {i}: greedy text differs from another request with the same prompt"
                         for i in mismatched]
    rows = [[k, v] for k, v in summary.items()]
    mode = f"{args.method} (K={args.k})" if args.draft else "AR"
    print_table(["metric", "value"], rows,
                title=f"{args.num_requests} streaming {args.endpoint} requests, concurrency {args.concurrency}, "
                      f"{args.max_tokens} tokens each, {mode}")
    for problem in problems[:20]:
        print(f"PROBLEM: {problem}")
    print(f"\n{len(results) - len(problems)} passed, {len(problems)} failed" if problems else
          f"\nall {len(results)} requests completed correctly")
    out = args.json or RESULTS_DIR / f"server_{int(time.time())}.json"
    path = write_json({"args": vars(args), "machine": machine_info(), "summary": summary,
                       "problems": problems, "requests": [asdict(r) | {"chunk_times": None} for r in results],
                       "server_metrics_excerpt": [line for line in metrics_text.splitlines() if line.startswith("ssd:")
                                                  and "_bucket" not in line]}, out)
    print(f"results: {path}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
