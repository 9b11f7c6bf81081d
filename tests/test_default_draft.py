"""The committed default draft (models/smollm2-draft) works with the default target in our engine.

Greedy speculative decoding must give exactly the target's own greedy tokens, and the draft must really
help: a draft that agreed with the target no better than chance would have acceptance near zero.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ssd.models.draft_vocab import DraftVocab

DRAFT = Path(__file__).resolve().parent.parent / "models" / "smollm2-draft"
PROMPTS = [
    'def is_odd(n: int) -> bool:\n    """Return True if n is odd.\n    >>> is_odd(3)\n    True\n    """\n',
    "What is the largest planet in the solar system?",
]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def target() -> str:
    from ssd.models.fetch import FetchError, fetch_default_target

    try:
        return str(fetch_default_target())
    except FetchError as exc:
        pytest.skip(f"the default target SmolLM2-135M-Instruct cannot be fetched here: {exc}")


def test_draft_folder_is_complete() -> None:
    for name in ("config.json", "model.safetensors", "draft_vocab.json", "tokenizer.json", "README.md"):
        assert (DRAFT / name).is_file(), name
    vocab = DraftVocab.load(DRAFT)
    assert vocab is not None and vocab.target_vocab_size == 49152
    config = json.loads((DRAFT / "config.json").read_text(encoding="utf-8"))
    assert config["vocab_size"] == vocab.size
    assert config["hidden_size"] == 576
    assert 2 in vocab.draft_to_target  # <|im_end|>: the draft can end a chat turn


def test_sd_with_default_draft_is_exact_and_accepts(target: str) -> None:
    from ssd import LLM, SamplingParams

    # float32 and batch 1 on both sides: exactness is then not at the mercy of bf16 near-ties between a
    # one-token decode step and a K+1-token verification pass.
    torch.manual_seed(0)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    ar = LLM(model=target, dtype="float32", kv_cache_memory="256MiB")
    prompts = [ar.tokenizer.encode(PROMPTS[0]), ar.tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[1]}])]
    expected = [ar.generate(p, params)[0].token_ids for p in prompts]
    ar.shutdown()
    sd = LLM(
        model=target,
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
