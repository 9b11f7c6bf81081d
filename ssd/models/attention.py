"""Paged attention: the one interface between model code and the KV cache.

Every forward pass (prefill chunks, single-token decode, K+1-token verification, SSD tree decode) is a flat
batch of T new tokens belonging to B sequences. Each sequence attends to a list of cache *slots* (the slots
of its block table, in block-table order) under a boolean mask. Causal attention is the special case where
query i of a sequence with L visible slots sees slots ``0 .. L - q_len + i``; tree attention passes an
explicit mask. Building that metadata is the executor's job (once per step); this module only consumes it,
so a faster backend (CUDA kernels) can replace :func:`paged_attention` behind the same dataclass.

Two layouts share :func:`paged_attention`:

- :class:`AttentionMetadata` (the reference): tokens of a sequence are contiguous in the flat batch and are
  gathered into padded query rows per layer; used by eager forward passes on every device.
- :class:`DenseAttentionMetadata`: the flat batch is already padded to exactly ``B * Q`` tokens (sequence b's
  query i is row ``b * Q + i``) and the key length to a bucket ``L``, so every shape is fixed by ``(B, Q, L)``
  and a CUDA graph can be captured once per bucket (see :mod:`ssd.runtime.static_batch`).

Neither path reads device values on the host (no ``.item()``/``.tolist()``, no data-dependent branching), so
a forward pass queues its kernels without synchronising.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ssd.models.row_attention import row_attention


@dataclass
class AttentionMetadata:
    """Per-step attention layout, shared by every layer of one forward pass."""

    slot_mapping: torch.Tensor  # [T] int64: cache slot that receives each new token's K/V
    kv_slots: torch.Tensor  # [B, L] int64: slots each sequence reads (padding points at any valid slot)
    query_rows: torch.Tensor  # [B, Q] int64: row of the flat batch for each padded query (T = zero row)
    out_index: torch.Tensor  # [T] int64: position of each flat token in the padded [B*Q] output
    mask: torch.Tensor | None  # [B, 1, Q, L] bool, True = may attend; None = one query per sequence (T == B)
    # that sees every one of its L slots
    row_invariant: bool = False  # compute each query row on its own (ssd/models/row_attention.py)

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.numel()


@dataclass
class DenseAttentionMetadata:
    """Fixed-shape layout of ``B`` sequences with ``Q`` query rows each over ``L`` key slots.

    Padding query rows and padding sequences write their K/V to a slot no sequence reads (the caller's pad
    slot) and attend to key column 0 only (so softmax stays finite); their outputs are discarded.
    """

    slot_mapping: torch.Tensor  # [B*Q] int64: slot that receives each row's K/V (pad slot for padding rows)
    kv_slots: torch.Tensor  # [B, L] int64: slots each sequence reads (pad slot for padding columns)
    mask: torch.Tensor  # [B, 1, Q, L] bool, True = may attend

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.numel()


@dataclass
class KVCache:
    """One layer's paged cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` for keys and values."""

    key: torch.Tensor
    value: torch.Tensor


