"""config.json and generation_config.json for a GGUF import, from the file's metadata and tensor plan.

GGUF stores config floats as float32 and keeps Llama 3 rope scaling only as computed divisors, so this part
recovers the original decimal values and finds the rope parameters that reproduce the divisors; anything it
cannot reproduce exactly is refused rather than approximated.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from ssd.models.gguf_metadata import GGUFArch, GGUFMetadata
from ssd.models.gguf_tensors import ConversionPlan


def build_config(meta: GGUFMetadata, arch: GGUFArch, plan: ConversionPlan, dtype: torch.dtype) -> dict[str, Any]:
    n_heads = int(meta.arch_required("attention.head_count"))
    hidden = int(meta.arch_required("embedding_length"))
    rope_dim = meta.arch("rope.dimension_count")
    if rope_dim is not None and int(rope_dim) != plan.head_dim:
        raise ValueError(
            f"GGUF file rotates {rope_dim} of {plan.head_dim} head dimensions; only full-head RoPE is supported"
        )
    tokens = meta.get("tokenizer.ggml.tokens")
    if tokens is not None and len(tokens) > plan.vocab_rows:
        raise ValueError(f"GGUF tokenizer has {len(tokens)} tokens but the embedding only {plan.vocab_rows} rows")
    config: dict[str, Any] = {
        "architectures": [arch.hf_class],
        "model_type": arch.model_type,
        "vocab_size": plan.vocab_rows,
        "hidden_size": hidden,
        "intermediate_size": int(meta.arch_required("feed_forward_length")),
        "num_hidden_layers": int(meta.arch_required("block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(meta.arch("attention.head_count_kv", n_heads)),
        "head_dim": plan.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _from_float32(meta.arch_required("attention.layer_norm_rms_epsilon")),
        "rope_theta": _from_float32(meta.arch("rope.freq_base", 10000.0)),
        "rope_scaling": _rope_scaling(meta, plan),
        "max_position_embeddings": int(meta.arch_required("context_length")),
        "tie_word_embeddings": plan.tied_embeddings,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": str(dtype).removeprefix("torch."),
    }
    if arch.model_type == "llama":
        config |= {"attention_bias": plan.has_qkv_bias, "mlp_bias": False, "pretraining_tp": 1}
    elif arch.model_type == "qwen2":
        config |= {"use_sliding_window": False, "sliding_window": None}
    elif arch.model_type == "qwen3":
        config |= {"attention_bias": False, "use_sliding_window": False, "sliding_window": None}
    return config


def _from_float32(value: float) -> float:
    """GGUF stores config floats as float32 (1e-6 reads back as 9.99999997e-07); the shortest decimal that
    rounds to the same float32 is the value the original config.json held, and is identical in float32 math."""
    return float(np.format_float_positional(np.float32(value), unique=True, trim="0"))


def _rope_scaling(meta: GGUFMetadata, plan: ConversionPlan) -> dict[str, Any] | None:
    """HF rope_scaling for what the file states; anything we cannot reproduce exactly is refused."""
    kind = meta.arch("rope.scaling.type")
    if plan.rope_freqs is not None:
        return _fit_llama3_rope(plan.rope_freqs, _from_float32(meta.arch("rope.freq_base", 10000.0)), plan.head_dim)
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": _from_float32(meta.arch_required("rope.scaling.factor"))}
    raise ValueError(f"GGUF rope scaling {kind!r} is not supported; supported: none, linear, llama3 (rope_freqs)")


# Llama 3.x checkpoints share low/high frequency factors and original context; only the factor varies.
_LLAMA3_ROPE_CANDIDATES = [
    {"factor": factor, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    for factor in (8.0, 16.0, 32.0, 64.0)
]


def llama3_rope_divisors(params: dict[str, float], rope_theta: float, head_dim: int) -> np.ndarray:
    """The per-frequency divisors llama.cpp stores in rope_freqs for HF's "llama3" rope scaling."""
    inv_freq = 1.0 / rope_theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)  # [head_dim / 2]
    wavelen = 2 * math.pi / inv_freq  # [head_dim / 2]
    orig = params["original_max_position_embeddings"]
    low, high, factor = params["low_freq_factor"], params["high_freq_factor"], params["factor"]
    smooth = np.clip((orig / wavelen - low) / (high - low), 0.0, 1.0)  # [head_dim / 2]
    scaled = (1 - smooth) * inv_freq / factor + smooth * inv_freq  # [head_dim / 2]
    scaled = np.where(wavelen < orig / high, inv_freq, np.where(wavelen > orig / low, inv_freq / factor, scaled))
    return (inv_freq / scaled).astype(np.float32)  # [head_dim / 2]


def _fit_llama3_rope(rope_freqs: np.ndarray, rope_theta: float, head_dim: int) -> dict[str, Any]:
    """GGUF keeps only the computed divisors, so find the Llama 3 parameters that reproduce them."""
    for params in _LLAMA3_ROPE_CANDIDATES:
        expected = llama3_rope_divisors(params, rope_theta, head_dim)
        if expected.shape == rope_freqs.shape and np.allclose(expected, rope_freqs, rtol=1e-4, atol=0.0):
            return {"rope_type": "llama3", **params}
    raise ValueError(
        "GGUF rope_freqs tensor does not match any known Llama 3 rope scaling "
        f"(tried factor {[p['factor'] for p in _LLAMA3_ROPE_CANDIDATES]}, low 1, high 4, original context 8192)"
    )


def generation_config(config: dict[str, Any]) -> dict[str, Any]:
    keys = ("bos_token_id", "eos_token_id", "pad_token_id")
    return {key: config[key] for key in keys if config.get(key) is not None}
