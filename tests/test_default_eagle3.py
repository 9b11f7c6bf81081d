"""The committed EAGLE-3 head (models/smollm2-eagle3, trained by train/eagle3_head.py) works with the default
target: it loads in the published layout, SD and SSD with it give exactly the target's greedy tokens, and it really
drafts (an untrained head's drafts are almost never accepted)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from model_utils import DEFAULT_MODEL_PROMPTS

from ssd import SamplingParams

HEAD = Path(__file__).resolve().parent.parent / "models" / "smollm2-eagle3"
PARAMS = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def test_head_folder_is_complete() -> None:
    for name in ("config.json", "model.safetensors", "README.md"):
        assert (HEAD / name).is_file(), name
    config = json.loads((HEAD / "config.json").read_text(encoding="utf-8"))
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["hidden_size"] == 576 and config["vocab_size"] == 49152


@pytest.fixture(scope="module")
def greedy_ar(default_target: str) -> tuple[list[list[int]], list[list[int]]]:
    """The prompts (a code completion, a chat turn) and the target's greedy tokens after them."""
    from ssd import LLM

    ar = LLM(model=default_target, dtype="float32", weight_format="dense", kv_cache_memory="256MiB")
    prompts = [ar.tokenizer.encode(DEFAULT_MODEL_PROMPTS[0]),
               ar.tokenizer.apply_chat_template([{"role": "user", "content": DEFAULT_MODEL_PROMPTS[1]}])]
    expected = [ar.generate(p, PARAMS)[0].token_ids for p in prompts]
    ar.shutdown()
    return prompts, expected


@pytest.mark.parametrize("method, min_acceptance", [("eagle3", 1.5), ("ssd", 1.3)])
def test_speculation_with_the_head_is_exact_and_accepts(default_target: str, greedy_ar, method: str,
                                                        min_acceptance: float) -> None:
    """SD with the head, and SSD with the head as its draft (its drafts after accepted tokens read the head's own
    features, not yet the target's: a lower acceptance than SD's is expected)."""
    from ssd import LLM

    prompts, expected = greedy_ar
    llm = LLM(model=default_target, dtype="float32", weight_format="dense", kv_cache_memory="256MiB",
              speculative_config={"method": method, "model": str(HEAD), "num_speculative_tokens": 4,
                                  "prompt_lookup": False, "adaptive_lookahead": False})
    try:
        got = [llm.generate(p, PARAMS)[0].token_ids for p in prompts]
        stats = llm.stats
    finally:
        llm.shutdown()
    assert got == expected
    assert stats.mean_acceptance_length > min_acceptance, stats.mean_acceptance_length
