"""The fused-kernel interface of :mod:`ssd.models.fused_kernels` for float32 models on CPU.

A decoder step of a small model on CPU spends a large share of its time dispatching PyTorch's small operators:
per layer, the two RMSNorms (six operators each), the residual adds, RoPE (eight operators per tensor) and the
two K/V cache writes are ~30 calls on a few hundred floats each, a large share of a small model's step
(``bench/RESULTS.md``, "Numbers behind the CPU code"). ``DecoderLM.enable_fused_kernels`` with this module runs
each layer through ``fused_forward`` instead, where a C++ kernel (``csrc/cpu_fused.cpp``, compiled on first use
like the other CPU kernels, ``ssd/models/native.py``) does the residual add with the norm after it, and RoPE with
the cache write, in one call each. There is no ``dense_attention`` here: attention stays on the CPU paths of
:func:`ssd.models.attention.attend_cached`. Where every projection is block-quantized, :func:`layer_stack`
goes further and runs all the layers in one C++ call (:mod:`ssd.models.layer_stack`).

Numerics: RoPE gives the unfused path's bits (products rounded, then the sum); the norm sums its squares in a
fixed order of its own (16 lanes combined pairwise), so its last bits can differ from PyTorch's ``mean``. Every
row is computed alone, so results never depend on the rows beside them or the thread count, and every mode of
an engine runs the same kernels: speculative outputs still equal autoregressive ones.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ssd.models.layer_stack import LayerStack, build_layer_stack
from ssd.models.native import cpu_kernels, cpu_kernels_available

if TYPE_CHECKING:
    from ssd.models.decoder import DecoderLM


def available() -> bool:
    """Whether the kernels compiled (or were found compiled) on this machine; logs why not."""
    return cpu_kernels_available()


def usable(device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether a model on ``device`` in ``dtype`` can run through this module: float32 on CPU, kernels built."""
    return torch.device(device).type == "cpu" and dtype == torch.float32 and available()


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``h = x + residual`` (or ``x`` when None), then ``(rms_norm(h) * weight, h)``; ``x`` is ``[T, hidden]``."""
    return cpu_kernels().add_rms_norm(x, residual, weight, float(eps))


def rope_write_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, key_cache: torch.Tensor,
                  value_cache: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int, num_kv_heads: int,
                  head_dim: int) -> torch.Tensor:
    """:func:`ssd.models.fused_kernels.rope_write_kv` (same arguments and result; any even ``head_dim``)."""
    cpu_kernels().rope_write_kv(qkv, cos, sin, key_cache, value_cache, slot_mapping, num_heads, num_kv_heads, head_dim)
    return qkv[:, : num_heads * head_dim].view(qkv.shape[0], num_heads, head_dim)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of the fused ``[T, 2*I]`` gate/up projection; returns ``[T, I]`` (PyTorch's vectorised
    SiLU: two operators, already as fast as a loop of ours would be without a vector exponential)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


def layer_stack(model: "DecoderLM") -> LayerStack | None:
    """All of ``model``'s layers as one C++ call, where every projection is block-quantized
    (:mod:`ssd.models.layer_stack`); None elsewhere."""
    return build_layer_stack(model)
