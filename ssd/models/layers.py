"""The building blocks of a decoder layer: RMSNorm, fused-output projections, attention, the gated MLP and the
layer itself (:class:`ssd.models.decoder.DecoderLM` stacks them; an EAGLE-3 head, :mod:`ssd.models.eagle3`,
runs one). Every attention goes through the paged cache (:func:`paged_attention`), so prefill, decode,
verification and tree steps are one call with different metadata.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ssd.models.arch import ModelArchConfig
from ssd.models.attention import AttentionMetadata, DenseAttentionMetadata, KVCache, attend_cached, paged_attention
from ssd.models.parallel import (
    LinearProduct,
    RowParallelLinear,
    SourceSlice,
    partition_evenly,
    partition_heads,
    tp_rank_size,
)
from ssd.models.rope import apply_rope

if TYPE_CHECKING:
    from types import ModuleType

    from ssd.distributed.comm import TensorParallelGroup


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 and cast back before the weight, exactly as HF does (bf16 parity)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class MergedLinear(nn.Linear):
    """A Linear whose output rows stack several logical projections so that one GEMM serves them all.

    Under tensor parallelism it is column-parallel: ``shard_sources`` names the rows of each full checkpoint
    tensor this rank holds (its heads, or its share of the intermediate channels), ``shard_sizes`` their
    local sizes.
    """

    def __init__(
        self,
        in_features: int,
        shard_sizes: dict[str, int],
        bias: bool,
        dtype: torch.dtype | None = None,
        shard_sources: dict[str, slice] | None = None,
        matmul: LinearProduct = F.linear,
    ) -> None:
        super().__init__(in_features, sum(shard_sizes.values()), bias=bias, dtype=dtype)
        self.shard_sizes = dict(shard_sizes)
        self.shard_sources = dict(shard_sources or {})
        self.matmul = matmul

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.weight, self.bias)

    def checkpoint_slice(self, shard: str) -> SourceSlice | None:
        """Rows of shard ``shard``'s checkpoint tensor (weight or bias) that this rank loads."""
        rows = self.shard_sources.get(shard)
        return None if rows is None else SourceSlice(0, rows.start, rows.stop)

    def shard_slice(self, name: str) -> slice:
        """Rows of the fused weight (and bias) that hold shard ``name``."""
        start = 0
        for shard, size in self.shard_sizes.items():
            if shard == name:
                return slice(start, start + size)
            start += size
        raise KeyError(f"unknown shard {name!r}; shards: {list(self.shard_sizes)}")