def write_kv(cache: KVCache, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter new keys/values ``[T, Hkv, D]`` into their slots."""
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    cache.key.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    cache.value.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


def gather_slots(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The K or V rows of ``slots`` ``[B, L]`` from one layer's paged cache: ``[B, L, Hkv, D]``.

    ``index_select`` on the flattened slots, not advanced indexing: on CPU the generic index kernel is 3-4x
    slower for these row gathers (20 vs 6 us for 128 slots, 334 vs 77 us for 2,048, one thread).
    """
    num_kv_heads, head_dim = cache.shape[-2], cache.shape[-1]
    rows = cache.view(-1, num_kv_heads, head_dim).index_select(0, slots.reshape(-1))  # [B*L, Hkv, D]
    return rows.view(*slots.shape, num_kv_heads, head_dim)


def paged_attention(
    query: torch.Tensor,  # [T, H, D]
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    cache: KVCache,
    meta: AttentionMetadata | DenseAttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend over each sequence's slots. Returns ``[T, H, D]``."""
    write_kv(cache, key, value, meta.slot_mapping)
    return attend_cached(query, cache, meta, scale)


def attend_cached(
    query: torch.Tensor,  # [T, H, D]
    cache: KVCache,
    meta: AttentionMetadata | DenseAttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Attention over each sequence's slots, this step's K/V already in the cache. Returns ``[T, H, D]``."""
    if isinstance(meta, DenseAttentionMetadata):  # a host-side type check, not a device value
        return dense_attention(query, cache, meta, scale)
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = cache.key.shape[-2]
    if meta.row_invariant:
        return row_attention(query, cache.key.view(-1, num_kv_heads, head_dim),
                             cache.value.view(-1, num_kv_heads, head_dim), meta.kv_slots, meta.query_rows,
                             None if meta.mask is None else meta.mask[:, 0], scale)

    keys = gather_slots(cache.key, meta.kv_slots).transpose(1, 2)  # [B, Hkv, L, D]
    values = gather_slots(cache.value, meta.kv_slots).transpose(1, 2)  # [B, Hkv, L, D]

    gqa = num_heads != num_kv_heads
    if meta.mask is None:  # every sequence decodes one token and reads the same number of slots
        # Pack the query heads sharing a KV head as that head's query rows: [B, Hkv, H/Hkv, D]. One plain
        # SDPA call then covers GQA, several times faster on CPU than enable_gqa with a single query.
        queries = query.view(num_tokens, num_kv_heads, num_heads // num_kv_heads, head_dim)
        out = F.scaled_dot_product_attention(queries, keys, values, scale=scale)  # [B, Hkv, H/Hkv, D]
        return out.reshape(num_tokens, num_heads, head_dim)  # [T, H, D]
    # One sequence (a verification at batch 1, a prefill chunk): its T tokens are exactly its query rows, so
    # the padding and the two row gathers are skipped (what that saves: bench/RESULTS.md).
    one_sequence = meta.query_rows.shape[0] == 1
    if one_sequence:
        queries = query[None]  # [1, T, H, D]
    else:
        padded = torch.cat([query, query.new_zeros(1, num_heads, head_dim)])  # [T+1, H, D]
        queries = padded[meta.query_rows]  # [B, Q, H, D]
    out = F.scaled_dot_product_attention(
        queries.transpose(1, 2), keys, values, attn_mask=meta.mask, scale=scale, enable_gqa=gqa
    )  # [B, H, Q, D]
    out = out.transpose(1, 2).reshape(-1, num_heads, head_dim)  # [B*Q, H, D]
    return out if one_sequence else out[meta.out_index]  # [T, H, D]


def dense_attention(
    query: torch.Tensor,  # [B*Q, H, D]
    cache: KVCache,
    meta: DenseAttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """:func:`attend_cached` over the fixed-shape layout; every shape depends only on ``(B, Q, L)``.

    The query heads sharing a KV head are packed as extra query rows of that head (``[B, Hkv, Q*G, D]``), so
    one plain SDPA call covers GQA without ``enable_gqa`` (which not every fused CUDA kernel accepts with a
    mask), and the mask is repeated per group row.
    """
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = cache.key.shape[-2]
    group = num_heads // num_kv_heads
    batch, _, q_len, kv_len = meta.mask.shape

    keys = gather_slots(cache.key, meta.kv_slots).transpose(1, 2)  # [B, Hkv, L, D]
    values = gather_slots(cache.value, meta.kv_slots).transpose(1, 2)  # [B, Hkv, L, D]
    queries = query.reshape(batch, q_len, num_kv_heads, group, head_dim).permute(0, 2, 1, 3, 4)  # [B, Hkv, Q, G, D]
    queries = queries.reshape(batch, num_kv_heads, q_len * group, head_dim)  # [B, Hkv, Q*G, D]
    mask = meta.mask  # [B, 1, Q, L]; one query row per sequence broadcasts over the G packed rows
    if q_len > 1 and group > 1:
        mask = mask.unsqueeze(3).expand(batch, 1, q_len, group, kv_len).reshape(batch, 1, q_len * group, kv_len)
    out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, scale=scale)  # [B, Hkv, Q*G, D]
    # reshape, not view: fused kernels may return a transposed layout
    out = out.reshape(batch, num_kv_heads, q_len, group, head_dim).permute(0, 2, 1, 3, 4)  # [B, Q, Hkv, G, D]
    return out.reshape(num_tokens, num_heads, head_dim)  # [B*Q, H, D]
