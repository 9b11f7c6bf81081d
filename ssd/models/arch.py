"""Architecture description parsed from a Hugging Face ``config.json``.

The engine needs a small, validated subset of the HF config to build a model, size its KV cache and know its
special tokens. Parsing it once, into a typed dataclass with clear errors, keeps raw dicts (and the many
spellings different ``transformers`` versions use) out of model and engine code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")

# Defaults that ``transformers`` applies when a key is absent from config.json, per architecture.
_DEFAULT_MAX_POSITIONS = {
    "LlamaForCausalLM": 2048,
    "MistralForCausalLM": 32768,
    "Qwen2ForCausalLM": 32768,
    "Qwen3ForCausalLM": 32768,
}
_SUPPORTED_ROPE_TYPES = ("default", "llama3")


@dataclass(frozen=True)
class RopeScaling:
    """Llama 3.1 frequency-dependent RoPE scaling (``rope_type: "llama3"``), the only scaling supported."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int
    rope_type: str = "llama3"


@dataclass
class ModelArchConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    tie_word_embeddings: bool
    qkv_bias: bool  # bias on q/k/v projections (always for Qwen2; ``attention_bias`` elsewhere)
    o_proj_bias: bool  # bias on the output projection (``attention_bias`` for Llama/Qwen3; never for Qwen2)
    qk_norm: bool  # per-head RMSNorm on q and k before RoPE (Qwen3)
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_id: list[int] = field(default_factory=list)
    torch_dtype: str | None = None

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @classmethod
    def from_hf_config(cls, d: dict[str, Any]) -> ModelArchConfig:
        """Validate and normalise an HF config dict; raises ValueError naming the offending field."""
        if not isinstance(d, dict):
            raise ValueError(f"config must be a JSON object (dict), got {type(d).__name__}")
        architecture = _parse_architecture(d)

        vocab_size = _req_int(d, "vocab_size")
        hidden_size = _req_int(d, "hidden_size")
        intermediate_size = _req_int(d, "intermediate_size")
        num_layers = _req_int(d, "num_hidden_layers")
        num_heads = _req_int(d, "num_attention_heads")
        num_kv_heads = _opt_int(d, "num_key_value_heads", num_heads)
        if num_heads % num_kv_heads != 0:
            raise ValueError(
                f"num_attention_heads ({num_heads}) must be a multiple of num_key_value_heads ({num_kv_heads})"
            )
        if d.get("head_dim") is not None:
            head_dim = _req_int(d, "head_dim")
        else:
            if hidden_size % num_heads != 0:
                raise ValueError(
                    f"hidden_size ({hidden_size}) must be divisible by num_attention_heads ({num_heads}) "
                    "when head_dim is not given"
                )
            head_dim = hidden_size // num_heads
        if head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {head_dim}")

        _check_unsupported_features(d, architecture)
        rope_theta, rope_scaling = _parse_rope(d)

        rms_norm_eps = _opt_float(d, "rms_norm_eps", 1e-6)
        attention_bias = _opt_bool(d, "attention_bias", False)
        is_qwen2 = architecture == "Qwen2ForCausalLM"
        return cls(
            architecture=architecture,
            vocab_size=vocab_size,
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=head_dim,
            rms_norm_eps=rms_norm_eps,
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=_opt_bool(d, "tie_word_embeddings", False),
            qkv_bias=True if is_qwen2 else attention_bias,
            o_proj_bias=False if is_qwen2 else attention_bias,
            qk_norm=architecture == "Qwen3ForCausalLM",
            max_position_embeddings=_opt_int(d, "max_position_embeddings", _DEFAULT_MAX_POSITIONS[architecture]),
            bos_token_id=_parse_optional_token(d, "bos_token_id"),
            eos_token_id=_parse_eos(d),
            torch_dtype=_parse_dtype(d),
        )


