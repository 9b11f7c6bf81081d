"""Paged attention: the one interface between model code and the KV cache.

Every forward pass (prefill chunks, single-token decode, K+1-token verification, SSD tree decode) is a flat
batch of T new tokens belonging to B sequences. Each sequence attends to a list of cache *slots* (the slots
of its block table, in block-table order) under a boolean mask. Causal attention is the special case where
query i of a sequence with L visible slots sees slots ``0 .. L - q_len + i``; tree attention passes an
explicit mask. Building that metadata is the executor's job (once per step); this module only consumes it,
so a faster backend (CUDA kernels) can replace :func:`paged_attention` behind the same dataclass.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Per-step attention layout, shared by every layer of one forward pass."""

    slot_mapping: torch.Tensor  # [T] int64: cache slot that receives each new token's K/V
    kv_slots: torch.Tensor  # [B, L] int64: slots each sequence reads (padding points at any valid slot)
    query_rows: torch.Tensor  # [B, Q] int64: row of the flat batch for each padded query (T = zero row)
    out_index: torch.Tensor  # [T] int64: position of each flat token in the padded [B*Q] output
    mask: torch.Tensor | None  # [B, 1, Q, L] bool, True = may attend; None = one query per sequence (T == B)
    # that sees every one of its L slots

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


def paged_attention(
    query: torch.Tensor,  # [T, H, D]
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    cache: KVCache,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Write this step's K/V into the cache, then attend over each sequence's slots. Returns ``[T, H, D]``."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    write_kv(cache, key, value, meta.slot_mapping)

    flat_k = cache.key.view(-1, num_kv_heads, head_dim)
    flat_v = cache.value.view(-1, num_kv_heads, head_dim)
    keys = flat_k[meta.kv_slots].transpose(1, 2)  # [B, Hkv, L, D]
    values = flat_v[meta.kv_slots].transpose(1, 2)  # [B, Hkv, L, D]

    gqa = num_heads != num_kv_heads
    if meta.mask is None:  # every sequence decodes one token and reads the same number of slots
        # Pack the query heads sharing a KV head as that head's query rows: [B, Hkv, H/Hkv, D]. One plain
        # SDPA call then covers GQA, several times faster on CPU than enable_gqa with a single query.
        queries = query.view(num_tokens, num_kv_heads, num_heads // num_kv_heads, head_dim)
        out = F.scaled_dot_product_attention(queries, keys, values, scale=scale)  # [B, Hkv, H/Hkv, D]
        return out.reshape(num_tokens, num_heads, head_dim)  # [T, H, D]
    padded = torch.cat([query, query.new_zeros(1, num_heads, head_dim)])  # [T+1, H, D]
    queries = padded[meta.query_rows].transpose(1, 2)  # [B, H, Q, D]
    out = F.scaled_dot_product_attention(
        queries, keys, values, attn_mask=meta.mask, scale=scale, enable_gqa=gqa
    )  # [B, H, Q, D]
    out = out.transpose(1, 2).reshape(-1, num_heads, head_dim)  # [B*Q, H, D]
    return out[meta.out_index]  # [T, H, D]
