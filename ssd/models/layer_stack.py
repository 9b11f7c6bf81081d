"""A decoder's layers in one C++ call on CPU, for float32 models whose projections are all block-quantized.

With the fused glue of :mod:`ssd.models.cpu_fused`, a layer of a decoder step is still about 25 Python-level
calls (module calls, the products' wrappers, views, the attention dispatch), a large share of a small model's
step (measured in the README, "Weight formats"). A
:class:`LayerStack` holds every layer's packed weights in C++ (``csrc/layer_stack.cpp``) and runs the same
operations, in the same order, through the same kernels (:mod:`ssd.models.block_quant`, the fused glue, the
row-invariant attention), so its hidden states are those of ``DecoderLayer.fused_forward`` bit for bit; the
embedding, RoPE's tables and the LM head stay in Python. The call releases the GIL.

:func:`build_layer_stack` returns one only where it applies: CPU, float32, no tensor parallelism, every
projection a :class:`~ssd.models.block_quant.BlockQuantProduct`, the kernels built. ``DecoderLM`` then runs
its steps through it when their attention is row-invariant (``AttentionMetadata.row_invariant``, which every
model in a block format runs), and through the Python layers otherwise.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from ssd.models.attention import AttentionMetadata, KVCache
from ssd.models.block_quant import BlockQuantProduct
from ssd.models.native import cpu_kernels, cpu_kernels_available

if TYPE_CHECKING:
    from ssd.models.decoder import DecoderLM

logger = logging.getLogger(__name__)


class LayerStack:
    """Every layer of one model, run by one C++ call per step (:meth:`forward`)."""

    def __init__(self, model: "DecoderLM") -> None:
        attn = model.layers[0].self_attn
        self._stack = cpu_kernels().LayerStack(attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.scale,
                                               model.norm.eps, model.norm.weight)
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            self._stack.add_layer(
                layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                _projection(attn.qkv_proj), _projection(attn.o_proj), _projection(mlp.gate_up_proj),
                _projection(mlp.down_proj), None if attn.q_norm is None else attn.q_norm.weight,
                None if attn.k_norm is None else attn.k_norm.weight,
            )

    @property
    def num_layers(self) -> int:
        return self._stack.num_layers

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata, capture: Sequence[int] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The final-normed hidden states ``[T, hidden]`` of the embedded tokens ``h`` ``[T, hidden]`` (RoPE's
        ``cos``, ``sin`` ``[T, 1, D/2]``), and with ``capture`` the hidden states entering those layers,
        concatenated ``[T, len(capture) * hidden]`` (else None); writes the step's keys and values into
        ``kv_caches``."""
        mask = None if meta.mask is None else meta.mask[:, 0]  # [B, Q, L]
        out, features = self._stack.forward(h, cos, sin, [c.key for c in kv_caches], [c.value for c in kv_caches],
                                            meta.slot_mapping, meta.kv_slots, meta.query_rows, mask, list(capture))
        return out, (features if capture else None)


def _projection(linear: torch.nn.Linear):
    product = linear.matmul
    return cpu_kernels().Projection(product.packed, product.kind_code, product.out_features, linear.bias)


def unsupported(model: "DecoderLM") -> str | None:
    """Why :class:`LayerStack` cannot run ``model`` (None: it can)."""
    if model.tp is not None:
        return "tensor parallelism"
    if model.device.type != "cpu" or model.dtype != torch.float32:
        return f"{model.dtype} on {model.device} (float32 on CPU only)"
    if not model.layers:
        return "no layers"
    for i, layer in enumerate(model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        for name, linear in (("qkv_proj", attn.qkv_proj), ("o_proj", attn.o_proj), ("gate_up_proj", mlp.gate_up_proj),
                             ("down_proj", mlp.down_proj)):
            if not isinstance(linear.matmul, BlockQuantProduct):
                return f"layer {i}'s {name} is not block-quantized"
        norms = [layer.input_layernorm, layer.post_attention_layernorm, *filter(None, (attn.q_norm, attn.k_norm))]
        if any(norm.eps != model.norm.eps for norm in norms):
            return f"layer {i}'s norms differ in eps from the final norm"
    if not cpu_kernels_available():
        return "the CPU kernels did not compile"
    return None


def build_layer_stack(model: "DecoderLM") -> LayerStack | None:
    """A :class:`LayerStack` of ``model``'s layers where it applies (see :func:`unsupported`), else None."""
    reason = unsupported(model)
    if reason is not None:
        logger.debug("layers run in Python: %s", reason)
        return None
    return LayerStack(model)
