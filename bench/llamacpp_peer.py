"""llama.cpp as a peer: its decode speed on a GGUF file against ours on the same weights, same prompts, same
thread counts, measured in one run.

Two roles in one file. Run in this project's environment, it loads the suite's prompt sets (HumanEval, chat) as
token ids, times our engine's greedy decoding of them in each of ``--formats`` (AR, SD and ngram at each thread
count, SSD with the target on one core and the draft on another), then starts itself in llama.cpp's
environment (``scripts/setup_llamacpp.sh``) with ``--worker`` to time llama-cpp-python on the GGUF as it is
(plain decoding and its prompt-lookup decoding), and prints the ratios. Our target: ``fp16-packed`` and
``w8a8`` load the default target (converted from the same GGUF in bfloat16); the block formats (``q8_0``,
``q4_0``, ``q4_1``) load the GGUF imported in float32, so that a format matching the file's own (Q4_1 for the
default target, whose embedding / LM head is Q8_0) holds llama.cpp's weights bit for bit; ``gguf`` loads it
imported with ``keep_blocks`` (the file's blocks as stored).
Every engine gets the same token ids and produces exactly ``--output-len`` tokens (EOS banned); tok/s is
generated tokens over wall time, prompt included, one request at a time.

    python bench/llamacpp_peer.py --llamacpp-python .venv-llamacpp/bin/python --threads 1,2 \\
        --formats fp16-packed,q8_0,q4_1,gguf --json bench/results/llamacpp_peer.json

The worker role imports neither torch nor this package.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def worker(args: argparse.Namespace) -> int:
    """In llama.cpp's environment: time plain and prompt-lookup decoding of the prompts in ``args.prompts``."""
    import llama_cpp
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    job = json.loads(Path(args.prompts).read_text())
    results = {"llama_cpp_python": llama_cpp.__version__, "runs": {}}
    for threads in job["threads"]:
        for mode in ("plain", "prompt-lookup"):
            draft = LlamaPromptLookupDecoding(num_pred_tokens=job["k"]) if mode == "prompt-lookup" else None
            llm = llama_cpp.Llama(model_path=job["gguf"], n_ctx=job["n_ctx"], n_threads=threads,
                                  n_threads_batch=threads, n_batch=512, draft_model=draft, verbose=False)
            ban_eos = {llm.token_eos(): float("-inf")}
            llm.create_completion(job["sets"][0]["prompts"][0], max_tokens=8, temperature=0.0)  # warm-up
            for prompt_set in job["sets"]:
                tokens, seconds, texts = 0, 0.0, []
                for prompt in prompt_set["prompts"]:
                    llm.reset()
                    start = time.perf_counter()
                    out = llm.create_completion(prompt, max_tokens=job["output_len"], temperature=0.0,
                                                logit_bias=ban_eos)
                    seconds += time.perf_counter() - start
                    tokens += out["usage"]["completion_tokens"]
                    texts.append(out["choices"][0]["text"])
                key = f"{mode}-t{threads}"
                results["runs"].setdefault(key, {})[prompt_set["name"]] = {"tok_s": tokens / seconds,
                                                                          "texts": texts}
            del llm
    Path(args.out).write_text(json.dumps(results))
    return 0


