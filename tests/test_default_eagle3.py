"""The committed EAGLE-3 head (models/smollm2-eagle3, trained by train/eagle3_head.py) works with the default
target: it loads in the published layout, SD with it gives exactly the target's greedy tokens, and it really
drafts (an untrained head's drafts are almost never accepted)."""

from __future__ import annotations

import json
from pathlib import Path

from model_utils import DEFAULT_MODEL_PROMPTS

HEAD = Path(__file__).resolve().parent.parent / "models" / "smollm2-eagle3"
MAX_TOKENS = 24


def test_head_folder_is_complete() -> None:
    for name in ("config.json", "model.safetensors", "README.md"):
        assert (HEAD / name).is_file(), name
    config = json.loads((HEAD / "config.json").read_text(encoding="utf-8"))
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["hidden_size"] == 576 and config["vocab_size"] == 49152


def test_sd_with_the_head_is_exact_and_accepts(default_target: str) -> None:
    from ssd import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    ar = LLM(model=default_target, dtype="float32", weight_format="dense", kv_cache_memory="256MiB")
    prompts = [ar.tokenizer.encode(DEFAULT_MODEL_PROMPTS[0]),
               ar.tokenizer.apply_chat_template([{"role": "user", "content": DEFAULT_MODEL_PROMPTS[1]}])]
    expected = [ar.generate(p, params)[0].token_ids for p in prompts]
    ar.shutdown()
    sd = LLM(model=default_target, dtype="float32", weight_format="dense", kv_cache_memory="256MiB",
             speculative_config={"method": "eagle3", "model": str(HEAD), "num_speculative_tokens": 4,
                                 "prompt_lookup": False, "adaptive_lookahead": False})
    got = [sd.generate(p, params)[0].token_ids for p in prompts]
    stats = sd.stats
    sd.shutdown()
    assert got == expected
    assert stats.mean_acceptance_length > 1.5, stats.mean_acceptance_length
