"""Decoder-only transformer covering Llama, Mistral, Qwen2 and Qwen3 by configuration flags.

These architectures differ only in small switches (q/k/v bias, per-head q/k RMSNorm, RoPE scaling, tied
embeddings), so one implementation keeps exactness fixes in one place. The forward pass takes a flat batch
of tokens from many sequences and does all attention through :func:`paged_attention`, which makes prefill,
decode, verification and tree decoding the same call with different metadata.

Projections that read the same input are fused (q/k/v, gate/up) into :class:`MergedLinear`, whose named
output shards tell the loader where each HF tensor goes and tell a tensor-parallel split how to cut the
weight column-wise per shard (o_proj and down_proj are the row-wise halves).

RoPE lives in :mod:`ssd.models.rope`. :meth:`DecoderLM.enable_fused_kernels` switches every layer to its
``fused_forward``: the same arithmetic through fused kernels, the Triton ones of :mod:`ssd.models.fused_kernels`
on CUDA or the C++ ones of :mod:`ssd.models.cpu_fused` for float32 on CPU (:func:`fused_kernels_for` picks).
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from ssd.models import cpu_fused
from ssd.models.arch import ModelArchConfig
from ssd.models.attention import (
    AttentionMetadata,
    DenseAttentionMetadata,
    KVCache,
    attend_cached,
    paged_attention,
)
from ssd.models.parallel import (
    LinearProduct,
    RowParallelLinear,
    SourceSlice,
    VocabParallelEmbedding,
    VocabParallelHead,
    parallel_logits,
    partition_evenly,
    partition_heads,
    tp_rank_size,
)
from ssd.models.rope import RotaryEmbedding, apply_rope
from ssd.models.small_gemm import SmallRowMatmul

if TYPE_CHECKING:
    from types import ModuleType

    from ssd.distributed.comm import TensorParallelGroup
    from ssd.models.layer_stack import LayerStack


def fused_kernels_fit(head_dim: int) -> bool:
    """The fused kernels' tiles need a power-of-two head size of at least 16."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


def fused_kernels_for(device: torch.device | str, dtype: torch.dtype, head_dim: int) -> "ModuleType | None":
    """The fused kernels a model on ``device`` in ``dtype`` runs: the Triton module where
    :func:`fused_kernels_usable`, the C++ one for float32 on CPU where it compiled, else None."""
    if fused_kernels_usable(device, head_dim):
        return importlib.import_module("ssd.models.fused_kernels")
    return cpu_fused if cpu_fused.usable(device, dtype) else None


def fused_kernels_usable(device: torch.device | str, head_dim: int) -> bool:
    """Whether :meth:`DecoderLM.enable_fused_kernels` can run compiled: CUDA with Triton installed, and a head
    size the kernels fit."""
    return (torch.device(device).type == "cuda" and importlib.util.find_spec("triton") is not None
            and fused_kernels_fit(head_dim))


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
    ) -> None:
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
            cfg.hidden_size,
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


