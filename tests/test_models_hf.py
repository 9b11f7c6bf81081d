"""Our DecoderLM + loader against Hugging Face ``transformers`` on tiny random checkpoints."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
import transformers
from checkpoints import make_checkpoint
from model_utils import PagedSession, greedy_generate

from ssd.models.arch import ModelArchConfig, RopeScaling
from ssd.models.decoder import DecoderLM
from ssd.models.loader import load_model
from ssd.models.registry import get_model_class, supported_architectures
from ssd.models.rope import rope_inv_freq

LLAMA3_ROPE = dict(
    rope_type="llama3", factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64
)
CASES = {
    "llama": dict(arch="llama"),
    "llama_tied": dict(arch="llama", tie_word_embeddings=True),
    "llama3_rope": dict(arch="llama", rope_scaling=LLAMA3_ROPE),
    "llama_attn_bias": dict(arch="llama", attention_bias=True),
    "qwen2": dict(arch="qwen2"),
    "qwen3": dict(arch="qwen3"),
    "mistral": dict(arch="mistral", seed=1),
}
FP32_RTOL = 1e-5  # max |ours - hf| relative to the logits' max magnitude; observed 0 on CPU


def _prompt(length: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, 512, (length,), generator=gen).tolist()


def _assert_close(ours: torch.Tensor, ref: torch.Tensor, rtol: float = FP32_RTOL) -> None:
    assert ours.shape == ref.shape and ours.dtype == torch.float32
    bound = rtol * max(1.0, ref.abs().max().item())
    err = (ours - ref).abs().max().item()
    assert err <= bound, f"max abs error {err} > {bound}"


@pytest.fixture(scope="module")
def models(checkpoint_factory):
    """case -> (checkpoint path, HF model fp32, our model fp32), built lazily and shared by the module."""

    @functools.cache
    def get(case: str) -> tuple[Path, torch.nn.Module, DecoderLM]:
        path = checkpoint_factory(**CASES[case])
        hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        ours, _ = load_model(path, dtype=torch.float32)
        return path, hf, ours

    return get


@torch.no_grad()
def _hf_logits(hf: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    return hf(torch.tensor([ids])).logits[0].float()  # [T, V]


@pytest.mark.parametrize("case", list(CASES))
def test_prefill_then_decode_match_hf(models, case):
    _, hf, ours = models(case)
    prompt = _prompt(13, seed=1)
    session = PagedSession(ours, num_blocks=16, block_size=4)
    _assert_close(session.step({0: prompt})[0], _hf_logits(hf, prompt))
    assert len(session.block_tables[0]) == 4
    assert session.block_tables[0] != sorted(session.block_tables[0])  # really non-contiguous

    ids = list(prompt)
    gen = torch.Generator().manual_seed(2)
    for _ in range(6):  # random (not greedy) tokens: decode must match for any history
        token = int(torch.randint(3, 512, (1,), generator=gen))
        ids.append(token)
        logits = session.step({0: [token]})[0]  # [1, V]
        _assert_close(logits, _hf_logits(hf, ids)[-1:])


@pytest.mark.parametrize("case", ["llama", "qwen3"])
def test_batched_flat_forward_equals_each_alone(models, case):
    _, _, ours = models(case)
    prompts = {0: _prompt(5, seed=3), 1: _prompt(11, seed=4), 2: _prompt(8, seed=5)}
    # Step 2 mixes a decode, a 3-token chunk and another decode in one flat batch.
    step2 = {0: [7], 1: [8, 9, 10], 2: [11]}

    batched = PagedSession(ours, num_blocks=32, block_size=4, seed=1)
    out1 = batched.step(prompts)
    out2 = batched.step(step2)
    for seq_id, prompt in prompts.items():
        alone = PagedSession(ours, num_blocks=8, block_size=4, seed=2)
        _assert_close(out1[seq_id], alone.step({0: prompt})[0])
        _assert_close(out2[seq_id], alone.step({0: step2[seq_id]})[0])


def test_chunked_prefill_equals_full_prefill(models):
    _, hf, ours = models("qwen2")
    prompt = _prompt(14, seed=6)
    session = PagedSession(ours, num_blocks=8, block_size=4)
    chunks = [session.step({0: prompt[:5]})[0], session.step({0: prompt[5:6]})[0], session.step({0: prompt[6:]})[0]]
    _assert_close(torch.cat(chunks), _hf_logits(hf, prompt))


@pytest.mark.parametrize("case", ["llama", "llama_tied", "qwen2", "qwen3"])
def test_bf16_matches_hf_bf16(models, case):
    path, _, ours32 = models(case)
    ours16, _ = load_model(path, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in ours16.parameters())
    assert ours16.rotary.inv_freq.dtype == torch.float32
    assert torch.equal(ours16.rotary.inv_freq, ours32.rotary.inv_freq)
    hf16 = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()

    prompt = _prompt(13, seed=7)
    ref32 = PagedSession(ours32).step({0: prompt})[0]
    logits = PagedSession(ours16).step({0: prompt})[0]
    hf_logits = _hf_logits(hf16, prompt)
    scale = ref32.abs().max().item()
    hf_err = (hf_logits - ref32).abs().max().item()
    assert (logits - ref32).abs().max().item() <= 1.5 * hf_err + 0.01 * scale  # no worse than HF's own bf16
    _assert_close(logits, hf_logits, rtol=0.05)


@pytest.mark.parametrize("case", ["llama", "llama_tied", "llama3_rope", "qwen2", "qwen3"])
def test_greedy_64_tokens_equal_hf_generate(models, case):
    _, hf, ours = models(case)
    prompt = _prompt(9, seed=8)
    hf.generation_config.eos_token_id = None  # run the full length: no stop token
    with torch.no_grad():
        ids = torch.tensor([prompt])  # [1, P]
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=64)  # [1, P+64]
    ref = out[0, len(prompt) :].tolist()
    assert len(ref) == 64
    assert len(set(ref)) >= 5  # a meaningful comparison, not a constant stream
    assert greedy_generate(ours, prompt, 64) == ref


def test_llama3_inv_freq_matches_hf(models):
    _, hf, ours = models("llama3_rope")
    plain = rope_inv_freq(16, 10000.0, None)
    assert torch.equal(ours.rotary.inv_freq, hf.model.rotary_emb.inv_freq)
    assert not torch.equal(ours.rotary.inv_freq, plain)  # scaling changed something...
    assert torch.equal(ours.rotary.inv_freq[:1], plain[:1])  # high frequency kept (wavelength < 64/4)
    assert torch.equal(ours.rotary.inv_freq[-1:], plain[-1:] / 4.0)  # low frequency divided by factor


def test_sharded_checkpoint_loads_identically(models, tmp_path):
    path, hf, ours = models("llama")
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    sharded, _ = load_model(tmp_path, dtype=torch.float32)
    for (name, a), (_, b) in zip(ours.state_dict().items(), sharded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_make_checkpoint_is_deterministic(tmp_path):
    a = make_checkpoint(tmp_path / "a", "qwen3", seed=3)
    b = make_checkpoint(tmp_path / "b", "qwen3", seed=3)
    c = make_checkpoint(tmp_path / "c", "qwen3", seed=4)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    tok = transformers.AutoTokenizer.from_pretrained(a)
    config = json.loads((a / "config.json").read_text())
    assert len(tok) <= config["vocab_size"]
    assert config["eos_token_id"] == tok.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(tok("The quick brown fox.").input_ids) == "The quick brown fox."


def test_kv_cache_shape_and_allocation(models):
    _, _, ours = models("qwen3")
    assert (ours.num_layers, ours.num_kv_heads, ours.head_dim) == (2, 2, 32)
    assert ours.kv_cache_shape(10, 4) == (10, 4, 2, 32)
    caches = ours.allocate_kv_caches(10, 4)
    assert len(caches) == 2 and caches[0].key.shape == (10, 4, 2, 32) and caches[0].value.dtype == torch.float32


# ---------------------------------------------------------------------------------------------- loader errors


def _copy_checkpoint(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_unknown_architecture_is_rejected(checkpoint_factory, tmp_path):
    path = _copy_checkpoint(checkpoint_factory("llama"), tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"unsupported architecture 'GPT2LMHeadModel'; supported: .*LlamaForCausalLM"):
        load_model(path)


def test_missing_tensor_is_reported_by_name(checkpoint_factory, tmp_path):
    from safetensors.torch import load_file, save_file

    path = _copy_checkpoint(checkpoint_factory("qwen2"), tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.bias"]
    del tensors["model.layers.0.mlp.up_proj.weight"]
    tensors["model.layers.0.mlp.extra.weight"] = torch.zeros(2)
    save_file(tensors, path / "model.safetensors")
    with pytest.raises(ValueError) as info:
        load_model(path)
    msg = str(info.value)
    assert "missing 2 tensor(s): model.layers.0.mlp.up_proj.weight, model.layers.1.self_attn.k_proj.bias" in msg
    assert "unexpected 1 tensor(s): model.layers.0.mlp.extra.weight" in msg


def test_shape_mismatch_is_reported(checkpoint_factory, tmp_path):
    path = _copy_checkpoint(checkpoint_factory("llama"), tmp_path / "m")
    config = json.loads((path / "config.json").read_text())
    config["intermediate_size"] = 96
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"mlp.down_proj.weight in .* has shape \(64, 128\), expected \(64, 96\)"):
        load_model(path)


def test_missing_folder_and_config(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"model folder .*nowhere does not exist"):
        load_model(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"has no config.json"):
        load_model(tmp_path / "empty")


def test_corrupt_config_json(checkpoint_factory, tmp_path):
    path = _copy_checkpoint(checkpoint_factory("llama"), tmp_path / "m")
    (path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"], ')
    with pytest.raises(ValueError, match=r"config.json is not valid JSON"):
        load_model(path)


def test_missing_weights_file(checkpoint_factory, tmp_path):
    path = _copy_checkpoint(checkpoint_factory("llama"), tmp_path / "m")
    (path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"has no \*.safetensors weights"):
        load_model(path)


def test_tied_checkpoint_ignores_stray_lm_head(checkpoint_factory, tmp_path):
    from safetensors.torch import load_file, save_file

    path = _copy_checkpoint(checkpoint_factory("llama", tie_word_embeddings=True), tmp_path / "m")
    tensors = load_file(path / "model.safetensors")
    assert "lm_head.weight" not in tensors
    embed = tensors["model.embed_tokens.weight"]
    ours, cfg = load_model(path, dtype=torch.float32)
    assert cfg.tie_word_embeddings and ours.lm_head is None
    # Some tied checkpoints store the shared matrix only as lm_head.weight.
    tensors["lm_head.weight"] = tensors.pop("model.embed_tokens.weight")
    save_file(tensors, path / "model.safetensors")
    ours2, _ = load_model(path, dtype=torch.float32)
    assert torch.equal(ours2.embed_tokens.weight, embed)


# ---------------------------------------------------------------------------------------------- config parsing

BASE = dict(
    architectures=["LlamaForCausalLM"],
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def test_config_legacy_layout():
    cfg = ModelArchConfig.from_hf_config(
        {
            **BASE,
            "rope_theta": 500000.0,
            "rope_scaling": {**LLAMA3_ROPE, "original_max_position_embeddings": 8192, "factor": 8.0},
            "torch_dtype": "bfloat16",
            "eos_token_id": [128001, 128008, 128009],
            "bos_token_id": 128000,
            "max_position_embeddings": 131072,
            "tie_word_embeddings": True,
        }
    )
    assert cfg.rope_theta == 500000.0
    assert cfg.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 8192)
    assert cfg.torch_dtype == "bfloat16" and cfg.eos_token_id == [128001, 128008, 128009]
    assert (cfg.bos_token_id, cfg.head_dim, cfg.tie_word_embeddings) == (128000, 16, True)
    assert (cfg.qkv_bias, cfg.o_proj_bias, cfg.qk_norm) == (False, False, False)


def test_config_transformers5_layout():
    cfg = ModelArchConfig.from_hf_config(
        {
            **BASE,
            "architectures": ["Qwen3ForCausalLM"],
            "head_dim": 128,
            "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
            "dtype": "bfloat16",
            "eos_token_id": 5,
        }
    )
    assert (cfg.head_dim, cfg.rope_theta, cfg.rope_scaling) == (128, 1000000.0, None)
    assert (cfg.qk_norm, cfg.eos_token_id, cfg.torch_dtype) == (True, [5], "bfloat16")
    assert cfg.max_position_embeddings == 32768  # the Qwen default when the key is absent
    scaled = ModelArchConfig.from_hf_config({**BASE, "rope_parameters": {**LLAMA3_ROPE, "rope_theta": 5e5}})
    assert scaled.rope_scaling == RopeScaling(4.0, 1.0, 4.0, 64) and scaled.rope_theta == 5e5
    qwen2 = ModelArchConfig.from_hf_config({**BASE, "architectures": ["Qwen2ForCausalLM"]})
    assert (qwen2.qkv_bias, qwen2.o_proj_bias) == (True, False)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"architectures": ["BertModel"]}, r"unsupported architecture 'BertModel'; supported: LlamaForCausalLM"),
        ({"architectures": None}, r"no 'architectures' field"),
        ({"hidden_size": None}, r"missing required field 'hidden_size'"),
        ({"num_hidden_layers": 0}, r"'num_hidden_layers' must be a positive integer, got 0"),
        ({"num_key_value_heads": 3}, r"multiple of num_key_value_heads \(3\)"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, r"rope_type 'yarn'; supported: default, llama3"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, r"positive number for 'low_freq_factor'"),
        ({"hidden_act": "gelu"}, r"unsupported hidden_act 'gelu'"),
        ({"eos_token_id": "</s>"}, r"'eos_token_id' must be an integer or a list"),
        ({"architectures": ["MistralForCausalLM"], "sliding_window": 4096}, r"sliding_window=4096 is not supported"),
    ],
)
def test_config_errors(change, message):
    with pytest.raises(ValueError, match=message):
        ModelArchConfig.from_hf_config({**BASE, **change})


def test_registry():
    assert get_model_class("Qwen3ForCausalLM") is DecoderLM
    assert "Qwen2ForCausalLM" in supported_architectures()
    with pytest.raises(ValueError, match=r"unsupported architecture 'Foo'; supported: LlamaForCausalLM"):
        get_model_class("Foo")
