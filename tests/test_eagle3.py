"""EAGLE-3 heads: the target's features against transformers, the head's forward against a reference written
from the published description, and loading (the published layout, refusals that name what does not fit)."""

from __future__ import annotations

import json
import math

import pytest
import torch
import transformers
from eagle3_utils import HEAD_SHAPE, make_eagle3_head
from model_utils import PagedSession

from ssd.models import cpu_fused
from ssd.models.attention_layout import (
    SequenceLayout,
    block_slots,
    build_attention_metadata,
)
from ssd.models.eagle3 import Eagle3Config, default_feature_layers, load_eagle3_head
from ssd.models.loader import load_model

VOCAB, TARGET_HIDDEN, TARGET_LAYERS = 512, 64, 8
TARGET = dict(arch="llama", num_layers=TARGET_LAYERS)


@pytest.fixture(scope="module")
def target(checkpoint_factory):
    path = checkpoint_factory(**TARGET)
    model, cfg = load_model(path, dtype=torch.float32)
    return path, model, cfg


def _prompt(length: int, seed: int) -> list[int]:
    return torch.randint(3, VOCAB, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def _target_features(model, tokens: list[int], layers) -> tuple[torch.Tensor, torch.Tensor]:
    session = PagedSession(model, num_blocks=16, block_size=4)
    table = session._reserve(0, len(tokens))
    meta = build_attention_metadata([SequenceLayout(block_slots(table, 4, 0, len(tokens)),
                                                    block_slots(table, 4, 0, len(tokens)))])
    with torch.no_grad():
        return model.forward_features(torch.tensor(tokens), torch.arange(len(tokens)), meta, session.caches, layers)


# ---------------------------------------------------------------------------------------------- target side
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("fused", [False, True])
def test_target_features_are_transformers_hidden_states(checkpoint_factory, arch, fused):
    if fused and not cpu_fused.usable("cpu", torch.float32):
        pytest.skip("the CPU fused kernels did not build")
    path = checkpoint_factory(arch=arch, num_layers=TARGET_LAYERS)
    model, _ = load_model(path, dtype=torch.float32)
    if fused:
        model.enable_fused_kernels(kernels=cpu_fused)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokens = _prompt(11, seed=3)
    layers = default_feature_layers(TARGET_LAYERS)
    hidden, features = _target_features(model, tokens, layers)
    with torch.no_grad():
        states = hf(torch.tensor([tokens]), output_hidden_states=True).hidden_states
    expected = torch.cat([states[i][0] for i in layers], dim=-1)  # [T, 3 H]
    assert features.shape == (len(tokens), 3 * model.config.hidden_size)
    torch.testing.assert_close(features, expected, rtol=1e-5, atol=1e-5)
    # the same pass: the final hidden states are forward()'s, bit for bit
    session = PagedSession(model, num_blocks=16, block_size=4)
    reference = session.step({0: tokens})[0]
    torch.testing.assert_close(model.compute_logits(hidden), reference, rtol=0, atol=0)


def test_feature_layers_are_checked(target):
    _, model, _ = target
    with pytest.raises(ValueError, match=r"feature layers must be layer indices in \[0, 8\)"):
        _target_features(model, [5, 6], (2, 8))


# ---------------------------------------------------------------------------------------------- the head
def _rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:  # x [T, heads, d]
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    angles = positions[:, None].float() * inv[None, :]  # [T, d/2]
    cos, sin = torch.cat([angles.cos()] * 2, -1)[:, None], torch.cat([angles.sin()] * 2, -1)[:, None]
    rotated = torch.cat([-x[..., d // 2:], x[..., : d // 2]], dim=-1)
    return x * cos + rotated * sin


def _reference_rows(w: dict, embed: torch.Tensor, tokens: list[int], target_features: torch.Tensor,
                    num_own: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The published head over one sequence, written plainly: rows 0..n-1 take fc(target features), the last
    ``num_own`` rows take the previous row's output. Returns (outputs [T, H], draft logits [T, Vd])."""
    heads, kv_heads = HEAD_SHAPE["num_attention_heads"], HEAD_SHAPE["num_key_value_heads"]
    d = w["midlayer.self_attn.q_proj.weight"].shape[0] // heads
    g_target = target_features @ w["fc.weight"].T  # [n, H]
    outputs: list[torch.Tensor] = []
    feats: list[torch.Tensor] = []
    for row in range(len(tokens)):  # re-run causally with one more row each time: no cache to get wrong
        feats.append(g_target[row] if row < len(g_target) else outputs[-1])
        g = torch.stack(feats)  # [r+1, H]
        z = torch.cat([_rms(embed[tokens[: row + 1]], w["midlayer.input_layernorm.weight"]),
                       _rms(g, w["midlayer.hidden_norm.weight"])], dim=-1)  # [r+1, 2H]
        pos = torch.arange(row + 1)
        q = _rope((z @ w["midlayer.self_attn.q_proj.weight"].T).view(row + 1, heads, d), pos, 10000.0)
        k = _rope((z @ w["midlayer.self_attn.k_proj.weight"].T).view(row + 1, kv_heads, d), pos, 10000.0)
        v = (z @ w["midlayer.self_attn.v_proj.weight"].T).view(row + 1, kv_heads, d)
        k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
        scores = torch.einsum("hd,khd->hk", q[-1], k) / math.sqrt(d)  # the last row sees every row
        attn = torch.einsum("hk,khd->hd", scores.softmax(-1), v).reshape(-1)
        h = g[-1] + attn @ w["midlayer.self_attn.o_proj.weight"].T
        x = _rms(h, w["midlayer.post_attention_layernorm.weight"])
        gate, up = x @ w["midlayer.mlp.gate_proj.weight"].T, x @ w["midlayer.mlp.up_proj.weight"].T
        mlp = torch.nn.functional.silu(gate) * up
        outputs.append(h + mlp @ w["midlayer.mlp.down_proj.weight"].T)
    out = torch.stack(outputs)
    return out, _rms(out, w["norm.weight"]) @ w["lm_head.weight"].T


class HeadSession:
    """The head over one sequence with a paged cache (shuffled blocks, as the engine hands them out)."""

    def __init__(self, head, block_size: int = 4) -> None:
        self.head, self.block_size = head, block_size
        self.caches = head.allocate_kv_caches(16, block_size)
        self.table = [9, 2, 14, 5, 11, 0]
        self.length = 0

    def step(self, tokens: list[int], features: torch.Tensor) -> torch.Tensor:
        start, end = self.length, self.length + len(tokens)
        meta = build_attention_metadata([SequenceLayout(block_slots(self.table, self.block_size, start, end),
                                                        block_slots(self.table, self.block_size, 0, end))])
        self.length = end
        with torch.no_grad():
            return self.head(torch.tensor(tokens), features, torch.arange(start, end), meta, self.caches)


@pytest.mark.parametrize("own_embedding", [False, True])
def test_head_matches_the_published_description(target, tmp_path, own_embedding):
    _, model, cfg = target
    hidden = HEAD_SHAPE["hidden_size"] if own_embedding else TARGET_HIDDEN  # else it shares the target's
    folder = make_eagle3_head(tmp_path / "head", vocab_size=VOCAB, target_hidden_size=TARGET_HIDDEN,
                              own_embedding=own_embedding, seed=4, hidden_size=hidden)
    head, layers = load_eagle3_head(folder, cfg, target_embedding=model.embed_tokens.weight)
    assert layers == default_feature_layers(TARGET_LAYERS)
    from safetensors.torch import load_file

    w = load_file(str(folder / "model.safetensors"))
    embed = w["embed_tokens.weight"] if own_embedding else model.embed_tokens.weight
    shared = head.embed_tokens.weight.data_ptr() == model.embed_tokens.weight.data_ptr()
    assert shared != own_embedding  # the target's embedding is shared, not copied

    prompt = _prompt(9, seed=5)
    _, features = _target_features(model, prompt, layers)  # [9, 3 Ht]
    bonus, draft = 17, 301
    head_tokens = prompt[1:] + [bonus, draft]  # row p takes the token at p + 1
    ref_out, ref_logits = _reference_rows(w, embed, head_tokens, features, num_own=1)

    session = HeadSession(head)
    out = session.step(head_tokens[:8], head.fuse(features[:8]))  # the prompt's rows
    out = torch.cat([out, session.step([bonus], head.fuse(features[8:9]))])  # the target's last position
    out = torch.cat([out, session.step([draft], out[-1:])])  # drafting past it: the head's own feature
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(head.compute_logits(out), ref_logits, rtol=1e-4, atol=1e-4)
    expected_ids = torch.arange(100) + w["d2t"]
    assert torch.equal(head.draft_to_target, expected_ids) and bool(w["t2d"][expected_ids].all())


def test_bin_and_safetensors_layouts_load_alike(target, tmp_path):
    _, model, cfg = target
    shape = dict(vocab_size=VOCAB, target_hidden_size=TARGET_HIDDEN, hidden_size=TARGET_HIDDEN, seed=6)
    a = make_eagle3_head(tmp_path / "a", **shape)
    b = make_eagle3_head(tmp_path / "b", **shape, file_format="bin", feature_layers=[1, 3, 6])
    head_a, _ = load_eagle3_head(a, cfg, target_embedding=model.embed_tokens.weight)
    head_b, layers = load_eagle3_head(b, cfg, target_embedding=model.embed_tokens.weight)
    assert layers == (1, 3, 6)
    for (name, pa), (_, pb) in zip(head_a.state_dict().items(), head_b.state_dict().items()):
        assert torch.equal(pa, pb), name


def _write_config(folder, **changes) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(target_hidden_size=48), "reads hidden states of size 48, the target's are 64"),
        (dict(vocab_size=600), "vocab_size is 600, the target's 512"),
        (dict(eagle_aux_hidden_state_layer_ids=[2, 4, 8]), r"reads layers \[2, 4, 8\], the target has 8"),
        (dict(eagle_aux_hidden_state_layer_ids=[2, 4]), "a list of three layer indices"),
        (dict(architectures=["LlamaForCausalLM"]), "not an EAGLE-3 head"),
        (dict(draft_vocab_size=1000), r"draft_vocab_size \(1000\) exceeds vocab_size"),
        (dict(attention_bias=True), "attention_bias=true is not supported"),
    ],
)
def test_config_that_does_not_fit_the_target_is_refused(target, tmp_path, change, match):
    _, model, cfg = target
    folder = make_eagle3_head(tmp_path / "head", vocab_size=VOCAB, target_hidden_size=TARGET_HIDDEN, own_embedding=True)
    _write_config(folder, **change)
    with pytest.raises(ValueError, match=match) as info:
        load_eagle3_head(folder, cfg, target_embedding=model.embed_tokens.weight)
    assert "config.json" in str(info.value)


def _rewrite_weights(folder, edit) -> None:
    from safetensors.torch import load_file, save_file

    state = load_file(str(folder / "model.safetensors"))
    edit(state)
    save_file(state, str(folder / "model.safetensors"))


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda s: s.pop("midlayer.hidden_norm.weight"), r"missing tensors \['midlayer.hidden_norm.weight'\]"),
        (lambda s: s.update(extra=torch.zeros(2)), r"unknown tensors \['extra'\]"),
        (lambda s: s.update({"fc.weight": torch.zeros(32, 64)}),
         r"fc.weight has shape \(32, 64\), expected \(32, 192\)"),
        (lambda s: s.update(d2t=s["d2t"] + VOCAB), "distinct target ids"),
        (lambda s: s.update(t2d=torch.ones(VOCAB, dtype=torch.bool)), "t2d does not mark exactly"),
    ],
)
def test_weights_that_do_not_fit_are_refused(target, tmp_path, edit, match):
    _, model, cfg = target
    folder = make_eagle3_head(tmp_path / "head", vocab_size=VOCAB, target_hidden_size=TARGET_HIDDEN, own_embedding=True)
    _rewrite_weights(folder, edit)
    with pytest.raises(ValueError, match=match):
        load_eagle3_head(folder, cfg, target_embedding=model.embed_tokens.weight)


def test_a_head_without_embedding_needs_the_targets(target, tmp_path):
    _, _, cfg = target
    folder = make_eagle3_head(tmp_path / "head", vocab_size=VOCAB, target_hidden_size=TARGET_HIDDEN)
    with pytest.raises(ValueError, match="no embed_tokens.weight and no target embedding"):
        load_eagle3_head(folder, cfg)
    with pytest.raises(ValueError, match=r"the target embedding has shape \(512, 64\), expected \(512, 32\)"):
        load_eagle3_head(folder, cfg, target_embedding=torch.zeros(VOCAB, TARGET_HIDDEN))


def test_default_feature_layers_follow_the_published_choice():
    assert default_feature_layers(32) == (2, 16, 29)
    cfg = Eagle3Config.from_hf_config({"architectures": ["LlamaForCausalLMEagle3"], "vocab_size": 10,
                                       "hidden_size": 8, "intermediate_size": 16, "num_attention_heads": 2,
                                       "draft_vocab_size": 4, "eagle_config": {}})
    assert cfg.feature_layers is None and cfg.target_hidden_size == 8 and cfg.draft_vocab_size == 4
