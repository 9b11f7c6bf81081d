"""Rotary position embeddings (rotate-half, as Llama / Qwen in Hugging Face), with Llama 3.1 frequency scaling.

Angles come from float32 positions and an exact float32 frequency table; the cos/sin tables are computed once
per forward pass and shared by every layer.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ssd.models.arch import RopeScaling


def rope_inv_freq(head_dim: int, theta: float, scaling: RopeScaling | None) -> torch.Tensor:
    """Inverse RoPE frequencies in float32 on the CPU (also inside a meta-device build, whose Python reference
    ops would import PyTorch's compiler stack), with Llama 3.1 scaling when configured. Returns ``[head_dim/2]``."""
    positions = torch.arange(0, head_dim, 2, dtype=torch.float32, device="cpu")  # [D/2]
    inv_freq = 1.0 / (theta ** (positions / head_dim))  # [D/2]
    if scaling is None:
        return inv_freq
    # Llama 3.1: keep high frequencies, divide low frequencies by `factor`, interpolate smoothly between.
    old_len = scaling.original_max_position_embeddings
    low_wavelen = old_len / scaling.low_freq_factor
    high_wavelen = old_len / scaling.high_freq_factor
    wavelen = 2 * math.pi / inv_freq  # [D/2]
    scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
    smooth = (old_len / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
    smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Neox-style (rotate-half) RoPE; angles are computed in float32 from positions, then cast to x's dtype."""

    inv_freq: torch.Tensor

    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling | None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.theta = theta
        self.scaling = scaling
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, theta, scaling), persistent=False)

    def _apply(self, fn, recurse: bool = True):  # type: ignore[no-untyped-def]
        # `.to(bf16)`, `.to_empty()` or a meta-device build would degrade or drop inv_freq; it must stay an
        # exact float32 table, so recompute it wherever the module lands.
        super()._apply(fn, recurse)
        device = self.inv_freq.device
        if device.type != "meta":
            self.inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling).to(device)
        return self

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Half-width cos/sin tables ``[T, 1, D/2]`` shared by every layer of one forward pass."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, D/2]
        return freqs.cos().to(dtype)[:, None, :], freqs.sin().to(dtype)[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` ``[T, H, D]`` by cos/sin ``[T, 1, D/2]``; same arithmetic as HF's ``x*cos + rotate_half(x)*sin``."""
    x1, x2 = x.chunk(2, dim=-1)  # [T, H, D/2] each
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)  # [T, H, D]
