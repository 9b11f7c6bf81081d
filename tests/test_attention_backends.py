"""The fixed-shape (dense) attention layout equals the reference paged attention op, and metadata transfer.

The dense layout pads every sequence to Q query rows and L key slots so CUDA graphs can capture it; padding
must not change any real row's output nor write any real slot. Exact bitwise equality is not expected: the
padded SDPA reduces over more (masked, zero-weight) keys with different kernel blocking, which moves results
by about one ulp in float32, so outputs are compared at 1e-5 relative to their magnitude.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ssd.models.attention import AttentionMetadata, DenseAttentionMetadata, KVCache, paged_attention
from ssd.models.attention_layout import SequenceLayout, build_attention_metadata
from ssd.runtime.host_transfer import arrays_to_device
from ssd.runtime.static_batch import BucketShape, pack_step

BLOCK, NUM_BLOCKS, HEAD_DIM = 4, 24, 16
PAD_SLOT = (NUM_BLOCKS - 1) * BLOCK  # the last block is reserved for padding writes
RTOL = 1e-5


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    err = (a - b).abs().max().item()
    assert err <= RTOL * max(1.0, b.abs().max().item()), err


def _layouts(q_lens: list[int], kv_lens: list[int], tree: bool, seed: int) -> list[SequenceLayout]:
    """Sequences over disjoint random slots (never the pad block); ``tree`` gives each an explicit mask."""
    rng = np.random.default_rng(seed)
    free = rng.permutation(PAD_SLOT)
    layouts, used = [], 0
    for q, k in zip(q_lens, kv_lens):
        read = free[used : used + k]
        used += k
        mask = None
        if tree:  # prefix visible to all, each new token sees a random subset of the new ones plus itself
            mask = np.zeros((q, k), dtype=bool)
            mask[:, : k - q] = True
            mask[:, k - q :] = rng.random((q, q)) < 0.5
            mask[:, k - q :] |= np.eye(q, dtype=bool)
        layouts.append(SequenceLayout(write_slots=read[k - q :], read_slots=read, mask=mask))
    return layouts


CASES = {
    "decode_uniform": ([1, 1, 1], [9, 9, 9], False, BucketShape(4, 1, 16)),
    "decode_ragged": ([1, 1, 1], [9, 5, 13], False, BucketShape(4, 1, 16)),
    "verify_k_plus_1": ([5, 5], [9, 12], False, BucketShape(2, 8, 16)),
    "verify_clamped": ([5, 3], [20, 7], False, BucketShape(4, 8, 32)),
    "prefill": ([11, 4], [11, 30], False, BucketShape(2, 16, 32)),
    "tree": ([6, 4], [14, 10], True, BucketShape(2, 8, 16)),
}


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 2), (4, 4), (8, 1)])
@pytest.mark.parametrize("case", sorted(CASES))
def test_dense_layout_equals_reference(case: str, num_heads: int, num_kv_heads: int) -> None:
    q_lens, kv_lens, tree, shape = CASES[case]
    gen = torch.Generator().manual_seed(7)
    shape_cache = (NUM_BLOCKS, BLOCK, num_kv_heads, HEAD_DIM)
    key, value = torch.randn(shape_cache, generator=gen), torch.randn(shape_cache, generator=gen)
    ref_cache = KVCache(key.clone(), value.clone())
    dense_cache = KVCache(key.clone(), value.clone())
    layouts = _layouts(q_lens, kv_lens, tree, seed=len(case))
    T = sum(q_lens)
    q = torch.randn(T, num_heads, HEAD_DIM, generator=gen)  # [T, H, D]
    k = torch.randn(T, num_kv_heads, HEAD_DIM, generator=gen)  # [T, Hkv, D]
    v = torch.randn(T, num_kv_heads, HEAD_DIM, generator=gen)  # [T, Hkv, D]

    ref = paged_attention(q, k, v, ref_cache, build_attention_metadata(layouts), HEAD_DIM**-0.5)  # [T, H, D]

    packed = pack_step(shape, np.zeros(T), np.zeros(T), layouts, np.arange(T), PAD_SLOT)
    rows = torch.from_numpy(packed.logit_index)  # [T] padded row of each flat token

    def padded(x: torch.Tensor) -> torch.Tensor:  # [T, ...] -> [B*Q, ...], garbage in padding rows
        out = torch.full((shape.num_tokens, *x.shape[1:]), 3.0)
        out[rows] = x
        return out

    meta = DenseAttentionMetadata(
        torch.from_numpy(packed.slot_mapping), torch.from_numpy(packed.kv_slots), torch.from_numpy(packed.mask)
    )
    out = paged_attention(padded(q), padded(k), padded(v), dense_cache, meta, HEAD_DIM**-0.5)  # [B*Q, H, D]
    assert out.shape == (shape.num_tokens, num_heads, HEAD_DIM)
    assert torch.isfinite(out).all()
    _close(out[rows], ref)
    # Real slots hold exactly what the reference wrote; only the pad block differs.
    assert torch.equal(dense_cache.key[:-1], ref_cache.key[:-1])
    assert torch.equal(dense_cache.value[:-1], ref_cache.value[:-1])


def test_dense_layout_detects_wrong_mask() -> None:
    """The comparison above can fail: a dense mask that lets one query see a future token changes its row."""
    q_lens, kv_lens, _, shape = CASES["verify_k_plus_1"]
    layouts = _layouts(q_lens, kv_lens, False, seed=1)
    T = sum(q_lens)
    gen = torch.Generator().manual_seed(3)
    cache_shape = (NUM_BLOCKS, BLOCK, 2, HEAD_DIM)
    cache = KVCache(torch.randn(cache_shape, generator=gen), torch.randn(cache_shape, generator=gen))
    q = torch.randn(T, 4, HEAD_DIM, generator=gen)
    k, v = torch.randn(T, 2, HEAD_DIM, generator=gen), torch.randn(T, 2, HEAD_DIM, generator=gen)
    ref = paged_attention(q, k, v, KVCache(cache.key.clone(), cache.value.clone()),
                          build_attention_metadata(layouts), 0.25)
    packed = pack_step(shape, np.zeros(T), np.zeros(T), layouts, np.arange(T), PAD_SLOT)
    packed.mask[0, 0, 0, kv_lens[0] - 1] = True  # first verify row peeks at the last draft
    rows = torch.from_numpy(packed.logit_index)
    pad = lambda x: torch.zeros(shape.num_tokens, *x.shape[1:]).index_copy_(0, rows, x)  # noqa: E731
    meta = DenseAttentionMetadata(*(torch.from_numpy(a) for a in (packed.slot_mapping, packed.kv_slots, packed.mask)))
    out = paged_attention(pad(q), pad(k), pad(v), cache, meta, 0.25)[rows]
    assert (out[0] - ref[0]).abs().max() > 1e-3
    _close(out[1:], ref[1:])


def test_reference_metadata_unchanged_on_cpu() -> None:
    """Packing for a single transfer must not change the reference metadata's values, dtypes or shapes."""
    layouts = _layouts([3, 1], [7, 5], False, seed=2)
    meta = build_attention_metadata(layouts)
    assert isinstance(meta, AttentionMetadata)
    assert meta.slot_mapping.dtype == torch.int64 and meta.mask is not None and meta.mask.dtype == torch.bool
    assert meta.kv_slots.shape == (2, 7) and meta.query_rows.shape == (2, 3) and meta.mask.shape == (2, 1, 3, 7)
    assert meta.out_index.tolist() == [0, 1, 2, 3]
    assert meta.query_rows.tolist() == [[0, 1, 2], [3, 4, 4]]
    assert meta.mask[1, 0, 0].tolist() == [True] * 5 + [False] * 2


