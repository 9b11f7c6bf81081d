"""The fused Triton kernels (ssd/models/fused_kernels.py) against the PyTorch ops they replace.

On CUDA they run compiled; without a GPU they run in Triton's interpreter on CPU tensors (the same kernel
code, numpy arithmetic), so CI checks them wherever Triton is installed. Skipped without Triton.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from ssd.models.attention import (  # noqa: E402
    DenseAttentionMetadata,
    KVCache,
    dense_attention,
    write_kv,
)
from ssd.models.attention_layout import SequenceLayout, build_attention_metadata  # noqa: E402
from ssd.runtime.static_batch import BucketPolicy, StaticInputs, pack_step  # noqa: E402
from ssd.models.layers import RMSNorm  # noqa: E402
from ssd.models.loader import load_model  # noqa: E402
from ssd.models.rope import RotaryEmbedding, apply_rope  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The interpreter emulates bfloat16 casts by truncation (CUDA rounds to nearest even); float16 is native to
# numpy, so on CPU the half-precision cases use it to check that every rounding is where PyTorch's is.
HALF = torch.bfloat16 if DEVICE == "cuda" else torch.float16
MODEL_TOL = 1e-4 if DEVICE == "cuda" else 1e-5  # float32 models: CUDA's attention kernels sum in other orders


@pytest.fixture(scope="module")
def kernels():
    """The kernel module: compiled on CUDA, else interpreted (tests/conftest.py sets TRITON_INTERPRET)."""
    if DEVICE == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no GPU and TRITON_INTERPRET is not 1")
    import ssd.models.fused_kernels as module

    return module


def _exact_or_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    else:  # a float32 reduction in another order may move a half-precision result by one unit in the last place
        torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=1e-2)
        assert (got == want).float().mean() > 0.97


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_matches_residual_add_then_rmsnorm(kernels, dtype, with_residual) -> None:
    gen = torch.Generator().manual_seed(0)
    hidden = 96  # not a power of two: the kernel masks the tail of its block
    x = torch.randn(5, hidden, generator=gen).to(DEVICE, dtype)
    residual = torch.randn(5, hidden, generator=gen).to(DEVICE, dtype) if with_residual else None
    norm = RMSNorm(hidden, 1e-6, dtype).to(DEVICE)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(hidden, generator=gen) + 0.5)
        want_h = x + residual if with_residual else x
        want = norm(want_h)
    got, got_h = kernels.add_rms_norm(x, residual, norm.weight, norm.eps)
    assert torch.equal(got_h, want_h)  # the residual add rounds exactly as PyTorch's
    _exact_or_close(got, want, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
def test_rope_write_kv_matches_apply_rope_and_cache_write(kernels, dtype) -> None:
    heads, kv_heads, d, tokens = 4, 2, 16, 6
    gen = torch.Generator().manual_seed(1)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=gen).to(DEVICE, dtype)
    positions = torch.tensor([0, 1, 2, 7, 8, 30], device=DEVICE)
    cos, sin = RotaryEmbedding(d, 10000.0, None).to(DEVICE).cos_sin(positions, dtype)
    slots = torch.tensor([3, 9, 4, 17, 0, 12], device=DEVICE)
    shape = (5, 4, kv_heads, d)  # 5 blocks of 4 slots
    want_cache = KVCache(torch.zeros(shape, dtype=dtype, device=DEVICE), torch.zeros(shape, dtype=dtype, device=DEVICE))
    got_cache = KVCache(torch.zeros_like(want_cache.key), torch.zeros_like(want_cache.value))

    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    want_q = apply_rope(q.reshape(tokens, heads, d), cos, sin)
    write_kv(want_cache, apply_rope(k.reshape(tokens, kv_heads, d), cos, sin), v.reshape(tokens, kv_heads, d), slots)
    got_q = kernels.rope_write_kv(qkv.clone(), cos, sin, got_cache.key, got_cache.value, slots, heads, kv_heads, d)

    if dtype == torch.float32 and DEVICE == "cuda":  # the compiler may fuse a float32 product and sum (FMA)
        torch.testing.assert_close(got_q, want_q, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got_cache.key, want_cache.key, rtol=1e-6, atol=1e-6)
    else:  # half precision rounds after every product (no FMA across a rounding), as PyTorch's ops do
        assert torch.equal(got_q, want_q) and torch.equal(got_cache.key, want_cache.key)
    assert torch.equal(got_cache.value, want_cache.value)


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
def test_silu_mul_matches_silu_times_up(kernels, dtype) -> None:
    gate_up = (3 * torch.randn(3, 2 * 1100, generator=torch.Generator().manual_seed(2))).to(DEVICE, dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    _exact_or_close(kernels.silu_mul(gate_up), F.silu(gate) * up, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, HALF])
@pytest.mark.parametrize("q_len", [1, 3])
def test_dense_attention_matches_gather_then_sdpa(kernels, dtype, q_len) -> None:
    """Straight from the paged cache, keys split across programs (80 columns in splits of 32: a short last
    split), GQA groups of 2, a random mask in which some rows see only column 0 (like padding rows)."""
    batch, heads, kv_heads, d, kv_len = 2, 4, 2, 16, 80
    gen = torch.Generator().manual_seed(3)
    cache = KVCache(torch.randn(24, 8, kv_heads, d, generator=gen).to(DEVICE, dtype),
                    torch.randn(24, 8, kv_heads, d, generator=gen).to(DEVICE, dtype))
    slots = torch.stack([torch.randperm(192, generator=gen)[:kv_len] for _ in range(batch)]).to(DEVICE)
    mask = torch.rand(batch, 1, q_len, kv_len, generator=gen) < 0.5
    mask[..., 0] = True
    mask[0, 0, -1, 1:] = False  # a row that sees column 0 alone: every later split is empty for it
    mask = mask.to(DEVICE)
    query = torch.randn(batch * q_len, heads, d, generator=gen).to(DEVICE, dtype)
    meta = DenseAttentionMetadata(torch.zeros(batch * q_len, dtype=torch.long, device=DEVICE), slots, mask)
    want = dense_attention(query, cache, meta, d**-0.5)
    got = kernels.dense_attention(query, cache.key, cache.value, slots, mask, d**-0.5, cols_per_split=32)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_fused_model_forward_matches_the_plain_forward(kernels, checkpoint_factory, arch) -> None:
    """Prefill, decode and a 3-token step through the reference layout, then a decode step through the
    fixed-shape layout (the fused attention kernel), float32."""
    path = checkpoint_factory(arch, num_heads=4, num_kv_heads=2)
    model, _ = load_model(path, dtype=torch.float32, device=DEVICE)
    model.eval()
    block = 4
    caches = {name: model.allocate_kv_caches(16, block) for name in ("plain", "fused")}
    prompts = [[5, 9, 17, 33, 2], [7, 3, 11, 40, 41, 42, 43]]
    bases = [0, 16]  # sequence i's position p lives in slot bases[i] + p (blocks 0-3 and 4-7)
    steps = [
        (prompts, [0, 0]),
        ([[21], [22]], [5, 7]),
        ([[23, 24, 25], [26, 27, 28]], [6, 8]),
    ]
    policy = BucketPolicy((1, 2), (1, 4, 8), (16,))
    inputs = StaticInputs(policy, torch.device(DEVICE))
    for tokens, starts in steps:
        layouts = [SequenceLayout(base + np.arange(s, s + len(tok)), base + np.arange(s + len(tok)))
                   for tok, s, base in zip(tokens, starts, bases)]
        ids = [x for tok in tokens for x in tok]
        positions = np.concatenate([np.arange(s, s + len(tok)) for tok, s in zip(tokens, starts)])
        outs = {}
        for name, enabled in (("plain", False), ("fused", True)):
            model.enable_fused_kernels(enabled)
            with torch.inference_mode():
                meta = build_attention_metadata(layouts, torch.device(DEVICE))
                outs[name] = model(torch.tensor(ids, device=DEVICE), torch.tensor(positions, device=DEVICE), meta,
                                   caches[name])
        torch.testing.assert_close(outs["fused"], outs["plain"], rtol=MODEL_TOL, atol=MODEL_TOL)
        for plain, fused in zip(caches["plain"], caches["fused"]):
            torch.testing.assert_close(fused.key, plain.key, rtol=MODEL_TOL, atol=MODEL_TOL)
            torch.testing.assert_close(fused.value, plain.value, rtol=MODEL_TOL, atol=MODEL_TOL)
    # and once through the fixed-shape (CUDA-graph) layout: a decode step of both sequences
    layouts = [SequenceLayout(np.array([base + n]), base + np.arange(n + 1)) for base, n in zip(bases, (9, 11))]
    shape = policy.select(2, 1, 12)
    views = inputs.load(pack_step(shape, [30, 31], np.array([9, 11]), layouts, [0, 1], 63))
    outs = {}
    for name, enabled in (("plain", False), ("fused", True)):
        model.enable_fused_kernels(enabled)
        with torch.inference_mode():
            outs[name] = model(views.input_ids, views.positions, views.meta, caches[name])
    model.enable_fused_kernels(False)
    torch.testing.assert_close(outs["fused"], outs["plain"], rtol=MODEL_TOL, atol=MODEL_TOL)


def test_fused_kernels_refuse_head_sizes_their_tiles_do_not_fit(checkpoint_factory) -> None:
    from ssd.models.decoder import fused_kernels_usable

    model, _ = load_model(checkpoint_factory("llama", hidden_size=48, num_heads=4, num_kv_heads=2), dtype=torch.float32)
    assert model.head_dim == 12
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        model.enable_fused_kernels()
    assert not fused_kernels_usable("cuda", 12) and not fused_kernels_usable("cpu", 64)
