"""Speculative decoding with an EAGLE-3 head (``method="eagle3"``) is exact.

Greedy tokens equal plain autoregressive decoding of the target for mixed-length batches, several K, adaptive
lookahead, prompt lookup (on by default) or not, chunked prefill, preemption and prefix-cache hits. Two heads bound
the acceptance: a random head (almost every draft rejected: one catch-up row a round) and, on a target whose LM
head is zero (it always emits token 0), a head whose draft vocabulary starts at token 0 and whose LM head is zero
too, so it always proposes 0 and every draft is accepted (K + 1 catch-up rows a round, the target's features of
accepted drafts). Sampled outputs follow the target's distribution (chi-square on the first tokens, as for the
other methods).
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
import torch
import transformers
from eagle3_utils import LAYERS, VOCAB, make_eagle3_head, make_test_pairs
from safetensors.torch import load_file, save_file
from ssd_utils import ExactJoint, chi_square_gof

from ssd import LLM, SamplingParams
from ssd.sample.sampler import SamplingTensors, processed_probs

BLOCK, MAX_LEN = 16, 128


@pytest.fixture(scope="module")
def paths(checkpoint_factory, tmp_path_factory):
    return make_test_pairs(checkpoint_factory, tmp_path_factory.mktemp("eagle3_sd"))


def make_llm(model: str, head: str | None = None, k: int = 3, adaptive: bool = False, spec: dict | None = None,
             **kwargs) -> LLM:
    options = dict(dtype="float32", kv_cache_memory="16MiB", max_model_len=MAX_LEN, block_size=BLOCK, seed=0)
    options.update(kwargs)
    if head is not None:
        options["speculative_config"] = {"method": "eagle3", "model": head, "num_speculative_tokens": k,
                                         "adaptive_lookahead": adaptive, **(spec or {})}
    return LLM(model, **options)


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(99)
    return [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (1, 2, 7, 15, 16, 17, 31, 100)]


PROMPTS = _prompts()
PARAMS = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (40, 33, 17, 40, 2, 40, 29, 40)]


def _ar(model: str) -> list[tuple[list[int], str]]:
    outputs = make_llm(model).generate(PROMPTS, PARAMS)
    return [(o.token_ids, o.finish_reason) for o in outputs]


@pytest.fixture(scope="module")
def ar_greedy(paths):
    return {name: _ar(paths[name]) for name in ("target", "constant")}


def _assert_released(llm: LLM) -> None:
    proposer = llm.engine.proposer
    assert proposer.mirrors == {} and len(proposer.features) == 0 and proposer.lookups == {}
    assert proposer.kv_manager.num_free_blocks == proposer.kv_manager.num_total_blocks


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("pair", [("target", "random_head"), ("constant", "agreeing_head")])
def test_greedy_eagle3_equals_ar(paths, ar_greedy, pair, k):
    target, head = pair
    llm = make_llm(paths[target], paths[head], k=k, max_num_seqs=8)
    outputs = llm.generate(PROMPTS, PARAMS)
    assert [(o.token_ids, o.finish_reason) for o in outputs] == ar_greedy[target]
    stats = llm.stats
    assert stats.num_drafts > 0 and all(o.speculation == "eagle3" for o in outputs)
    if head == "agreeing_head":  # every draft accepted: rounds of K + 1 tokens
        assert stats.num_accepted_tokens == stats.num_draft_tokens > 0
        assert llm.engine.proposer.rows_without_features == 0
    else:  # the random target repeats itself: prompt lookup copies drafts, and some are right
        assert 0 < stats.num_accepted_copied_tokens <= stats.num_copied_tokens < stats.num_draft_tokens
        assert stats.num_accepted_tokens - stats.num_accepted_copied_tokens < 0.2 * stats.num_draft_tokens
    _assert_released(llm)


@pytest.mark.parametrize("options", [
    dict(adaptive=True),
    dict(max_num_batched_tokens=24, enable_chunked_prefill=True),  # prompts in chunks, mixed with rounds
    dict(kv_cache_memory="640KiB"),  # too few blocks for every sequence: preemption and recompute
    dict(spec={"prompt_step_speculation": True}),  # a prompt's step asks for drafts the head cannot make yet
    dict(spec={"prompt_lookup": False}),  # the head's drafts alone
    dict(spec={"draft_weight_format": "dense"}),  # the default, auto, packs the head as a draft model's weights
    dict(spec={"draft_weight_format": "fp16-packed"}),
])
def test_greedy_eagle3_with_engine_features(paths, ar_greedy, options):
    for target, head in (("target", "random_head"), ("constant", "agreeing_head")):
        llm = make_llm(paths[target], paths[head], k=4, max_num_seqs=8, **options)
        outputs = llm.generate(PROMPTS, PARAMS)
        assert [(o.token_ids, o.finish_reason) for o in outputs] == ar_greedy[target]
        _assert_released(llm)


def test_prefix_cache_hits_leave_the_head_without_features_not_inexact(paths, ar_greedy):
    llm = make_llm(paths["constant"], paths["agreeing_head"], k=3)
    first = llm.generate([PROMPTS[6]], [PARAMS[6]])
    again = llm.generate([PROMPTS[6]], [PARAMS[6]])  # its first block comes from the target's prefix cache
    assert first[0].token_ids == again[0].token_ids == ar_greedy["constant"][6][0]
    assert llm.engine.proposer.rows_without_features > 0


def test_eagle3_config_errors(paths, tmp_path):
    from ssd.config import SpeculativeConfig

    with pytest.raises(ValueError, match="needs 'model'"):
        SpeculativeConfig(method="eagle3")
    with pytest.raises(ValueError, match="an EAGLE-3 head has no GGUF blocks"):
        SpeculativeConfig(method="eagle3", model=paths["random_head"], draft_weight_format="gguf")
    wide = make_eagle3_head(tmp_path / "wide", vocab_size=VOCAB, target_hidden_size=96, feature_layers=LAYERS)
    with pytest.raises(ValueError, match="reads hidden states of size 96, the target's are 64"):
        make_llm(paths["target"], str(wide))


# --------------------------------------------------------------------------------------------- sampling
def _joint(hf, prompt: list[int], params: SamplingParams, depth: int) -> dict[tuple[int, ...], float]:
    """The target's processed joint distribution of the first ``depth`` tokens, enumerated exactly."""
    joint = {(): 1.0}
    for _ in range(depth):
        prefixes = list(joint)
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + list(p) for p in prefixes])).logits[:, -1].float()  # [P, V]
        probs = processed_probs(logits, SamplingTensors.from_params([params] * len(prefixes), "cpu"))  # [P, V]
        joint = {prefix + (t,): joint[prefix] * float(probs[i, t])
                 for i, prefix in enumerate(prefixes) for t in torch.nonzero(probs[i]).squeeze(1).tolist()}
    return joint