def _transfer_roundtrip(device: str, pack: bool | None = None) -> None:
    arrays = [
        np.arange(5, dtype=np.int64),
        np.array([[True, False, True]]),
        np.arange(6, dtype=np.int32).reshape(2, 3),
        np.zeros(0, dtype=np.int64),
        np.array([1.5, -2.0], dtype=np.float32),
    ]
    tensors = arrays_to_device(arrays, device, pack)
    for a, t in zip(arrays, tensors):
        assert t.device.type == torch.device(device).type and tuple(t.shape) == a.shape
        assert np.array_equal(t.cpu().numpy(), a)


@pytest.mark.parametrize("pack", [False, True])
def test_arrays_to_device_roundtrip_cpu(pack: bool) -> None:
    _transfer_roundtrip("cpu", pack)  # pack=True runs the single-buffer path CUDA uses


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_arrays_to_device_roundtrip_cuda() -> None:
    _transfer_roundtrip("cuda")


def test_build_step_tensors_matches_separate_builds() -> None:
    from ssd.models.attention_layout import build_step_tensors

    layouts = _layouts([3, 1, 2], [7, 5, 9], True, seed=4)
    ids, positions, rows = [5, 6, 7, 8, 9, 10], np.array([4, 5, 6, 4, 7, 8]), [2, 3, 5]
    step = build_step_tensors(ids, positions, layouts, rows)
    ref = build_attention_metadata(layouts)
    assert step.input_ids.tolist() == ids and step.positions.tolist() == positions.tolist()
    assert step.logit_rows.tolist() == rows and step.input_ids.dtype == torch.int64
    for name in ("slot_mapping", "kv_slots", "query_rows", "out_index", "mask"):
        assert torch.equal(getattr(step.meta, name), getattr(ref, name)), name
    uniform = build_step_tensors([1], np.array([4]), [SequenceLayout([3], [0, 1, 2, 3])], [0])
    assert uniform.meta.mask is None


