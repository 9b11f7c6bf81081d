"""The committed default draft (models/smollm2-draft) works with the default target in our engine.

Greedy speculative decoding must give exactly the target's own greedy tokens, and the draft must really
help: a draft that agreed with the target no better than chance would have acceptance near zero.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from model_utils import DEFAULT_MODEL_PROMPTS

from ssd.models.draft_vocab import DraftVocab

DRAFT = Path(__file__).resolve().parent.parent / "models" / "smollm2-draft"
MAX_TOKENS = 24


def test_draft_folder_is_complete() -> None:
    for name in ("config.json", "model.safetensors", "draft_vocab.json", "tokenizer.json", "README.md"):
        assert (DRAFT / name).is_file(), name
    vocab = DraftVocab.load(DRAFT)
    assert vocab is not None and vocab.target_vocab_size == 49152
    config = json.loads((DRAFT / "config.json").read_text(encoding="utf-8"))
    assert config["vocab_size"] == vocab.size
    assert config["hidden_size"] == 576
    assert 2 in vocab.draft_to_target  # <|im_end|>: the draft can end a chat turn


def test_sd_with_default_draft_is_exact_and_accepts(default_target: str) -> None:
    from ssd import LLM, SamplingParams

    # float32 and batch 1 on both sides: exactness is then not at the mercy of bf16 near-ties between a
    # one-token decode step and a K+1-token verification pass.
    torch.manual_seed(0)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    ar = LLM(model=default_target, dtype="float32", kv_cache_memory="256MiB")
    prompts = [ar.tokenizer.encode(DEFAULT_MODEL_PROMPTS[0]),
               ar.tokenizer.apply_chat_template([{"role": "user", "content": DEFAULT_MODEL_PROMPTS[1]}])]
    expected = [ar.generate(p, params)[0].token_ids for p in prompts]
    ar.shutdown()
    sd = LLM(
        model=default_target,
        dtype="float32",
        kv_cache_memory="256MiB",
        speculative_config={"method": "draft_model", "model": str(DRAFT), "num_speculative_tokens": 4},
    )
    got = [sd.generate(p, params)[0].token_ids for p in prompts]  # batch 1, as in the acceptance figures
    stats = sd.stats
    sd.shutdown()
    assert got == expected
    assert all(len(g) == MAX_TOKENS for g in got)
    # 1.0 would mean no draft token is ever accepted (an untrained 4-layer cut of the target scores ~0 agreement).
    assert stats.num_accepted_tokens > 0
    assert stats.mean_acceptance_length > 1.05, stats.mean_acceptance_length
