"""SSD with its draft local (a child process) against a draft server (``ssd draft-serve``) over loopback, and over
loopback with an added delay, side by side (issue 30).

Each configuration runs in a fresh process, the configurations taking turns within each repeat: the target on
core 0 with one thread, the draft on core 1 with one thread (a local draft gets that core from the engine's
layout; a server is started with ``taskset -c 1``). Delayed runs reach the server through ``delay_proxy.py``,
which holds every byte D ms in each direction (a request -> reply round trip gains 2 D); ``tc netem`` would be
the kernel's way, but containers often lack its module (this one does: "Specified qdisc kind is unknown"). A
``proxy+0ms`` row measures the forwarder's own cost. Greedy outputs must be identical in every layout.

    python bench/remote_draft.py --draft models/smollm2-draft --datasets humaneval,chat --num-prompts 4 \\
        --output-len 48 --batch-sizes 1,4 --delays-ms 0,0.1,0.5,2 --repeats 2 --json bench/results/remote_draft.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.inputs import resolve_model  # noqa: E402
from bench.machine import machine_info  # noqa: E402
from bench.prompt_sets import load_prompt_set  # noqa: E402

TARGET_CORE, DRAFT_CORE = 0, 1


def _start_server(draft: str, token: str, workdir: str) -> tuple[subprocess.Popen, str]:
    port_file = os.path.join(workdir, "port")
    env = dict(os.environ, SSD_DRAFT_TOKEN=token)
    proc = subprocess.Popen(
        ["taskset", "-c", str(DRAFT_CORE), sys.executable, "-m", "ssd.cli.main", "draft-serve", "--model", draft,
         "--threads", "1", "--port-file", port_file],
        env=env, stdout=subprocess.DEVNULL, stderr=open(os.path.join(workdir, "server.log"), "w"), cwd=ROOT,
    )
    deadline = time.monotonic() + 120
    while not os.path.exists(port_file) or not open(port_file).read().strip():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the draft server did not start: " + open(os.path.join(workdir, "server.log")).read())
        time.sleep(0.1)
    return proc, f"tcp://127.0.0.1:{open(port_file).read().strip()}"


def run_child(cfg: dict) -> dict:
    """One layout at one batch size over every dataset (in this process)."""
    from dataclasses import replace

    from ssd import LLM, SamplingParams

    spec = {"method": "ssd", "num_speculative_tokens": cfg["k"]}
    server = proxy = None
    workdir = tempfile.mkdtemp(prefix="ssd-remote-bench-")
    try:
        if cfg["layout"] == "ar":  # plain decoding, the target alone on its core: the budget's reference
            spec = None
            os.sched_setaffinity(0, {TARGET_CORE})
            threads = 1
        elif cfg["layout"] == "local":
            spec["model"] = cfg["draft"]
            threads = None  # the engine's layout: target on the first core, the draft process on the last
        else:
            token = secrets.token_hex(16)
            server, url = _start_server(cfg["draft"], token, workdir)
            if cfg["delay_ms"] is not None:
                proxy = subprocess.Popen([sys.executable, str(ROOT / "bench" / "delay_proxy.py"), "--to",
                                          url.removeprefix("tcp://"), "--delay-ms", str(cfg["delay_ms"])],
                                         stdout=subprocess.PIPE, text=True)
                url = f"tcp://127.0.0.1:{proxy.stdout.readline().strip()}"
            spec.update(draft_url=url, draft_token=token)
            os.sched_setaffinity(0, {TARGET_CORE})
            threads = 1
        llm = LLM(cfg["target"], max_num_seqs=cfg["batch"], num_threads=threads, speculative_config=spec)
        try:
            llm.generate(["Count from one to twenty:"], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
            out = {}
            for name, prompts in cfg["prompts"].items():
                params = SamplingParams(temperature=0.0, max_tokens=cfg["output_len"], ignore_eos=True)
                before = replace(llm.engine.spec_stats)
                start = time.perf_counter()
                outputs = llm.generate(prompts, params)
                elapsed = time.perf_counter() - start
                after = replace(llm.engine.spec_stats)
                rounds = after.draft_rounds - before.draft_rounds
                lookups = after.cache_lookups - before.cache_lookups
                drafts = after.num_drafts - before.num_drafts
                tokens = sum(len(o.token_ids) for o in outputs)
                out[name] = {
                    "tok_s": tokens / elapsed,
                    "hit_rate": (after.cache_hits - before.cache_hits) / lookups if lookups else None,
                    "mean_acceptance_length": (after.num_emitted_tokens - before.num_emitted_tokens) / drafts
                    if drafts else None,
                    "rounds": rounds,
                    "reply_wait_ms": 1e3 * (after.draft_reply_wait_s - before.draft_reply_wait_s) / max(rounds, 1),
                    "serve_ms": 1e3 * (after.draft_serve_s - before.draft_serve_s) / max(rounds, 1),
                    "bytes_per_round": (after.draft_bytes_sent + after.draft_bytes_received - before.draft_bytes_sent
                                        - before.draft_bytes_received) / max(rounds, 1),
                    "link_rtt_ms": None if after.draft_link_rtt_s is None else 1e3 * after.draft_link_rtt_s,
                    "speculating": llm.engine.proposer is not None and llm.engine.proposer.available,
                    "tokens_digest": hashlib.sha256(json.dumps([o.token_ids for o in outputs]).encode()).hexdigest(),
                }
                out[name]["link_and_queue_ms"] = out[name]["reply_wait_ms"] - out[name]["serve_ms"]
            return out
        finally:
            llm.shutdown()
    finally:
        for process in (proxy, server):
            if process is not None:
                process.terminate()
                process.wait(30)
        shutil.rmtree(workdir, ignore_errors=True)


def _run_config(cfg: dict) -> dict | str:
    cmd = [sys.executable, __file__, "--child", json.dumps(cfg)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        return "failed: " + proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "failed"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--target", default=None, help="target folder (default: the fetched SmolLM2-135M-Instruct)")
    parser.add_argument("--draft", default=str(ROOT / "models" / "smollm2-draft"))
    parser.add_argument("--datasets", default="humaneval,chat")
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--output-len", type=int, default=48)
    parser.add_argument("--batch-sizes", default="1,4")
    parser.add_argument("--delays-ms", default="0,0.1,0.5,2",
                        help="one-way delays the proxy adds on loopback (0: the proxy alone)")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_child(json.loads(args.child))))
        return
    target = resolve_model(args.target)
    prompts = {name: load_prompt_set(name, target, args.num_prompts).prompts for name in args.datasets.split(",")}
    layouts = [("ar", None), ("local", None), ("remote", None)] + [("remote", float(d)) for d in args.delays_ms.split(",") if d]
    runs: dict[str, list] = {}
    for repeat in range(args.repeats):
        for batch in [int(b) for b in args.batch_sizes.split(",")]:
            for layout, delay in layouts:
                key = f"{layout}{'' if delay is None else f'+proxy{delay:g}ms'} b{batch}"
                cfg = dict(layout=layout, delay_ms=delay, batch=batch, target=target, draft=args.draft, k=args.k,
                           output_len=args.output_len, prompts=prompts)
                result = _run_config(cfg)
                runs.setdefault(key, []).append(result)
                print(f"[repeat {repeat}] {key}: " + (result if isinstance(result, str) else ", ".join(
                    f"{n} {r['tok_s']:.1f} tok/s hit {r['hit_rate'] or 0:.2f} wait {r['reply_wait_ms']:.2f} ms "
                    f"(serve {r['serve_ms']:.2f})" for n, r in result.items())), flush=True)
    summary = _summarize(runs, prompts)
    print(json.dumps({"ratios": summary["ratios"], "link_budget": summary["link_budget"],
                      "identical_tokens": summary["identical_tokens"]}, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine_info(), "command": "python " + " ".join(sys.argv), "runs": runs,
                       **summary}, f, indent=1)


def _summarize(runs: dict[str, list], prompts: dict) -> dict:
    """Mean tok/s per layout and dataset over the repeats, each layout's ratio to local at the same batch, and
    whether every layout's tokens were identical."""
    means: dict[str, dict[str, float]] = {}
    digests: dict[str, set] = {name: set() for name in prompts}
    for key, results in runs.items():
        ok = [r for r in results if isinstance(r, dict)]
        if not ok:
            continue
        means[key] = {}
        for name in prompts:
            means[key][name] = sum(r[name]["tok_s"] for r in ok) / len(ok)
            for r in ok:
                digests[name].add(r[name]["tokens_digest"])
    ratios = {}
    for key, by_name in means.items():
        batch = key.split(" ")[1]
        local, ar = means.get("local " + batch), means.get("ar " + batch)
        if local and not key.startswith(("local", "ar")):
            ratios[key + " / local"] = {n: round(v / local[n], 3) for n, v in by_name.items()}
        if ar and not key.startswith("ar"):
            ratios[key + " / ar"] = {n: round(v / ar[n], 3) for n, v in by_name.items()}
    # The link's budget: a remote draft adds its round trip to every round, and SSD still beats AR while
    # L * T_ar > round time + extra, i.e. extra < batch * L * (1 / AR tok/s - 1 / local SSD tok/s) per round.
    budget = {}
    for key, by_name in means.items():
        if not key.startswith("local"):
            continue
        batch = key.split(" ")[1]
        ar = means.get("ar " + batch)
        if not ar:
            continue
        b = int(batch[1:])
        budget[batch] = {}
        for name in prompts:
            lengths = [r[name]["mean_acceptance_length"] for r in runs[key] if isinstance(r, dict)]
            length = sum(lengths) / len(lengths)
            budget[batch][name] = {"mean_acceptance_length": round(length, 3),
                                   "round_ms": round(1e3 * b * length / by_name[name], 2),
                                   "ar_ms_for_those_tokens": round(1e3 * b * length / ar[name], 2),
                                   "link_budget_ms": round(1e3 * b * length * (1 / ar[name] - 1 / by_name[name]), 2)}
    return {"mean_tok_s": means, "ratios": ratios, "link_budget": budget,
            "identical_tokens": {name: len(d) == 1 for name, d in digests.items()}}


if __name__ == "__main__":
    main()