def _direct_attention(q: torch.Tensor, cache: KVCache, layouts: list[SequenceLayout], scale: float) -> torch.Tensor:
    """Per sequence and head, softmax(q k^T * scale) v over its read slots in float64: the definition."""
    num_heads, num_kv_heads = q.shape[1], cache.key.shape[-2]
    keys = cache.key.reshape(-1, num_kv_heads, HEAD_DIM).double()
    values = cache.value.reshape(-1, num_kv_heads, HEAD_DIM).double()
    out, start = [], 0
    for layout in layouts:
        q_len, kv_len = len(layout.write_slots), len(layout.read_slots)
        mask = layout.mask
        if mask is None:  # causal: query i sees the slots up to its own
            mask = np.arange(kv_len)[None, :] <= (kv_len - q_len + np.arange(q_len))[:, None]
        read = torch.as_tensor(np.asarray(layout.read_slots))
        heads = []
        for h in range(num_heads):
            kv = h // (num_heads // num_kv_heads)
            scores = q[start : start + q_len, h].double() @ keys[read, kv].T * scale  # [q, L]
            scores = scores.masked_fill(~torch.as_tensor(mask), float("-inf"))
            heads.append(torch.softmax(scores, dim=-1) @ values[read, kv])  # [q, D]
        out.append(torch.stack(heads, dim=1))  # [q, H, D]
        start += q_len
    return torch.cat(out).float()  # [T, H, D]


@pytest.mark.parametrize("q_lens,kv_lens,tree", [
    ([5], [23], False),  # one sequence verifying K + 1 = 5 tokens: no padding at all
    ([6], [17], True),  # one sequence's tree step
    ([5, 2, 3], [9, 30, 12], False),  # ragged verification rows, padded
    ([6, 4], [14, 10], True),  # tree steps of two sequences
    ([40], [60], False),  # a prefill chunk
])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 2), (6, 3), (8, 1)])
def test_reference_attention_equals_the_definition(q_lens, kv_lens, tree, num_heads, num_kv_heads) -> None:
    """The reference layout's masked path (one sequence: no padding gathers; several: padded query rows)
    against per-head softmax attention in float64."""
    gen = torch.Generator().manual_seed(3)
    shape_cache = (NUM_BLOCKS, BLOCK, num_kv_heads, HEAD_DIM)
    cache = KVCache(torch.randn(shape_cache, generator=gen), torch.randn(shape_cache, generator=gen))
    layouts = _layouts(q_lens, kv_lens, tree, seed=len(q_lens))
    T = sum(q_lens)
    q = torch.randn(T, num_heads, HEAD_DIM, generator=gen)
    k = torch.randn(T, num_kv_heads, HEAD_DIM, generator=gen)
    v = torch.randn(T, num_kv_heads, HEAD_DIM, generator=gen)
    out = paged_attention(q, k, v, cache, build_attention_metadata(layouts), HEAD_DIM**-0.5)  # writes k, v
    _close(out, _direct_attention(q, cache, layouts, HEAD_DIM**-0.5))