class Attention(nn.Module):
    """Self-attention over this rank's heads (all heads without tensor parallelism)."""

    def __init__(
        self,
        cfg: ModelArchConfig,
        dtype: torch.dtype | None = None,
        tp: "TensorParallelGroup | None" = None,
        matmul: LinearProduct = F.linear,
        input_size: int | None = None,
    ) -> None:
        """``input_size``: width of the input when it is not ``hidden_size`` (an EAGLE-3 head's q/k/v read the
        token embedding and the feature side by side, twice the hidden size)."""
        super().__init__()
        heads = partition_heads(cfg.num_attention_heads, cfg.num_key_value_heads, *tp_rank_size(tp))
        self.num_heads = heads.num_q
        self.num_kv_heads = heads.num_kv
        self.head_dim = d = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        q_rows = slice(heads.q_start * d, (heads.q_start + heads.num_q) * d)
        kv_rows = slice(heads.kv_start * d, (heads.kv_start + heads.num_kv) * d)
        sources = None if tp is None else {"q": q_rows, "k": kv_rows, "v": kv_rows}
        self.qkv_proj = MergedLinear(
            input_size or cfg.hidden_size,
            {"q": heads.num_q * d, "k": heads.num_kv * d, "v": heads.num_kv * d},
            bias=cfg.qkv_bias,
            dtype=dtype,
            shard_sources=sources,
            matmul=matmul,
        )
        self.o_proj = RowParallelLinear(
            heads.num_q * d, cfg.hidden_size, cfg.o_proj_bias, source=q_rows, tp=tp, dtype=dtype, matmul=matmul
        )
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.cols_per_split: int | None = None  # fused attention's keys per program (None: the kernel's default)

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        cos: torch.Tensor,  # [T, 1, D/2]
        sin: torch.Tensor,  # [T, 1, D/2]
        cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, (H + 2*Hkv) * D]
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # [T, H, D]
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = paged_attention(q, k, v, cache, meta, self.scale)  # [T, H, D]
        return self.o_proj(out.reshape(num_tokens, q_size))  # [T, hidden]

    def fused_forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache, meta: AttentionMetadata,
        kernels: "ModuleType",
    ) -> torch.Tensor:
        """:meth:`forward` with RoPE and the K/V cache write in one kernel, and attention over the fixed-shape
        layout read straight from the cache where ``kernels`` has a ``dense_attention`` (Triton's
        :mod:`ssd.models.fused_kernels`; elsewhere :func:`attend_cached`)."""
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, (H + 2*Hkv) * D]
        d = self.head_dim
        if self.q_norm is not None and self.k_norm is not None:  # per-head norms before RoPE (Qwen3)
            q_size, kv_size = self.num_heads * d, self.num_kv_heads * d
            q, _ = kernels.add_rms_norm(qkv[:, :q_size].reshape(-1, d), None, self.q_norm.weight, self.q_norm.eps)
            k, _ = kernels.add_rms_norm(qkv[:, q_size : q_size + kv_size].reshape(-1, d), None, self.k_norm.weight,
                                        self.k_norm.eps)
            qkv = torch.cat([q.view(num_tokens, q_size), k.view(num_tokens, kv_size), qkv[:, q_size + kv_size :]], -1)
        q = kernels.rope_write_kv(qkv, cos, sin, cache.key, cache.value, meta.slot_mapping,
                                  self.num_heads, self.num_kv_heads, d)  # [T, H, D]
        dense_attention = getattr(kernels, "dense_attention", None)
        if dense_attention is not None and isinstance(meta, DenseAttentionMetadata):  # fixed-shape steps
            out = dense_attention(q, cache.key, cache.value, meta.kv_slots, meta.mask, self.scale,
                                          self.cols_per_split)
        else:
            out = attend_cached(q, cache, meta, self.scale)  # [T, H, D]
        return self.o_proj(out.reshape(num_tokens, self.num_heads * d))  # [T, hidden]


class MLP(nn.Module):
    def __init__(
        self,
        cfg: ModelArchConfig,
        dtype: torch.dtype | None = None,
        tp: "TensorParallelGroup | None" = None,
        matmul: LinearProduct = F.linear,
    ) -> None:
        super().__init__()
        channels = partition_evenly(cfg.intermediate_size, *tp_rank_size(tp), what="intermediate_size")
        size = channels.stop - channels.start
        sources = None if tp is None else {"gate": channels, "up": channels}
        self.gate_up_proj = MergedLinear(
            cfg.hidden_size, {"gate": size, "up": size}, bias=False, dtype=dtype, shard_sources=sources, matmul=matmul
        )
        self.down_proj = RowParallelLinear(
            size, cfg.hidden_size, False, source=channels, tp=tp, dtype=dtype, matmul=matmul
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [T, I] each
        return self.down_proj(F.silu(gate) * up)  # [T, hidden]


class DecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: ModelArchConfig,
        dtype: torch.dtype | None = None,
        tp: "TensorParallelGroup | None" = None,
        matmul: LinearProduct = F.linear,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = Attention(cfg, dtype, tp, matmul)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = MLP(cfg, dtype, tp, matmul)

    def forward(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, cache, meta)  # [T, hidden]
        return h + self.mlp(self.post_attention_layernorm(h))  # [T, hidden]

    def fused_forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
        cache: KVCache, meta: AttentionMetadata, kernels: "ModuleType",
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`forward` with each residual add fused into the norm after it: takes and returns the pair
        ``(x, residual)`` whose sum is the hidden state (``residual`` None: ``x`` is)."""
        norm1, norm2 = self.input_layernorm, self.post_attention_layernorm
        normed, residual = kernels.add_rms_norm(x, residual, norm1.weight, norm1.eps)  # [T, hidden] each
        attn = self.self_attn.fused_forward(normed, cos, sin, cache, meta, kernels)  # [T, hidden]
        normed, residual = kernels.add_rms_norm(attn, residual, norm2.weight, norm2.eps)
        mlp = self.mlp.down_proj(kernels.silu_mul(self.mlp.gate_up_proj(normed)))  # [T, hidden]
        return mlp, residual
