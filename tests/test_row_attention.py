"""The row-invariant attention kernel (ssd/models/row_attention.py): against SDPA and a float64 reference on
every layout the engine builds, bitwise row invariance (a token's result alone, in a verification, in a padded
batch, at any thread count), and a w8a8 target decoding the same tokens in every mode and batch shape."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from ssd.models.attention import KVCache, attend_cached
from ssd.models.attention_layout import SequenceLayout, build_attention_metadata
from ssd.models.row_attention import available
from ssd.models import weight_formats
from ssd_utils import assert_every_mode_decodes_like_ar, make_perturbed_draft

pytestmark = pytest.mark.skipif(not available(), reason="the row-invariant attention kernel could not be compiled")

BLOCK = 4


def _cache(num_slots: int, num_kv_heads: int, head_dim: int, seed: int = 0) -> KVCache:
    gen = torch.Generator().manual_seed(seed)
    shape = (num_slots // BLOCK, BLOCK, num_kv_heads, head_dim)
    return KVCache(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen))


def _causal(start: int, q_len: int, kv_len: int) -> SequenceLayout:
    """A sequence whose slots are ``start ..``: ``q_len`` new tokens, ``kv_len`` visible slots in all."""
    read = np.arange(start, start + kv_len)
    return SequenceLayout(read[kv_len - q_len:], read, None)


def _tree(start: int, prefix: int, branches: int) -> SequenceLayout:
    read = np.arange(start, start + prefix + branches)
    mask = np.zeros((branches, prefix + branches), dtype=bool)
    mask[:, :prefix] = True
    mask[:, prefix:] = np.eye(branches, dtype=bool)
    return SequenceLayout(read[prefix:], read, mask)


def _reference(query: torch.Tensor, cache: KVCache, layouts: list[SequenceLayout], scale: float) -> torch.Tensor:
    """Float64 attention of every query row over the slots its layout lets it see."""
    num_heads, head_dim = query.shape[1], query.shape[2]
    keys = cache.key.view(-1, cache.key.shape[-2], head_dim).double()
    values = cache.value.view(-1, cache.key.shape[-2], head_dim).double()
    group = num_heads // keys.shape[1]
    out, row = torch.empty(query.shape, dtype=torch.float64), 0
    for layout in layouts:
        read, q_len = np.asarray(layout.read_slots), len(layout.write_slots)
        for i in range(q_len):
            visible = read[layout.mask[i]] if layout.mask is not None else read[: len(read) - q_len + i + 1]
            for h in range(num_heads):
                k, v = keys[visible, h // group], values[visible, h // group]
                p = torch.softmax(k @ query[row, h].double() * scale, dim=0)
                out[row, h] = p @ v
            row += 1
    return out


LAYOUTS = {
    "decode, one sequence": [_causal(0, 1, 13)],
    "decode, equal lengths": [_causal(0, 1, 9), _causal(16, 1, 9), _causal(32, 1, 9)],
    "decode, different lengths": [_causal(0, 1, 5), _causal(16, 1, 14)],
    "verification": [_causal(0, 5, 17)],
    "verification and prefill chunk": [_causal(0, 5, 11), _causal(24, 12, 12)],
    "tree": [_tree(0, 9, 6)],
}


@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(4, 2, 64), (9, 3, 64), (2, 2, 20)])
def test_matches_sdpa_and_a_float64_reference(name, num_heads, num_kv_heads, head_dim):
    layouts = LAYOUTS[name]
    cache = _cache(48, num_kv_heads, head_dim)
    num_tokens = sum(len(layout.write_slots) for layout in layouts)
    query = torch.randn(num_tokens, num_heads, head_dim, generator=torch.Generator().manual_seed(1))
    meta = build_attention_metadata(layouts)
    scale = head_dim ** -0.5
    kernel = attend_cached(query, cache, replace(meta, row_invariant=True), scale)
    sdpa = attend_cached(query, cache, meta, scale)
    reference = _reference(query, cache, layouts, scale)
    torch.testing.assert_close(kernel.double(), reference, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kernel, sdpa, rtol=1e-4, atol=1e-5)


def _kernel(query, cache, layouts, scale=0.125):
    return attend_cached(query, cache, replace(build_attention_metadata(layouts), row_invariant=True), scale)


def test_a_token_gets_the_same_bits_in_every_kind_of_step():
    """Token 12 of a sequence: decoded alone, as the middle row of a verification, in a batch beside another
    sequence (padded keys and queries), and at one or two threads."""
    cache = _cache(64, 2, 64)
    rows = torch.randn(8, 4, 64, generator=torch.Generator().manual_seed(2))
    alone = _kernel(rows[2:3], cache, [_causal(0, 1, 13)])[0]
    in_verification = _kernel(rows[:5], cache, [_causal(0, 5, 15)])[2]  # rows at positions 10..14
    batch = torch.cat([rows[5:8], rows[:5]])
    in_batch = _kernel(batch, cache, [_causal(32, 3, 30), _causal(0, 5, 15)])[3 + 2]  # after the 3 rows before it
    assert torch.equal(alone, in_verification) and torch.equal(alone, in_batch)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = _kernel(batch, cache, [_causal(32, 3, 30), _causal(0, 5, 15)])
        torch.set_num_threads(2)
        two = _kernel(batch, cache, [_causal(32, 3, 30), _causal(0, 5, 15)])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


ENGINE = dict(dtype="float32", weight_format="w8a8", kv_cache_memory="16MiB", max_model_len=128, block_size=8, seed=0)


@pytest.mark.skipif(not weight_formats.fbgemm_available(), reason="PyTorch built without FBGEMM")
def test_every_mode_and_batch_shape_of_a_w8a8_target_decodes_the_same(checkpoint_factory, tmp_path):
    target = str(checkpoint_factory("llama"))
    draft = str(make_perturbed_draft(target, tmp_path / "draft", 0.02))
    assert_every_mode_decodes_like_ar(target, draft, ENGINE)