def ours(model: str, sets: list, threads: int, output_len: int, speculative_config: dict | None = None,
         weight_format: str = "auto") -> dict:
    """Our engine's greedy decoding of every prompt set, one request at a time, tok/s per set (the target on
    ``threads`` threads; an SSD draft on the remaining core)."""
    import torch

    from ssd import LLM, SamplingParams

    torch.set_num_threads(threads)
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    out = {}
    with LLM(model, dtype="float32", weight_format=weight_format, num_threads=threads, kv_cache_memory="256MiB",
             max_model_len=2048, speculative_config=speculative_config) as llm:
        llm.generate([sets[0]["prompts"][0]], SamplingParams(temperature=0.0, max_tokens=8))  # warm-up
        for prompt_set in sets:
            tokens, seconds, texts = 0, 0.0, []
            for prompt in prompt_set["prompts"]:
                start = time.perf_counter()
                result = llm.generate([prompt], params)[0]
                seconds += time.perf_counter() - start
                tokens += len(result.token_ids)
                texts.append(result.text)
            out[prompt_set["name"]] = {"tok_s": tokens / seconds, "texts": texts}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--prompts", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--llamacpp-python", default=".venv-llamacpp/bin/python")
    p.add_argument("--gguf", default=None, help="GGUF file (default: the default target's, from its PyPI wheel)")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--output-len", type=int, default=48)
    p.add_argument("--k", type=int, default=4, help="draft tokens per round (ours and llama.cpp's prompt lookup)")
    p.add_argument("--formats", default="fp16-packed,q4_1",
                   help="our target's weight formats (fp16-packed, w8a8, q8_0, q4_0, q4_1, gguf), comma-separated")
    p.add_argument("--json", default="")
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from cpu_products import machine
    from prompt_sets import load_prompt_set

    from ssd.models.fetch import fetch_default_gguf, fetch_default_target
    from ssd.models.gguf_import import convert_gguf

    model = str(fetch_default_target())
    gguf = args.gguf or str(fetch_default_gguf())
    threads = [int(t) for t in args.threads.split(",")]
    sets = [{"name": name, "prompts": load_prompt_set(name, model, args.num_prompts).prompts}
            for name in ("humaneval", "chat")]
    with tempfile.TemporaryDirectory() as tmp:
        job, out = Path(tmp) / "job.json", Path(tmp) / "out.json"
        job.write_text(json.dumps({"gguf": gguf, "threads": threads, "k": args.k, "output_len": args.output_len,
                                   "n_ctx": 2048, "sets": sets}))
        subprocess.run([args.llamacpp_python, __file__, "--worker", "--prompts", str(job), "--out", str(out)],
                       check=True)
        peer = json.loads(out.read_text())
    results = {"machine": machine(), "command": "python " + " ".join(sys.argv), "gguf": gguf,
               "llama_cpp_python": peer["llama_cpp_python"], "ours": {}, "llamacpp": peer["runs"], "ratios": {}}
    draft = str(Path(__file__).resolve().parent.parent / "models" / "smollm2-draft")
    print(f"# {results['machine']['cpu']}; {Path(gguf).name}; llama-cpp-python {peer['llama_cpp_python']}; "
          f"{args.num_prompts} prompts per set, {args.output_len} tokens, batch 1, tok/s HumanEval / chat")
    for t in threads:
        for mode in ("plain", "prompt-lookup"):
            r = peer["runs"][f"{mode}-t{t}"]
            print(f"llama.cpp {mode:13s} t{t}       {r['humaneval']['tok_s']:6.1f} / {r['chat']['tok_s']:6.1f}")
    peer_best = {s["name"]: max(r[s["name"]]["tok_s"] for r in peer["runs"].values()) for s in sets}
    with tempfile.TemporaryDirectory() as tmp:
        imports: dict[bool, str] = {}  # keep_blocks -> the GGUF imported in float32

        def imported(keep_blocks: bool) -> str:
            if keep_blocks not in imports:
                out = Path(tmp) / ("kept" if keep_blocks else "float32")
                imports[keep_blocks] = str(convert_gguf(gguf, out, dtype="float32", keep_blocks=keep_blocks))
            return imports[keep_blocks]

        for fmt in args.formats.split(","):
            target = imported(fmt == "gguf") if fmt in ("q8_0", "q4_0", "q4_1", "gguf") else model
            runs = results["ours"][fmt] = {}
            for method, label in ((None, "ar"), ("draft_model", "sd"), ("ngram", "ngram"), ("ssd", "ssd")):
                spec = None if method is None else {"method": method, "num_speculative_tokens": args.k,
                                                    **({} if method == "ngram" else {"model": draft})}
                for t in [1] if method == "ssd" else threads:  # SSD: the target's core plus the draft's
                    runs[f"{label}-t{t}" + ("+1" if method == "ssd" else "")] = ours(target, sets, t, args.output_len,
                                                                                      spec, fmt)
            ratios = results["ratios"][fmt] = {}
            for t in threads:
                plain = peer["runs"][f"plain-t{t}"]
                ratios[f"ar_over_llamacpp_t{t}"] = {
                    s["name"]: round(runs[f"ar-t{t}"][s["name"]]["tok_s"] / plain[s["name"]]["tok_s"], 3) for s in sets}
            # our fastest mode on the two cores over llama.cpp's fastest on them, per prompt set
            ratios["best_over_llamacpp_best"] = {
                s["name"]: round(max(r[s["name"]]["tok_s"] for r in runs.values()) / peer_best[s["name"]], 3)
                for s in sets}
            for label, r in runs.items():
                print(f"ours {fmt:11s} {label:9s}  {r['humaneval']['tok_s']:6.1f} / {r['chat']['tok_s']:6.1f}")
            for key, value in ratios.items():
                print(f"ours {fmt:11s} {key:24s} {value['humaneval']:.2f} / {value['chat']:.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
