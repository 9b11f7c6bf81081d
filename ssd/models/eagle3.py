"""EAGLE-3 draft heads: a one-layer drafter that reads the target's own hidden states.

A head is loaded from the layout the public EAGLE-3 releases use. ``config.json`` gives the head's shape
(``hidden_size``, ``intermediate_size``, ``num_attention_heads``, ``num_key_value_heads``, ``rms_norm_eps``,
RoPE), ``vocab_size`` (the target's), ``draft_vocab_size``, optionally ``target_hidden_size`` (default: the
head's) and the target layers it reads, ``eagle_aux_hidden_state_layer_ids`` at the top level or under
``eagle_config`` (default ``(2, L // 2, L - 3)`` for an L-layer target, the published choice). The weights
(``model.safetensors`` or ``pytorch_model.bin``)::

    fc.weight                                   [H, 3 Ht]  fuses the three target hidden states
    midlayer.input_layernorm.weight             [H]        norms the token embedding
    midlayer.hidden_norm.weight                 [H]        norms the feature
    midlayer.self_attn.{q,k,v}_proj.weight      [*, 2H]    attention over [embedding, feature] side by side
    midlayer.self_attn.o_proj.weight            [H, H]
    midlayer.post_attention_layernorm.weight    [H]
    midlayer.mlp.{gate,up,down}_proj.weight                the gated SiLU MLP
    norm.weight [H], lm_head.weight [Vd, H]                logits over the draft vocabulary
    d2t [Vd] int64                                         draft id i is target id i + d2t[i]
    t2d [V] bool                                           the target ids the head can propose
    embed_tokens.weight [V, H]                             optional: else the target's input embedding

A row at position p takes the token at p + 1 and the feature of position p: the target's three hidden states
at p through ``fc`` where the target has computed p, else (drafting further) the head's own output of the row
at p - 1. It predicts the token at p + 2:

    z = [input_layernorm(embed(token)), hidden_norm(g)]      [T, 2H]
    h = g + o_proj(attention(q/k/v(z)))                      causal over the head's own KV cache, RoPE at p
    h = h + mlp(post_attention_layernorm(h))                 the feature the next row takes
    logits = lm_head(norm(h))                                over the draft vocabulary, mapped by d2t

The target's features are the residual stream entering the chosen layers
(:meth:`ssd.models.decoder.DecoderLM.forward_features`).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ssd.models.arch import ModelArchConfig
from ssd.models.attention import AttentionMetadata, KVCache
from ssd.models.layers import MLP, Attention, MergedLinear, RMSNorm
from ssd.models.parallel import LinearProduct
from ssd.models.rope import RotaryEmbedding

ARCHITECTURE = "LlamaForCausalLMEagle3"
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


def is_eagle3_head(folder: str | Path) -> bool:
    """Whether ``folder`` holds an EAGLE-3 head (by its ``config.json``), not a model of its own."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return False
    if not isinstance(config, dict):
        return False
    archs = config.get("architectures")
    return archs == [ARCHITECTURE] or (archs is None and "draft_vocab_size" in config)