class DecoderLM(nn.Module):
    """Causal LM over a flat batch of tokens with a paged KV cache.

    Parameter names follow HF's (minus the ``model.`` prefix) except for the fused ``qkv_proj`` and
    ``gate_up_proj``; with tied embeddings there is no ``lm_head`` and logits use ``embed_tokens.weight``.
    With a tensor-parallel group ``tp`` the module holds this rank's shard only (see
    :mod:`ssd.models.parallel`); every rank runs the same forward and the driver receives the logits.
    """

    def __init__(
        self, cfg: ModelArchConfig, dtype: torch.dtype | None = None, tp: "TensorParallelGroup | None" = None
    ) -> None:
        super().__init__()
        self.config = cfg
        self.tp = tp
        # few-row products (verification, small batches, SSD trees): the faster GEMM orientation on CPU
        self.matmul = SmallRowMatmul()
        self.head_matmul: LinearProduct = self.matmul  # a PackedFp16Product with packed weights (packed_fp16.py)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp, dtype)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.layers = nn.ModuleList(DecoderLayer(cfg, dtype, tp, self.matmul) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head = (
            None if cfg.tie_word_embeddings else VocabParallelHead(cfg.vocab_size, cfg.hidden_size, tp, dtype)
        )
        self.kernels: ModuleType | None = None  # the fused kernels' module once enable_fused_kernels() has run
        self.layer_stack: LayerStack | None = None  # all layers in one C++ call (enable_fused_kernels, CPU)

    def enable_fused_kernels(self, enabled: bool = True, attention_cols_per_split: int | None = None,
                             kernels: "ModuleType | None" = None) -> None:
        """Run norms, RoPE + K/V writes, SiLU and fixed-shape attention through fused kernels: ``kernels``, a
        module with :mod:`ssd.models.fused_kernels`' functions (:func:`fused_kernels_for` chooses), by default
        the Triton one (the caller checks :func:`fused_kernels_usable`, or runs Triton's interpreter).
        ``attention_cols_per_split`` overrides the Triton attention kernel's keys per program (tuning). Where
        ``kernels`` has a ``layer_stack`` (the CPU module's) and it applies, the steps whose attention is
        row-invariant run every layer in one C++ call (:mod:`ssd.models.layer_stack`): it holds the layers'
        products, so call this after :func:`ssd.models.weight_formats.pack_weights`."""
        if enabled and kernels is None:
            if not fused_kernels_fit(self.head_dim):
                raise ValueError(f"fused kernels need a power-of-two head_dim >= 16, this model has {self.head_dim}")
            kernels = importlib.import_module("ssd.models.fused_kernels")
        self.kernels = kernels if enabled else None
        build_stack = getattr(self.kernels, "layer_stack", None)
        self.layer_stack = build_stack(self) if build_stack is not None else None
        for layer in self.layers:
            layer.self_attn.cols_per_split = attention_cols_per_split

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def num_kv_heads(self) -> int:
        """KV heads held by this rank (and so in its KV cache)."""
        return self.layers[0].self_attn.num_kv_heads if self.layers else self.config.num_key_value_heads

    @property
    def head_dim(self) -> int:
        return self.config.head_dim

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, int, int, int]:
        """Shape of one layer's key (and value) cache tensor, as :class:`KVCache` expects."""
        return (num_blocks, block_size, self.num_kv_heads, self.head_dim)

    def allocate_kv_caches(
        self,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> list[KVCache]:
        """Zeroed per-layer caches in the model's dtype/device unless given."""
        shape = self.kv_cache_shape(num_blocks, block_size)
        dtype = dtype or self.dtype
        device = device if device is not None else self.device
        return [
            KVCache(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(self.num_layers)
        ]

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        meta: AttentionMetadata,
        kv_caches: list[KVCache],
    ) -> torch.Tensor:
        """Run the flat batch; returns final-normed hidden states ``[T, hidden]`` (feed to compute_logits)."""
        if len(kv_caches) != self.num_layers:
            raise ValueError(f"expected {self.num_layers} KV caches (one per layer), got {len(kv_caches)}")
        h = self.embed_tokens(input_ids)  # [T, hidden]
        cos, sin = self.rotary.cos_sin(positions, h.dtype)  # [T, 1, D/2] each
        if self.layer_stack is not None and isinstance(meta, AttentionMetadata) and meta.row_invariant:
            return self.layer_stack.forward(h, cos, sin, kv_caches, meta)  # [T, hidden]
        if self.kernels is not None:
            residual = None
            for layer, cache in zip(self.layers, kv_caches):
                h, residual = layer.fused_forward(h, residual, cos, sin, cache, meta, self.kernels)
            return self.kernels.add_rms_norm(h, residual, self.norm.weight, self.norm.eps)[0]  # [T, hidden]
        for layer, cache in zip(self.layers, kv_caches):
            h = layer(h, cos, sin, cache, meta)  # [T, hidden]
        return self.norm(h)  # [T, hidden]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Float32 logits ``[N, vocab]``; callers pass only the rows they sample from to save the big GEMM.
        Under tensor parallelism only the driver gets them (``None`` on other ranks)."""
        return parallel_logits(hidden, self.head_weight, self.config.vocab_size, self.tp, self.head_matmul)  # [N, V]

    @property
    def head_weight(self) -> torch.Tensor:
        """The LM head's weight ``[V(/tp), hidden]``: the input embedding when tied."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
