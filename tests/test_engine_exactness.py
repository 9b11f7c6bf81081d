"""Greedy autoregressive decoding through the whole engine equals ``transformers``, token for token.

The reference is ``transformers``' own ``generate(do_sample=False)`` run one prompt at a time, so any
scheduling effect (batch composition, chunked prefill, preemption and recompute, prefix-cache reuse) that
leaked into the numbers would show up as a differing token. Models are tiny random fp32 checkpoints whose
logits are spread out (no near-ties), so exact equality is the right assertion.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import pytest
import torch
import transformers

from ssd import LLM, SamplingParams

ARCHS = ("llama", "qwen2", "qwen3")
MAX_NEW = 64
BLOCK = 16
MAX_LEN = 160  # longest prompt (70) + MAX_NEW fits; 10 blocks per max-length sequence
SHARED = 40  # tokens of the shared prefix: 2 full blocks, then 8 more
TEXT_PROMPT = "Once upon a time there was a small village"
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)


def _token_prompts() -> list[list[int]]:
    """Mixed lengths around block boundaries; prompts 5 and 6 share a 40-token prefix."""
    gen = torch.Generator().manual_seed(1234)

    def rand(n: int) -> list[int]:
        return torch.randint(3, 512, (n,), generator=gen).tolist()

    shared = rand(SHARED)
    return [rand(1), rand(16), rand(17), rand(33), shared + rand(3), shared + rand(9), rand(70)]


@dataclass
class Reference:
    path: str
    prompts: list  # str or list[int], in the order given to the engine
    prompt_ids: list[list[int]]
    expected: list[list[int]]  # transformers' greedy continuation of each prompt


@pytest.fixture(scope="module")
def reference(checkpoint_factory):
    @functools.cache
    def get(arch: str) -> Reference:
        path = checkpoint_factory(arch=arch)
        tokenizer = transformers.AutoTokenizer.from_pretrained(path)
        prompts = [TEXT_PROMPT] + _token_prompts()
        prompt_ids = [tokenizer.encode(p) if isinstance(p, str) else p for p in prompts]
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        expected = []
        with torch.no_grad():
            for ids in prompt_ids:
                # Keyword arguments override the checkpoint's generation config (a GenerationConfig object
                # would get its eos_token_id=None filled back in from it).
                out = hf.generate(
                    torch.tensor([ids]), do_sample=False, max_new_tokens=MAX_NEW, eos_token_id=None, pad_token_id=0
                )[0, len(ids) :].tolist()
                assert len(out) == MAX_NEW  # transformers did not stop at EOS
                expected.append(out)
        return Reference(str(path), prompts, prompt_ids, expected)

    return get


def _llm(path: str, **kwargs) -> LLM:
    options = dict(dtype="float32", kv_cache_memory="16MiB", max_model_len=MAX_LEN, block_size=BLOCK, seed=0)
    options.update(kwargs)
    return LLM(path, **options)


def _bytes_per_block(llm: LLM) -> int:
    return llm.engine.runner.bytes_per_block()


def _assert_outputs(outputs, ref: Reference, indices=None) -> None:
    indices = range(len(ref.prompts)) if indices is None else indices
    assert len(outputs) == len(indices)
    for out, i in zip(outputs, indices):
        assert out.prompt_token_ids == ref.prompt_ids[i]
        assert out.token_ids == ref.expected[i], f"prompt {i} (length {len(ref.prompt_ids[i])}) differs"
        assert out.finish_reason == "length"


@pytest.mark.parametrize("arch", ARCHS)
def test_batch_of_mixed_lengths_matches_transformers(reference, arch):
    ref = reference(arch)
    llm = _llm(ref.path, max_num_seqs=8)
    outputs = llm.generate(ref.prompts, GREEDY)
    _assert_outputs(outputs, ref)
    assert outputs[0].prompt == TEXT_PROMPT and outputs[0].text == llm.tokenizer.decode(ref.expected[0])
    assert all(o.metrics.num_preemptions == 0 for o in outputs)


@pytest.mark.parametrize("arch", ARCHS)
def test_each_prompt_alone_matches_transformers(reference, arch):
    ref = reference(arch)
    llm = _llm(ref.path, enable_prefix_caching=False)
    for i in (0, 1, 4, 7):  # text, 1 token, 33 tokens, 70 tokens
        prompt = ref.prompts[i]
        _assert_outputs(llm.generate([prompt], GREEDY), ref, [i])


@pytest.mark.parametrize("arch", ARCHS)
def test_chunked_prefill_matches_transformers(reference, arch):
    """A 12-token budget splits every prompt longer than 12 tokens over several steps (and mixes chunks of
    one prompt with decodes of others)."""
    ref = reference(arch)
    llm = _llm(ref.path, max_num_batched_tokens=12, max_num_seqs=8)
    assert max(len(p) for p in ref.prompt_ids) > 5 * 12
    _assert_outputs(llm.generate(ref.prompts, GREEDY), ref)


@pytest.mark.parametrize("arch", ARCHS)
def test_preemption_matches_transformers(reference, arch):
    """A 12-block pool cannot hold the batch (about 50 blocks at the end), so sequences are preempted and
    recomputed; recompute must reproduce the same tokens."""
    ref = reference(arch)
    probe = _llm(ref.path)
    llm = _llm(ref.path, kv_cache_memory=12 * _bytes_per_block(probe), max_num_seqs=8)
    assert llm.engine.kv_manager.num_total_blocks == 12
    outputs = llm.generate(ref.prompts, GREEDY)
    _assert_outputs(outputs, ref)
    assert sum(o.metrics.num_preemptions for o in outputs) > 0
    assert llm.engine.kv_manager.num_free_blocks == 12  # everything released at the end


@pytest.mark.parametrize("arch", ARCHS)
def test_prefix_cache_hits_match_transformers(reference, arch):
    """First serve one prompt of the shared-prefix pair, then the whole batch: its partner reuses the two
    full shared blocks, and the first prompt reuses its own blocks (prompt and generated text)."""
    ref = reference(arch)
    llm = _llm(ref.path, max_num_seqs=8)
    first, partner = 5, 6
    (out,) = llm.generate([ref.prompts[first]], GREEDY)
    _assert_outputs([out], ref, [first])
    assert out.metrics.num_cached_prompt_tokens == 0

    outputs = llm.generate(ref.prompts, GREEDY)
    _assert_outputs(outputs, ref)
    assert outputs[partner].metrics.num_cached_prompt_tokens == (SHARED // BLOCK) * BLOCK
    own = len(ref.prompt_ids[first])
    assert outputs[first].metrics.num_cached_prompt_tokens == ((own - 1) // BLOCK) * BLOCK
    assert outputs[0].metrics.num_cached_prompt_tokens == 0  # nothing shared with the text prompt


def test_everything_at_once_matches_transformers(reference):
    """Chunked prefill, preemption and prefix-cache hits in the same run (twice: the second run hits the
    prefix cache for every prompt longer than a block)."""
    ref = reference("llama")
    probe = _llm(ref.path)
    llm = _llm(ref.path, kv_cache_memory=14 * _bytes_per_block(probe), max_num_batched_tokens=24, max_num_seqs=8)
    for run in range(2):
        outputs = llm.generate(ref.prompts, GREEDY)
        _assert_outputs(outputs, ref)
        assert sum(o.metrics.num_preemptions for o in outputs) > 0
    assert sum(o.metrics.num_cached_prompt_tokens for o in outputs) > 0