def default_feature_layers(num_target_layers: int) -> tuple[int, int, int]:
    """The target layers published EAGLE-3 heads read: low, middle and high."""
    return (2, num_target_layers // 2, num_target_layers - 3)


@dataclass(frozen=True)
class Eagle3Config:
    arch: ModelArchConfig  # the head's one layer, as a Llama layer of this shape
    draft_vocab_size: int
    target_hidden_size: int
    feature_layers: tuple[int, ...] | None  # None: default_feature_layers of the target

    @classmethod
    def from_hf_config(cls, d: dict[str, Any]) -> Eagle3Config:
        """Validate a head's ``config.json``; raises ValueError naming the offending field."""
        if not isinstance(d, dict):
            raise ValueError(f"config must be a JSON object, got {type(d).__name__}")
        archs = d.get("architectures")
        if archs is not None and archs != [ARCHITECTURE]:
            raise ValueError(f"not an EAGLE-3 head: architectures {archs!r}, expected [{ARCHITECTURE!r}]")
        base = {k: v for k, v in d.items() if k not in ("architectures", "eagle_config", "num_hidden_layers")}
        arch = ModelArchConfig.from_hf_config({**base, "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1})
        if arch.qkv_bias or arch.o_proj_bias:
            raise ValueError("attention_bias=true is not supported for EAGLE-3 heads (the published ones have none)")
        draft_vocab = d.get("draft_vocab_size", arch.vocab_size)
        target_hidden = d.get("target_hidden_size") or arch.hidden_size
        for name, value in (("draft_vocab_size", draft_vocab), ("target_hidden_size", target_hidden)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if draft_vocab > arch.vocab_size:
            raise ValueError(f"draft_vocab_size ({draft_vocab}) exceeds vocab_size ({arch.vocab_size})")
        eagle = d.get("eagle_config") or {}
        layers = d.get("eagle_aux_hidden_state_layer_ids", eagle.get("eagle_aux_hidden_state_layer_ids"))
        if layers is not None:
            if (not isinstance(layers, list) or len(layers) != 3
                    or not all(isinstance(i, int) and not isinstance(i, bool) for i in layers)):
                raise ValueError(f"eagle_aux_hidden_state_layer_ids must be a list of three layer indices, "
                                 f"got {layers!r}")
            layers = tuple(layers)
        return cls(arch, draft_vocab, target_hidden, layers)

    def target_layers(self, target: ModelArchConfig) -> tuple[int, ...]:
        """The target layers whose entering hidden states this head reads; checks that the head fits the target."""
        problems = []
        if target.hidden_size != self.target_hidden_size:
            problems.append(f"it reads hidden states of size {self.target_hidden_size}, the target's are "
                            f"{target.hidden_size}")
        if target.vocab_size != self.arch.vocab_size:
            problems.append(f"its vocab_size is {self.arch.vocab_size}, the target's {target.vocab_size}")
        layers = self.feature_layers or default_feature_layers(target.num_hidden_layers)
        if any(not 0 <= i < target.num_hidden_layers for i in layers):
            problems.append(f"it reads layers {list(layers)}, the target has {target.num_hidden_layers}")
        if problems:
            raise ValueError("the EAGLE-3 head does not fit the target: " + "; ".join(problems))
        return layers


class Eagle3Head(nn.Module):
    """The head's modules (parameter names as the published checkpoints', the fused q/k/v and gate/up aside)."""

    def __init__(self, cfg: Eagle3Config, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        arch = cfg.arch
        self.config = cfg
        self.embed_tokens = nn.Embedding(arch.vocab_size, arch.hidden_size, dtype=dtype)
        self.fc = MergedLinear(3 * cfg.target_hidden_size, {"fc": arch.hidden_size}, bias=False, dtype=dtype)
        self.input_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.hidden_norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.self_attn = Attention(arch, dtype, input_size=2 * arch.hidden_size)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.mlp = MLP(arch, dtype)
        self.norm = RMSNorm(arch.hidden_size, arch.rms_norm_eps, dtype)
        self.lm_head = nn.Linear(arch.hidden_size, cfg.draft_vocab_size, bias=False, dtype=dtype)
        # the LM head's product: a packed one after ssd.models.weight_formats.pack_weights, as for a draft model
        self.head_matmul: LinearProduct = F.linear
        self.rotary = RotaryEmbedding(arch.head_dim, arch.rope_theta, arch.rope_scaling)
        self.register_buffer("draft_to_target", torch.arange(cfg.draft_vocab_size), persistent=False)  # [Vd]

    @property
    def num_layers(self) -> int:
        return 1

    @property
    def head_weight(self) -> torch.Tensor:
        return self.lm_head.weight

    def allocate_kv_caches(self, num_blocks: int, block_size: int, device: torch.device | str = "cpu") -> list[KVCache]:
        attn = self.self_attn
        shape = (num_blocks, block_size, attn.num_kv_heads, attn.head_dim)
        dtype = self.fc.weight.dtype
        return [KVCache(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))]

    def fuse(self, target_features: torch.Tensor) -> torch.Tensor:
        """The target's three hidden states ``[T, 3 Ht]`` as the head's features ``[T, H]``."""
        return self.fc(target_features)

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64, target ids
        features: torch.Tensor,  # [T, H]: fuse()d target features or the head's own outputs
        positions: torch.Tensor,  # [T] int64
        meta: AttentionMetadata,
        kv_caches: Sequence[KVCache],
    ) -> torch.Tensor:
        """One step over a flat batch; returns the head's features ``[T, H]`` (pre-norm: feed them to the next
        step, and to :meth:`compute_logits`)."""
        if len(kv_caches) != 1:
            raise ValueError(f"an EAGLE-3 head has one layer and takes one KV cache, got {len(kv_caches)}")
        embedded = self.embed_tokens(input_ids)  # [T, H]
        cos, sin = self.rotary.cos_sin(positions, embedded.dtype)  # [T, 1, D/2] each
        z = torch.cat([self.input_layernorm(embedded), self.hidden_norm(features)], dim=-1)  # [T, 2H]
        h = features + self.self_attn(z, cos, sin, kv_caches[0], meta)  # [T, H]
        return h + self.mlp(self.post_attention_layernorm(h))  # [T, H]

    def compute_logits(self, features: torch.Tensor) -> torch.Tensor:
        """Float32 logits over the draft vocabulary ``[N, Vd]`` (:attr:`draft_to_target` maps ids)."""
        return self.head_matmul(self.norm(features), self.head_weight, None).float()


def load_eagle3_head(
    folder: str | Path,
    target: ModelArchConfig,
    dtype: torch.dtype = torch.float32,
    target_embedding: torch.Tensor | None = None,
) -> tuple[Eagle3Head, tuple[int, ...]]:
    """The head stored in ``folder`` for ``target`` and the target layers it reads. A head without its own
    ``embed_tokens.weight`` takes ``target_embedding`` (``[V, Ht]``, the target's input embedding; shared, not
    copied, when it has the head's dtype). Raises ValueError, naming the file, when the head does not fit."""
    folder = Path(folder)
    config_path = folder / "config.json"
    try:
        cfg = Eagle3Config.from_hf_config(json.loads(config_path.read_text(encoding="utf-8")))
        layers = cfg.target_layers(target)
    except (OSError, json.JSONDecodeError, ValueError) as exc:
        raise ValueError(f"{config_path}: {exc}") from exc
    state = _read_weights(folder)
    head = Eagle3Head(cfg, dtype)
    head.requires_grad_(False)
    try:
        _load_state(head, state, target_embedding)
    except ValueError as exc:
        raise ValueError(f"EAGLE-3 head {folder}: {exc}") from exc
    return head.eval(), layers


def _read_weights(folder: Path) -> dict[str, torch.Tensor]:
    for name in WEIGHT_FILES:
        path = folder / name
        if path.is_file():
            if name.endswith(".safetensors"):
                from safetensors.torch import load_file

                return load_file(str(path))
            return torch.load(str(path), map_location="cpu", weights_only=True)
    raise ValueError(f"EAGLE-3 head {folder} has none of the weight files {list(WEIGHT_FILES)}")


_PLAIN = {  # checkpoint name -> parameter name, for tensors loaded as they are
    "fc.weight": "fc.weight",
    "midlayer.input_layernorm.weight": "input_layernorm.weight",
    "midlayer.hidden_norm.weight": "hidden_norm.weight",
    "midlayer.post_attention_layernorm.weight": "post_attention_layernorm.weight",
    "midlayer.self_attn.o_proj.weight": "self_attn.o_proj.weight",
    "midlayer.mlp.down_proj.weight": "mlp.down_proj.weight",
    "norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight",
}
_FUSED = {  # checkpoint name -> (fused parameter's module, shard)
    "midlayer.self_attn.q_proj.weight": ("self_attn.qkv_proj", "q"),
    "midlayer.self_attn.k_proj.weight": ("self_attn.qkv_proj", "k"),
    "midlayer.self_attn.v_proj.weight": ("self_attn.qkv_proj", "v"),
    "midlayer.mlp.gate_proj.weight": ("mlp.gate_up_proj", "gate"),
    "midlayer.mlp.up_proj.weight": ("mlp.gate_up_proj", "up"),
}
_MAPS = ("d2t", "t2d")
_OPTIONAL = ("embed_tokens.weight",)


def _load_state(head: Eagle3Head, state: dict[str, torch.Tensor], target_embedding: torch.Tensor | None) -> None:
    known = set(_PLAIN) | set(_FUSED) | set(_MAPS) | set(_OPTIONAL)
    missing = sorted((set(_PLAIN) | set(_FUSED) | set(_MAPS)) - set(state))
    unknown = sorted(set(state) - known)
    if missing or unknown:
        raise ValueError(f"missing tensors {missing}, unknown tensors {unknown}")
    params = dict(head.named_parameters())
    modules = dict(head.named_modules())

    def copy(name: str, dest: torch.Tensor, tensor: torch.Tensor) -> None:
        if tuple(tensor.shape) != tuple(dest.shape):
            raise ValueError(f"tensor {name} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
        dest.copy_(tensor)

    for name, param in _PLAIN.items():
        copy(name, params[param].data, state[name])
    for name, (module, shard) in _FUSED.items():
        merged = modules[module]
        copy(name, merged.weight.data[merged.shard_slice(shard)], state[name])
    if "embed_tokens.weight" in state:
        copy("embed_tokens.weight", head.embed_tokens.weight.data, state["embed_tokens.weight"])
    elif target_embedding is None:
        raise ValueError("the head has no embed_tokens.weight and no target embedding was given")
    elif target_embedding.dtype == head.embed_tokens.weight.dtype:
        if tuple(target_embedding.shape) != tuple(head.embed_tokens.weight.shape):
            raise ValueError(f"the target embedding has shape {tuple(target_embedding.shape)}, expected "
                             f"{tuple(head.embed_tokens.weight.shape)}")
        head.embed_tokens.weight = nn.Parameter(target_embedding, requires_grad=False)
    else:
        copy("the target embedding", head.embed_tokens.weight.data, target_embedding)
    head.draft_to_target = _draft_to_target(state["d2t"], state["t2d"], head.config)


def _draft_to_target(d2t: torch.Tensor, t2d: torch.Tensor, cfg: Eagle3Config) -> torch.Tensor:
    """Draft id -> target id ``[Vd]`` from the published offsets, checked against the ``t2d`` mask."""
    vocab, draft_vocab = cfg.arch.vocab_size, cfg.draft_vocab_size
    if tuple(d2t.shape) != (draft_vocab,) or d2t.dtype.is_floating_point or d2t.dtype == torch.bool:
        raise ValueError(f"d2t must be {draft_vocab} integer offsets, got {d2t.dtype} {tuple(d2t.shape)}")
    if tuple(t2d.shape) != (vocab,):
        raise ValueError(f"t2d must be a mask over the {vocab} target ids, got shape {tuple(t2d.shape)}")
    ids = torch.arange(draft_vocab) + d2t.long()  # [Vd]
    if ids.min() < 0 or ids.max() >= vocab or torch.unique(ids).numel() != draft_vocab:
        raise ValueError(f"d2t must map the draft ids to distinct target ids in [0, {vocab})")
    mask = torch.zeros(vocab, dtype=torch.bool)
    mask[ids] = True
    if not torch.equal(mask, t2d.bool()):
        raise ValueError("t2d does not mark exactly the target ids that d2t maps to")
    return ids