def _parse_architecture(d: dict[str, Any]) -> str:
    archs = d.get("architectures")
    if archs is None:
        raise ValueError(f"config has no 'architectures' field; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    if isinstance(archs, str):
        archs = [archs]
    if not isinstance(archs, list) or len(archs) != 1 or not isinstance(archs[0], str):
        raise ValueError(f"config 'architectures' must be a list with one class name, got {archs!r}")
    if archs[0] not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"unsupported architecture {archs[0]!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return archs[0]


def _check_unsupported_features(d: dict[str, Any], architecture: str) -> None:
    """Reject config options that would change the computation in ways this engine does not implement."""
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"unsupported hidden_act {act!r}; only 'silu' (SwiGLU) is supported")
    if d.get("mlp_bias"):
        raise ValueError("mlp_bias=true is not supported; only bias-free MLPs are")
    partial = d.get("partial_rotary_factor", 1.0)
    if partial not in (None, 1, 1.0):
        raise ValueError(f"partial_rotary_factor={partial!r} is not supported; only 1.0 (full rotary)")
    if architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        if d.get("use_sliding_window"):
            raise ValueError("use_sliding_window=true is not supported; only full attention")
        layer_types = d.get("layer_types")
        if layer_types is not None and any(t != "full_attention" for t in layer_types):
            raise ValueError(f"layer_types {sorted(set(layer_types))} not supported; only 'full_attention'")
    if architecture == "MistralForCausalLM" and d.get("sliding_window") is not None:
        raise ValueError(
            f"Mistral sliding_window={d['sliding_window']!r} is not supported; only sliding_window=null"
        )


def _parse_rope(d: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """Read rope theta and scaling from either layout.

    transformers < 5 writes ``rope_theta`` at top level and scaling under ``rope_scaling``; transformers 5
    writes both into ``rope_parameters`` (with ``rope_type: "default"`` when unscaled).
    """
    params = d.get("rope_parameters")
    legacy = d.get("rope_scaling")
    for name, value in (("rope_parameters", params), ("rope_scaling", legacy)):
        if value is not None and not isinstance(value, dict):
            raise ValueError(f"config '{name}' must be an object or null, got {value!r}")
    params = params or {}
    legacy = legacy or {}

    theta_raw = params.get("rope_theta", d.get("rope_theta", 10000.0))
    if isinstance(theta_raw, bool) or not isinstance(theta_raw, (int, float)) or not theta_raw > 0:
        raise ValueError(f"rope_theta must be a positive number, got {theta_raw!r}")
    theta = float(theta_raw)

    scaling = params if _rope_type(params) != "default" else legacy
    rope_type = _rope_type(scaling)
    if rope_type not in _SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {', '.join(_SUPPORTED_ROPE_TYPES)}")
    if rope_type == "default":
        return theta, None

    def num(key: str, default: Any = None) -> float:
        value = scaling.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise ValueError(f"llama3 rope scaling needs a positive number for {key!r}, got {value!r}")
        return float(value)

    low, high = num("low_freq_factor"), num("high_freq_factor")
    if high <= low:
        raise ValueError(f"llama3 rope scaling needs high_freq_factor > low_freq_factor, got {high} <= {low}")
    original = num("original_max_position_embeddings", d.get("max_position_embeddings"))
    if original != int(original):
        raise ValueError(f"original_max_position_embeddings must be an integer, got {original}")
    return theta, RopeScaling(
        factor=num("factor"),
        low_freq_factor=low,
        high_freq_factor=high,
        original_max_position_embeddings=int(original),
    )


def _rope_type(scaling: dict[str, Any]) -> str:
    return scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"


def _req_int(d: dict[str, Any], key: str) -> int:
    if key not in d or d[key] is None:
        raise ValueError(f"config is missing required field {key!r}")
    value = d[key]
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"config field {key!r} must be a positive integer, got {value!r}")
    return value


def _opt_int(d: dict[str, Any], key: str, default: int) -> int:
    return default if d.get(key) is None else _req_int(d, key)


def _opt_float(d: dict[str, Any], key: str, default: float) -> float:
    value = d.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (value > 0 and math.isfinite(value)):
        raise ValueError(f"config field {key!r} must be a positive number, got {value!r}")
    return float(value)


def _opt_bool(d: dict[str, Any], key: str, default: bool) -> bool:
    value = d.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ValueError(f"config field {key!r} must be true or false, got {value!r}")
    return value


def _parse_optional_token(d: dict[str, Any], key: str) -> int | None:
    value = d.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"config field {key!r} must be a non-negative integer or null, got {value!r}")
    return value


def _parse_eos(d: dict[str, Any]) -> list[int]:
    value = d.get("eos_token_id")
    if value is None:
        return []
    items = value if isinstance(value, list) else [value]
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in items):
        raise ValueError(f"config field 'eos_token_id' must be an integer or a list of integers, got {value!r}")
    return list(items)


def _parse_dtype(d: dict[str, Any]) -> str | None:
    # transformers 5 writes "dtype"; older versions "torch_dtype".
    value = d.get("torch_dtype", d.get("dtype"))
    if value is None:
        return None
    if not isinstance(value, str):
        raise ValueError(f"config field 'torch_dtype' must be a string such as 'bfloat16', got {value!r}")
    return value.removeprefix("torch.")
