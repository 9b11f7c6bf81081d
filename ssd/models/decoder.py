"""Decoder-only transformer covering Llama, Mistral, Qwen2 and Qwen3 by configuration flags.

These architectures differ only in small switches (q/k/v bias, per-head q/k RMSNorm, RoPE scaling, tied
embeddings), so one implementation keeps exactness fixes in one place. The forward pass takes a flat batch
of tokens from many sequences and does all attention through :func:`paged_attention`, which makes prefill,
decode, verification and tree decoding the same call with different metadata.

Projections that read the same input are fused (q/k/v, gate/up) into :class:`~ssd.models.layers.MergedLinear`
(the layer's blocks live in :mod:`ssd.models.layers`), whose named
output shards tell the loader where each HF tensor goes and tell a tensor-parallel split how to cut the
weight column-wise per shard (o_proj and down_proj are the row-wise halves).

RoPE lives in :mod:`ssd.models.rope`. :meth:`DecoderLM.enable_fused_kernels` switches every layer to its
``fused_forward``: the same arithmetic through fused kernels, the Triton ones of :mod:`ssd.models.fused_kernels`
on CUDA or the C++ ones of :mod:`ssd.models.cpu_fused` for float32 on CPU (:func:`fused_kernels_for` picks).
"""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from ssd.models import cpu_fused
from ssd.models.arch import ModelArchConfig
from ssd.models.attention import AttentionMetadata, KVCache
from ssd.models.layers import DecoderLayer, RMSNorm
from ssd.models.parallel import LinearProduct, VocabParallelEmbedding, VocabParallelHead, parallel_logits
from ssd.models.rope import RotaryEmbedding
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
        return self.forward_features(input_ids, positions, meta, kv_caches, ())[0]

    def forward_features(
        self,
        input_ids: torch.Tensor,  # [T] int64
        positions: torch.Tensor,  # [T] int64
        meta: AttentionMetadata,
        kv_caches: list[KVCache],
        layers: Sequence[int],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`forward`, plus the hidden states entering each of ``layers`` (the residual stream before layer
        i: ``transformers``' ``output_hidden_states[i]``), concatenated in that order ``[T, len(layers) *
        hidden]`` from the same pass (None when ``layers`` is empty): the features an EAGLE-3 head reads (the
        layer stack returns them too, the same bits)."""
        if len(kv_caches) != self.num_layers:
            raise ValueError(f"expected {self.num_layers} KV caches (one per layer), got {len(kv_caches)}")
        capture = {}
        for i in layers:
            if not isinstance(i, int) or not 0 <= i < self.num_layers:
                raise ValueError(f"feature layers must be layer indices in [0, {self.num_layers}), got {list(layers)}")
            capture[i] = None
        h = self.embed_tokens(input_ids)  # [T, hidden]
        cos, sin = self.rotary.cos_sin(positions, h.dtype)  # [T, 1, D/2] each
        if self.layer_stack is not None and isinstance(meta, AttentionMetadata) and meta.row_invariant:
            return self.layer_stack.forward(h, cos, sin, kv_caches, meta, list(layers))  # [T, hidden], features
        if self.kernels is not None:
            residual = None
            for i, (layer, cache) in enumerate(zip(self.layers, kv_caches)):
                if i in capture:
                    capture[i] = h if residual is None else h + residual
                h, residual = layer.fused_forward(h, residual, cos, sin, cache, meta, self.kernels)
            out = self.kernels.add_rms_norm(h, residual, self.norm.weight, self.norm.eps)[0]  # [T, hidden]
        else:
            for i, (layer, cache) in enumerate(zip(self.layers, kv_caches)):
                if i in capture:
                    capture[i] = h
                h = layer(h, cos, sin, cache, meta)  # [T, hidden]
            out = self.norm(h)  # [T, hidden]
        features = torch.cat([capture[i] for i in layers], dim=-1) if layers else None  # [T, n * hidden]
        return out, features

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Float32 logits ``[N, vocab]``; callers pass only the rows they sample from to save the big GEMM.
        Under tensor parallelism only the driver gets them (``None`` on other ranks)."""
        return parallel_logits(hidden, self.head_weight, self.config.vocab_size, self.tp, self.head_matmul)  # [N, V]

    @property
    def head_weight(self) -> torch.Tensor:
        """The LM head's weight ``[V(/tp), hidden]``: the input embedding when tied."""
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
