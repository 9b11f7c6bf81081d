"""The fused CPU kernels (ssd/models/cpu_fused.py): residual add + RMSNorm against a float64 reference, RoPE +
K/V write against the unfused path bit for bit, row invariance (alone, beside companions, at any thread count),
clear errors, and models and engines running through them exactly as without."""

from __future__ import annotations

import pytest
import torch

from ssd import LLM, SamplingParams
from ssd.models import cpu_fused
from ssd.models.loader import load_model
from ssd.models.rope import apply_rope
from model_utils import greedy_generate

pytestmark = pytest.mark.skipif(not cpu_fused.available(), reason="the fused CPU kernels could not be compiled")


def _norm_reference(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    h = x.double() + (0 if residual is None else residual.double())
    return weight.double() * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("width", [64, 576, 100])  # 100: a tail after the 16-lane sums
def test_add_rms_norm_matches_a_float64_reference(with_residual, width):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(7, width, generator=gen) * 3
    residual = torch.randn(7, width, generator=gen) if with_residual else None
    weight = torch.rand(width, generator=gen) + 0.5
    out, h = cpu_fused.add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(h, x + residual if with_residual else x)
    torch.testing.assert_close(out.double(), _norm_reference(x, residual, weight, 1e-6), rtol=2e-6, atol=2e-6)


def _qkv_and_caches(tokens: int, heads: int, kv_heads: int, head_dim: int, slots: int = 24, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen)
    angles = torch.rand(tokens, 1, head_dim // 2, generator=gen) * 6
    cache = [torch.randn(slots // 4, 4, kv_heads, head_dim, generator=gen) for _ in range(2)]
    return qkv, angles.cos(), angles.sin(), cache


@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 2, 16), (9, 3, 64), (2, 1, 6)])
def test_rope_write_kv_gives_the_unfused_paths_bits(heads, kv_heads, head_dim):
    tokens = 5
    qkv, cos, sin, (key, value) = _qkv_and_caches(tokens, heads, kv_heads, head_dim)
    slots = torch.tensor([3, 17, 0, 9, 22])
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    expected_q = apply_rope(q.reshape(tokens, heads, head_dim), cos, sin)
    expected_k = apply_rope(k.reshape(tokens, kv_heads, head_dim), cos, sin)
    expected_v = v.reshape(tokens, kv_heads, head_dim).clone()
    key_before, value_before = key.clone(), value.clone()
    rotated = cpu_fused.rope_write_kv(qkv, cos, sin, key, value, slots, heads, kv_heads, head_dim)
    assert torch.equal(rotated, expected_q)
    flat_key, flat_value = key.view(-1, kv_heads, head_dim), value.view(-1, kv_heads, head_dim)
    assert torch.equal(flat_key[slots], expected_k) and torch.equal(flat_value[slots], expected_v)
    others = torch.ones(flat_key.shape[0], dtype=torch.bool)
    others[slots] = False
    assert torch.equal(flat_key[others], key_before.view_as(flat_key)[others])
    assert torch.equal(flat_value[others], value_before.view_as(flat_value)[others])


def test_a_row_gets_the_same_bits_alone_beside_companions_and_at_any_thread_count():
    gen = torch.Generator().manual_seed(3)
    width, weight = 576, torch.rand(576, generator=gen) + 0.5
    row, res = torch.randn(1, width, generator=gen), torch.randn(1, width, generator=gen)
    alone = cpu_fused.add_rms_norm(row, res, weight, 1e-5)[0]
    threads = torch.get_num_threads()
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            for companions in (1, 15, 40):
                others = torch.randn(companions, width, generator=gen) * 5
                for position in (0, companions):
                    x = torch.cat([others[:position], row, others[position:]])
                    r = torch.cat([others[:position], res, others[position:]])
                    out = cpu_fused.add_rms_norm(x, r, weight, 1e-5)[0]
                    assert torch.equal(out[position], alone[0]), (count, companions, position)
    finally:
        torch.set_num_threads(threads)


def test_clear_errors():
    weight = torch.ones(8)
    with pytest.raises(RuntimeError, match="float32"):
        cpu_fused.add_rms_norm(torch.ones(2, 8, dtype=torch.bfloat16), None, weight, 1e-6)
    with pytest.raises(RuntimeError, match="weight"):
        cpu_fused.add_rms_norm(torch.ones(2, 8), None, torch.ones(4), 1e-6)
    qkv, cos, sin, (key, value) = _qkv_and_caches(2, 4, 2, 16)
    with pytest.raises(RuntimeError, match="out of range"):
        cpu_fused.rope_write_kv(qkv, cos, sin, key, value, torch.tensor([0, 24]), 4, 2, 16)
    with pytest.raises(RuntimeError, match="heads"):
        cpu_fused.rope_write_kv(qkv, cos, sin, key, value, torch.tensor([0, 1]), 4, 1, 16)
    assert not cpu_fused.usable("cpu", torch.bfloat16) and not cpu_fused.usable("cuda", torch.float32)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # qwen3: the per-head q/k norms run fused too
def test_a_model_decodes_the_same_tokens_fused_and_unfused(checkpoint_factory, arch):
    path = checkpoint_factory(arch=arch, num_layers=3)
    model, _ = load_model(path, dtype=torch.float32, device=torch.device("cpu"))
    prompt = [5, 77, 301, 12, 9, 140, 33]
    plain = greedy_generate(model, prompt, 12)
    model.enable_fused_kernels(kernels=cpu_fused)
    assert greedy_generate(model, prompt, 12) == plain


def test_the_engine_runs_float32_cpu_models_fused_and_decodes_as_unfused(checkpoint_factory):
    path = str(checkpoint_factory(arch="llama", num_layers=2))
    prompts = [[1, 2, 3, 4], [9, 8, 7, 6, 5, 4, 3]]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    outputs = {}
    for fused in (True, False):
        with LLM(path, fused_kernels=fused, speculative_config={"method": "ngram", "num_speculative_tokens": 3}) as llm:
            assert llm.engine.runner.model.kernels is (cpu_fused if fused else None)
            outputs[fused] = [o.token_ids for o in llm.generate(prompts, params)]
    assert outputs[True] == outputs[False]
