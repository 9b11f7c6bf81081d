"""Random EAGLE-3 heads written in the published checkpoint layout (see ``ssd/models/eagle3.py``), and the models
and speculative configs of every mode for tests of a sampling option across modes (``make_mode_models``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from ssd_utils import make_perturbed_draft

VOCAB = 512  # the test targets' vocabulary (tests/checkpoints.py)
LAYERS = [0, 1, 1]  # the test targets have two layers; published heads read (2, L // 2, L - 3)
HEAD_SHAPE = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2)


def make_eagle3_head(
    path: Path,
    *,
    vocab_size: int,
    target_hidden_size: int,
    draft_vocab_size: int = 100,
    seed: int = 0,
    own_embedding: bool = False,
    feature_layers: list[int] | None = None,
    file_format: str = "safetensors",
    hidden_size: int = HEAD_SHAPE["hidden_size"],
    **config_overrides,
) -> Path:
    """Write a random head (config.json and weights) into ``path``; returns ``path``. Without its own embedding
    a head shares the target's, so its ``hidden_size`` must be the target's."""
    gen = torch.Generator().manual_seed(seed)
    h, inter = hidden_size, HEAD_SHAPE["intermediate_size"]
    d = h // HEAD_SHAPE["num_attention_heads"]
    q, kv = HEAD_SHAPE["num_attention_heads"] * d, HEAD_SHAPE["num_key_value_heads"] * d

    def rand(*shape: int, std: float = 0.2) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    ids = torch.sort(torch.randperm(vocab_size, generator=gen)[:draft_vocab_size]).values  # [Vd] target ids
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[ids] = True
    state = {
        "fc.weight": rand(h, 3 * target_hidden_size, std=0.1),
        "midlayer.input_layernorm.weight": 1 + rand(h, std=0.1),
        "midlayer.hidden_norm.weight": 1 + rand(h, std=0.1),
        "midlayer.post_attention_layernorm.weight": 1 + rand(h, std=0.1),
        "midlayer.self_attn.q_proj.weight": rand(q, 2 * h),
        "midlayer.self_attn.k_proj.weight": rand(kv, 2 * h),
        "midlayer.self_attn.v_proj.weight": rand(kv, 2 * h),
        "midlayer.self_attn.o_proj.weight": rand(h, q),
        "midlayer.mlp.gate_proj.weight": rand(inter, h),
        "midlayer.mlp.up_proj.weight": rand(inter, h),
        "midlayer.mlp.down_proj.weight": rand(h, inter),
        "norm.weight": 1 + rand(h, std=0.1),
        "lm_head.weight": rand(draft_vocab_size, h),
        "d2t": ids - torch.arange(draft_vocab_size),
        "t2d": t2d,
    }
    if own_embedding:
        state["embed_tokens.weight"] = rand(vocab_size, h)
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", **HEAD_SHAPE, "hidden_size": h,
        "num_hidden_layers": 1, "vocab_size": vocab_size, "draft_vocab_size": draft_vocab_size,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 2048, "hidden_act": "silu",
        "tie_word_embeddings": False,
    }
    if target_hidden_size != h:
        config["target_hidden_size"] = target_hidden_size
    if feature_layers is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": feature_layers}
    config.update(config_overrides)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config), encoding="utf-8")
    if file_format == "safetensors":
        from safetensors.torch import save_file

        save_file({k: v.contiguous() for k, v in state.items()}, str(path / "model.safetensors"))
    else:
        torch.save(state, path / "pytorch_model.bin")
    return path


def _zero_lm_head(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    tensors["lm_head.weight"] = torch.zeros_like(tensors["lm_head.weight"])
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def make_test_pairs(checkpoint_factory, root: Path) -> dict[str, str]:
    """Two targets and heads for exactness tests: a random head on a random target (almost every draft rejected),
    and on a target whose LM head is zero (it always emits token 0) a head that always proposes 0 (every draft
    accepted)."""
    target = checkpoint_factory(arch="llama")
    hidden = 64  # the test targets' hidden size
    random_head = make_eagle3_head(root / "random_head", vocab_size=VOCAB, target_hidden_size=hidden,
                                   hidden_size=hidden, feature_layers=LAYERS, seed=3)
    constant = _zero_lm_head(Path(target), root / "constant_target")
    agreeing_head = make_eagle3_head(root / "agreeing_head", vocab_size=VOCAB, target_hidden_size=hidden,
                                     hidden_size=hidden, feature_layers=LAYERS, seed=4)
    state = load_file(agreeing_head / "model.safetensors")
    state["lm_head.weight"] = torch.zeros_like(state["lm_head.weight"])  # ties: the lowest target id, 0
    ids = torch.arange(100)  # draft ids 0..99 are target ids 0..99
    state["d2t"], state["t2d"] = ids - ids, torch.arange(VOCAB) < 100
    save_file(state, agreeing_head / "model.safetensors")
    return {"target": str(target), "random_head": str(random_head), "constant": str(constant),
            "agreeing_head": str(agreeing_head)}


SPEC_MODES = {
    "draft_model": lambda draft, head: {"method": "draft_model", "model": draft},
    "ssd": lambda draft, head: {"method": "ssd", "model": draft, "fallback": "jit"},
    "ngram": lambda draft, head: {"method": "ngram"},
    "eagle3": lambda draft, head: {"method": "eagle3", "model": head},
    "ssd-eagle3": lambda draft, head: {"method": "ssd", "model": head, "fallback": "jit"},
}
"""Every speculative mode's speculative_config, given a draft model and an EAGLE-3 head (see make_mode_models)."""


def make_mode_models(checkpoint_factory, root: Path) -> tuple[str, str, str]:
    """(target, draft, head) for tests of a sampling option in every mode (SPEC_MODES): the default test target,
    a draft that is its perturbed copy (partial acceptance) and a random EAGLE-3 head."""
    target = checkpoint_factory()
    draft = make_perturbed_draft(target, root / "draft", sigma=0.3)
    head = make_eagle3_head(root / "head", vocab_size=VOCAB, target_hidden_size=64, hidden_size=64,
                            feature_layers=LAYERS, seed=3)
    return str(target), str(draft), str(head)


def self_draft_stats(target: str, prompts: list, params, method: str, engine: dict):
    """The target as its own draft (``method`` draft_model or ssd; K = 4 fixed, no prompt lookup, so every draft is
    the draft model's): asserts its outputs equal AR's and returns the engine's speculative counters."""
    from ssd import LLM

    spec = {"method": method, "model": target, "num_speculative_tokens": 4, "adaptive_lookahead": False,
            "prompt_lookup": False}
    with LLM(target, **engine) as ar:
        expected = [o.token_ids for o in ar.generate(prompts, params)]
    with LLM(target, **engine, speculative_config=spec) as llm:
        assert [o.token_ids for o in llm.generate(prompts, params)] == expected
        return llm.stats