def _iid_pair(base: Path, root: Path) -> tuple[str, str]:
    """A target whose next-token distribution is the same after any context (every embedding row equal, every
    layer's output projections zero, a peaky LM head), and a head whose q is that distribution up to noise in
    its LM head (it reads the target's embedding as its feature through ``fc`` and adds nothing): acceptance is
    high but not total, so a wrong q or a wrong residual shows in the joint distribution."""
    target = root / "iid_target"
    shutil.copytree(base, target)
    t = load_file(target / "model.safetensors")
    embed = t["model.embed_tokens.weight"]
    t["model.embed_tokens.weight"] = embed[:1].expand_as(embed).clone()
    for name in t:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            t[name] = torch.zeros_like(t[name])
    t["lm_head.weight"] = t["lm_head.weight"] * 6.0
    save_file(t, target / "model.safetensors", metadata={"format": "pt"})
    head = make_eagle3_head(root / "iid_head", vocab_size=259, target_hidden_size=64, hidden_size=64,
                            feature_layers=LAYERS, draft_vocab_size=259, seed=8)
    h = load_file(head / "model.safetensors")
    h["fc.weight"] = torch.cat([torch.eye(64), torch.zeros(64, 128)], dim=1)  # g = the target's embedding
    h["midlayer.self_attn.o_proj.weight"] = torch.zeros_like(h["midlayer.self_attn.o_proj.weight"])
    h["midlayer.mlp.down_proj.weight"] = torch.zeros_like(h["midlayer.mlp.down_proj.weight"])
    h["norm.weight"] = t["model.norm.weight"]
    noise = torch.randn(t["lm_head.weight"].shape, generator=torch.Generator().manual_seed(3))
    h["lm_head.weight"] = t["lm_head.weight"] + 0.3 * t["lm_head.weight"].std() * noise
    h["d2t"], h["t2d"] = torch.zeros(259, dtype=torch.long), torch.ones(259, dtype=torch.bool)
    save_file(h, head / "model.safetensors")
    return str(target), str(head)


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 3, 1.0), (2.0, 5, 0.95)])
def test_sampled_eagle3_follows_the_target(checkpoint_factory, tmp_path, temperature, top_k, top_p):
    """The first three tokens of sampled requests (the second and third come from a verification round) follow
    the target's processed joint distribution, enumerated from transformers logits; chi-square (cells expected
    fewer than 5 times merged into one), false-failure rate 1e-4."""
    target, head = _iid_pair(checkpoint_factory(arch="llama", vocab_size=259), tmp_path)
    prompt, n = [5, 17, 33], 8000
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=3, ignore_eos=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    expected = _joint(hf, prompt, params, 3)

    llm = make_llm(target, head, k=2, max_num_seqs=16)
    outputs = llm.generate([prompt] * n, [dataclasses.replace(params, seed=1000 + i) for i in range(n)])
    stats = llm.stats
    assert 0.3 < stats.acceptance_rate < 0.97, stats.acceptance_rate  # real acceptances and real rejections
    assert len(expected) >= 27
    samples = [tuple(o.token_ids) for o in outputs]
    assert set(samples) <= set(expected)
    result = chi_square_gof(samples, ExactJoint(expected))
    assert result.p_value > 1e-4, f"chi-square p = {result.p_value}"
