"""Import a GGUF file (llama.cpp's format) into a Hugging Face-style checkpoint folder.

Our loader reads HF folders (config.json, model.safetensors, tokenizer.json), so a GGUF file is converted
once instead of teaching every component a second format. The import is exact up to dequantization: each
quantized tensor is expanded to float32 with gguf's reference dequantizer and then cast to the chosen dtype,
and the layout changes llama.cpp's converter made (q/k row permutation for Llama's RoPE) are undone so the
weights follow the HF rotate-half convention.

Supported: architectures llama, qwen2, qwen3; tokenizer model "gpt2" (byte-level BPE) with the
pre-tokenizers listed in `_PRE_TOKENIZERS`; every tensor type gguf's dequantizer handles.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

logger = logging.getLogger(__name__)

IMPORT_RECORD_NAME = "gguf_import.json"
"""Written last into the folder; its presence (with the source hash) marks a complete import."""

IMPORT_FORMAT_VERSION = 1
"""Bumped whenever the converter's output changes, so cached folders from older versions are redone."""

_DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_SAFETENSORS_DTYPE = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}

# GGUF token types (llama.cpp's llama_token_type).
_TOKEN_NORMAL = 1
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4


# --------------------------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ImportRecord:
    """What a folder was converted from; fetch uses it to decide whether a cached folder can be reused."""

    format_version: int
    source_file: str
    source_sha256: str
    architecture: str
    dtype: str
    num_tensors: int
    tensor_types: dict[str, int]

    @classmethod
    def read(cls, folder: str | Path) -> ImportRecord | None:
        """The record of a completed import, or None when the folder is missing, partial or foreign."""
        path = Path(folder) / IMPORT_RECORD_NAME
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            return cls(**{name: data[name] for name in cls.__dataclass_fields__})
        except (OSError, ValueError, KeyError, TypeError):
            return None


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """Accept a torch dtype or its name; only the dtypes HF checkpoints use are allowed."""
    if isinstance(dtype, torch.dtype):
        if dtype in _SAFETENSORS_DTYPE:
            return dtype
    elif isinstance(dtype, str) and dtype.removeprefix("torch.") in _DTYPES:
        return _DTYPES[dtype.removeprefix("torch.")]
    raise ValueError(f"unsupported dtype {dtype!r}; allowed: {sorted(_DTYPES)}")


def convert_gguf(
    gguf_path: str | Path,
    out_dir: str | Path,
    dtype: torch.dtype | str = torch.bfloat16,
    *,
    overwrite: bool = False,
    source_sha256: str | None = None,
) -> Path:
    """Convert a GGUF file into an HF checkpoint folder at `out_dir` and return its path.

    Tensors are dequantized and written one at a time, so peak memory is about one float32 tensor. The folder
    is assembled in a hidden sibling directory and renamed into place at the end: an interrupted conversion
    never leaves a half-written `out_dir`. `source_sha256` (the GGUF's hash) is recorded in
    `gguf_import.json`; it is computed when not given.
    """
    import gguf  # heavy import: only when converting

    gguf_path = Path(gguf_path)
    out_dir = Path(out_dir)
    torch_dtype = resolve_dtype(dtype)
    if not gguf_path.is_file():
        raise ValueError(f"GGUF file {str(gguf_path)!r} does not exist")
    if out_dir.exists() and not overwrite:
        raise ValueError(f"output folder {str(out_dir)!r} already exists; remove it or pass overwrite=True")
    if sys.byteorder != "little":
        raise ValueError("GGUF import writes little-endian safetensors and needs a little-endian machine")

    started = time.perf_counter()
    reader = gguf.GGUFReader(str(gguf_path))
    meta = _GGUFMetadata(reader)
    spec = _architecture_spec(meta.architecture)
    plan = _plan_tensors(reader, meta, spec)
    config = _build_config(meta, spec, plan, torch_dtype)
    tokenizer = _build_tokenizer(meta)
    tokenizer_config = _build_tokenizer_config(meta)
    logger.info(
        "converting %s (%s, %d tensors: %s) to %s as %s",
        gguf_path.name, meta.architecture, len(plan.tensors), dict(plan.tensor_types), out_dir, torch_dtype,
    )

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.partial-", dir=out_dir.parent))
    try:
        _write_json(staging / "config.json", config)
        _write_json(staging / "generation_config.json", _generation_config(config))
        _write_safetensors(staging / "model.safetensors", plan, torch_dtype)
        tokenizer.save(str(staging / "tokenizer.json"))
        _write_json(staging / "tokenizer_config.json", tokenizer_config)
        record = ImportRecord(
            format_version=IMPORT_FORMAT_VERSION,
            source_file=gguf_path.name,
            source_sha256=source_sha256 or file_sha256(gguf_path),
            architecture=meta.architecture,
            dtype=str(torch_dtype).removeprefix("torch."),
            num_tensors=len(plan.tensors),
            tensor_types=dict(plan.tensor_types),
        )
        _write_json(staging / IMPORT_RECORD_NAME, record.__dict__)
        staging.chmod(0o755)  # mkdtemp made it private; the result is an ordinary folder
        _move_into_place(staging, out_dir, overwrite)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    size = sum(p.stat().st_size for p in out_dir.iterdir() if p.is_file())
    logger.info("converted %s in %.1f s (%.1f MiB)", out_dir, time.perf_counter() - started, size / 2**20)
    return out_dir


def file_sha256(path: str | Path, chunk_bytes: int = 1 << 20) -> str:
    """Hex sha256 of a file, read in chunks so large files need no memory."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


# --------------------------------------------------------------------------------------------------------------
# Metadata and architectures
# --------------------------------------------------------------------------------------------------------------


class _GGUFMetadata:
    """Typed access to GGUF key/values with errors that name the missing key."""

    def __init__(self, reader: Any) -> None:
        self._fields = reader.fields
        arch = self.get("general.architecture")
        if not isinstance(arch, str):
            raise ValueError("GGUF file has no general.architecture; it is not a model file")
        self.architecture: str = arch

    def get(self, key: str, default: Any = None) -> Any:
        field = self._fields.get(key)
        return default if field is None else field.contents()

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ValueError(f"GGUF file lacks required metadata {key!r}")
        return value

    def arch(self, suffix: str, default: Any = None) -> Any:
        return self.get(f"{self.architecture}.{suffix}", default)

    def arch_required(self, suffix: str) -> Any:
        return self.require(f"{self.architecture}.{suffix}")


@dataclass(frozen=True)
class _ArchSpec:
    """How one GGUF architecture maps onto an HF model class."""

    hf_class: str
    model_type: str
    permuted_qk: bool  # llama.cpp's Llama converter interleaves q/k rows for its RoPE kernel
    qkv_bias: bool | None  # True: required; False: forbidden; None: optional
    qk_norm: bool


_ARCHITECTURES: dict[str, _ArchSpec] = {
    "llama": _ArchSpec("LlamaForCausalLM", "llama", permuted_qk=True, qkv_bias=None, qk_norm=False),
    "qwen2": _ArchSpec("Qwen2ForCausalLM", "qwen2", permuted_qk=False, qkv_bias=True, qk_norm=False),
    "qwen3": _ArchSpec("Qwen3ForCausalLM", "qwen3", permuted_qk=False, qkv_bias=False, qk_norm=True),
}


def _architecture_spec(architecture: str) -> _ArchSpec:
    spec = _ARCHITECTURES.get(architecture)
    if spec is None:
        raise ValueError(
            f"GGUF architecture {architecture!r} is not supported; supported: {sorted(_ARCHITECTURES)}"
        )
    return spec


_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_ROPE_FREQS = "rope_freqs.weight"  # llama3-style frequency factors: folded into config.json, not saved


def hf_tensor_name(gguf_name: str) -> str:
    """HF parameter name for a llama.cpp tensor name (e.g. blk.3.attn_q.weight -> ...layers.3...q_proj.weight)."""
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    parts = gguf_name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{int(parts[1])}.{_LAYER_TENSORS[parts[2]]}"
    raise ValueError(
        f"GGUF tensor {gguf_name!r} has no Hugging Face counterpart in this importer; "
        f"known: {sorted(_GLOBAL_TENSORS)} and blk.N.{{{', '.join(sorted(_LAYER_TENSORS))}}}"
    )


@dataclass(frozen=True)
class _TensorPlan:
    gguf_tensor: Any  # gguf.ReaderTensor
    hf_name: str
    shape: tuple[int, ...]  # HF (row-major) shape
    rope_heads: int  # > 0: undo llama.cpp's q/k row permutation with this many heads


@dataclass(frozen=True)
class _ConversionPlan:
    tensors: list[_TensorPlan]
    tensor_types: Counter[str]
    rope_freqs: np.ndarray | None  # [head_dim / 2] llama.cpp frequency divisors, when the file has them
    tied_embeddings: bool
    has_qkv_bias: bool
    head_dim: int
    vocab_rows: int


def _plan_tensors(reader: Any, meta: _GGUFMetadata, spec: _ArchSpec) -> _ConversionPlan:
    """Map every tensor and validate types and shapes before any output is written (fail fast)."""
    import gguf

    n_heads = int(meta.arch_required("attention.head_count"))
    n_kv_heads = int(meta.arch("attention.head_count_kv", n_heads))
    plans: list[_TensorPlan] = []
    types: Counter[str] = Counter()
    rope_freqs: np.ndarray | None = None
    for tensor in reader.tensors:
        qtype = gguf.GGMLQuantizationType(tensor.tensor_type)
        if not _can_dequantize(qtype):
            raise ValueError(
                f"GGUF tensor {tensor.name!r} has type {qtype.name}, which gguf cannot dequantize; "
                "re-export the file with a supported quantization (F32, F16, BF16, Q4_0..Q8_0, K-quants, ...)"
            )
        shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
        if tensor.name == _ROPE_FREQS:
            rope_freqs = np.asarray(gguf.quants.dequantize(tensor.data, qtype), dtype=np.float32).reshape(-1)
            continue
        name = hf_tensor_name(tensor.name)
        rope_heads = 0
        if spec.permuted_qk and name.endswith(("q_proj.weight", "q_proj.bias")):
            rope_heads = n_heads
        elif spec.permuted_qk and name.endswith(("k_proj.weight", "k_proj.bias")):
            rope_heads = n_kv_heads
        if rope_heads and shape[0] % (2 * rope_heads):
            raise ValueError(f"GGUF tensor {tensor.name!r} shape {shape} does not split into {rope_heads} heads")
        plans.append(_TensorPlan(tensor, name, shape, rope_heads))
        types[qtype.name] += 1

    names = {p.hf_name: p for p in plans}
    if "model.embed_tokens.weight" not in names:
        raise ValueError("GGUF file has no token_embd.weight tensor")
    q_proj = names.get("model.layers.0.self_attn.q_proj.weight")
    if q_proj is None:
        raise ValueError("GGUF file has no blk.0.attn_q.weight tensor")
    has_bias = "model.layers.0.self_attn.q_proj.bias" in names
    if spec.qkv_bias is True and not has_bias:
        raise ValueError(f"{meta.architecture} checkpoints need q/k/v biases but the GGUF file has none")
    if spec.qkv_bias is False and has_bias:
        raise ValueError(f"{meta.architecture} checkpoints have no q/k/v biases but the GGUF file has some")
    if spec.qk_norm and "model.layers.0.self_attn.q_norm.weight" not in names:
        raise ValueError(f"{meta.architecture} checkpoints need attn_q_norm tensors but the GGUF file has none")
    return _ConversionPlan(
        tensors=plans,
        tensor_types=types,
        rope_freqs=rope_freqs,
        tied_embeddings="lm_head.weight" not in names,
        has_qkv_bias=has_bias,
        head_dim=q_proj.shape[0] // n_heads,
        vocab_rows=names["model.embed_tokens.weight"].shape[0],
    )


def _can_dequantize(qtype: Any) -> bool:
    """Ask gguf itself (one zero block) instead of keeping our own list of supported quant types."""
    import gguf

    sizes = gguf.GGML_QUANT_SIZES.get(qtype)
    if sizes is None:
        return False
    try:
        gguf.quants.dequantize(np.zeros((1, sizes[1]), dtype=np.uint8), qtype)
    except (NotImplementedError, ValueError, TypeError):
        return False
    return True


# --------------------------------------------------------------------------------------------------------------
# config.json
# --------------------------------------------------------------------------------------------------------------


def _build_config(meta: _GGUFMetadata, spec: _ArchSpec, plan: _ConversionPlan, dtype: torch.dtype) -> dict[str, Any]:
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
        "architectures": [spec.hf_class],
        "model_type": spec.model_type,
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
    if spec.model_type == "llama":
        config |= {"attention_bias": plan.has_qkv_bias, "mlp_bias": False, "pretraining_tp": 1}
    elif spec.model_type == "qwen2":
        config |= {"use_sliding_window": False, "sliding_window": None}
    elif spec.model_type == "qwen3":
        config |= {"attention_bias": False, "use_sliding_window": False, "sliding_window": None}
    return config


def _from_float32(value: float) -> float:
    """GGUF stores config floats as float32 (1e-6 reads back as 9.99999997e-07); the shortest decimal that
    rounds to the same float32 is the value the original config.json held, and is identical in float32 math."""
    return float(np.format_float_positional(np.float32(value), unique=True, trim="0"))


def _rope_scaling(meta: _GGUFMetadata, plan: _ConversionPlan) -> dict[str, Any] | None:
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


def _generation_config(config: dict[str, Any]) -> dict[str, Any]:
    keys = ("bos_token_id", "eos_token_id", "pad_token_id")
    return {key: config[key] for key in keys if config.get(key) is not None}


# --------------------------------------------------------------------------------------------------------------
# model.safetensors, streamed
# --------------------------------------------------------------------------------------------------------------


def unpermute_rope_rows(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k permutation: per head it interleaves the two rotate-half halves row by row.

    llama.cpp writes row (h, 2j + s) from HF row (h, s * head_dim/2 + j); we read it back. Works for weights
    [heads * head_dim, in] and biases [heads * head_dim].
    """
    rest = weight.shape[1:]
    half = weight.shape[0] // n_heads // 2
    return weight.reshape(n_heads, half, 2, *rest).transpose(1, 2).reshape(weight.shape)  # [H*D, ...]


def _iter_converted(plan: _ConversionPlan, dtype: torch.dtype) -> Iterator[tuple[_TensorPlan, torch.Tensor]]:
    import gguf

    for index, item in enumerate(plan.tensors):
        tensor = item.gguf_tensor
        values = gguf.quants.dequantize(tensor.data, gguf.GGMLQuantizationType(tensor.tensor_type))
        values = np.asarray(values, dtype=np.float32)
        if not (values.flags.writeable and values.flags.c_contiguous):  # F32 data is a read-only file mapping
            values = np.array(values, dtype=np.float32, order="C")
        weight = torch.from_numpy(values).reshape(item.shape)  # [out, in]
        if item.rope_heads:
            weight = unpermute_rope_rows(weight, item.rope_heads)
        logger.debug("tensor %d/%d %s %s", index + 1, len(plan.tensors), item.hf_name, tuple(item.shape))
        yield item, weight.to(dtype).contiguous()


def _write_safetensors(path: Path, plan: _ConversionPlan, dtype: torch.dtype) -> None:
    """Write the safetensors format directly: the header is known from shapes alone, so each tensor can be
    dequantized, written and dropped in turn instead of holding the whole model in memory."""
    element = torch.empty((), dtype=dtype).element_size()
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for item in plan.tensors:
        nbytes = math.prod(item.shape) * element
        header[item.hf_name] = {
            "dtype": _SAFETENSORS_DTYPE[dtype],
            "shape": list(item.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode("utf-8")
    encoded += b" " * (-len(encoded) % 8)  # the data section starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(encoded).to_bytes(8, "little"))
        f.write(encoded)
        for item, weight in _iter_converted(plan, dtype):
            _write_tensor_bytes(f, weight)
        written = f.tell()
        f.flush()
        os.fsync(f.fileno())
    if written != 8 + len(encoded) + offset:
        raise AssertionError(f"safetensors size mismatch: wrote {written} bytes, planned {8 + len(encoded) + offset}")


def _write_tensor_bytes(f: BinaryIO, weight: torch.Tensor) -> None:
    raw = weight.reshape(-1).view(torch.uint8).numpy()  # [numel * element_size]
    f.write(memoryview(raw))


# --------------------------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------------------------


def byte_level_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map that byte-level BPE vocabularies are spelled in.

    Printable Latin-1 bytes stand for themselves; the other 68 bytes are shifted to code points 256 and up
    in byte order, so every vocabulary string is visible text.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    mapping = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + shifted)
            shifted += 1
    return mapping


# Split patterns of the model families whose pre-tokenizer is more than GPT-2's regex (published with
# each model's tokenizer; llama.cpp names them in tokenizer.ggml.pre).
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class _PreTokenizerSpec:
    kind: str  # "gpt2": GPT-2 regex; "digits+gpt2": each digit alone, then GPT-2 regex; "split": custom regex
    pattern: str = ""
    nfc: bool = False  # the original tokenizer NFC-normalizes text first
    ignore_merges: bool = False  # whole pre-tokens found in the vocabulary skip BPE (Llama 3)


_PRE_TOKENIZERS: dict[str, _PreTokenizerSpec] = {
    "gpt-2": _PreTokenizerSpec("gpt2"),
    "gpt2": _PreTokenizerSpec("gpt2"),
    "smollm": _PreTokenizerSpec("digits+gpt2"),
    "starcoder": _PreTokenizerSpec("digits+gpt2"),
    "llama-bpe": _PreTokenizerSpec("split", _LLAMA3_SPLIT, ignore_merges=True),
    "llama3": _PreTokenizerSpec("split", _LLAMA3_SPLIT, ignore_merges=True),
    "llama-v3": _PreTokenizerSpec("split", _LLAMA3_SPLIT, ignore_merges=True),
    "qwen2": _PreTokenizerSpec("split", _QWEN2_SPLIT, nfc=True),
    "deepseek-r1-qwen": _PreTokenizerSpec("split", _QWEN2_SPLIT, nfc=True),
}


def _build_tokenizer(meta: _GGUFMetadata) -> Any:
    """A `tokenizers.Tokenizer` equal to the model's original tokenizer.json, rebuilt from GGUF metadata."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(
            f"GGUF tokenizer model {model!r} is not supported; supported: 'gpt2' (byte-level BPE)"
        )
    pre_name = meta.get("tokenizer.ggml.pre", "gpt-2")
    pre = _PRE_TOKENIZERS.get(pre_name)
    if pre is None:
        raise ValueError(f"GGUF pre-tokenizer {pre_name!r} is not supported; supported: {sorted(_PRE_TOKENIZERS)}")
    tokens: list[str] = list(meta.require("tokenizer.ggml.tokens"))
    types: list[int] = list(meta.get("tokenizer.ggml.token_type") or [_TOKEN_NORMAL] * len(tokens))
    merges_raw = meta.get("tokenizer.ggml.merges")
    if not merges_raw:
        raise ValueError("GGUF byte-level BPE tokenizer has no tokenizer.ggml.merges")

    alphabet = set(byte_level_alphabet().values())
    spell = byte_level_alphabet()
    vocab: dict[str, int] = {}
    for index, (token, kind) in enumerate(zip(tokens, types, strict=True)):
        # Normal tokens must be spelled in the byte alphabet for BPE to reach them; added tokens keep their
        # text because they are matched verbatim before BPE runs.
        if kind == _TOKEN_NORMAL and not set(token) <= alphabet:
            token = "".join(spell[b] for b in token.encode("utf-8"))
        if token in vocab:
            logger.warning("GGUF vocabulary repeats %r (ids %d and %d); keeping the first", token, vocab[token], index)
            continue
        vocab[token] = index
    merges = [tuple(m.split(" ", 1)) for m in merges_raw]

    tokenizer = Tokenizer(
        models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False, ignore_merges=pre.ignore_merges)
    )
    if pre.nfc:
        tokenizer.normalizer = normalizers.NFC()
    if pre.kind == "gpt2":
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    elif pre.kind == "digits+gpt2":
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(pre.pattern), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = _post_processor(meta, tokens, processors)

    control = [t for t, k in zip(tokens, types) if k == _TOKEN_CONTROL]
    user_defined = [t for t, k in zip(tokens, types) if k == _TOKEN_USER_DEFINED]
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in user_defined])
    for token in control + user_defined:
        if tokenizer.token_to_id(token) != vocab.get(token):
            raise AssertionError(f"added token {token!r} did not keep its GGUF id")
    return tokenizer


def _post_processor(meta: _GGUFMetadata, tokens: list[str], processors: Any) -> Any:
    """BOS/EOS insertion as llama.cpp does it (tokenizer.ggml.add_bos_token / add_eos_token)."""
    byte_level = processors.ByteLevel(trim_offsets=False)
    prefix: list[tuple[str, int]] = []
    suffix: list[tuple[str, int]] = []
    for flag, key, target in (
        ("tokenizer.ggml.add_bos_token", "tokenizer.ggml.bos_token_id", prefix),
        ("tokenizer.ggml.add_eos_token", "tokenizer.ggml.eos_token_id", suffix),
    ):
        token_id = meta.get(key)
        if meta.get(flag) and token_id is not None:
            if not 0 <= token_id < len(tokens):
                raise ValueError(f"GGUF {key} is {token_id}, outside the {len(tokens)}-token vocabulary")
            target.append((tokens[token_id], int(token_id)))
    if not prefix and not suffix:
        return byte_level
    pre = [t for t, _ in prefix]
    post = [t for t, _ in suffix]
    template = processors.TemplateProcessing(
        single=[*pre, "$A:0", *post],
        pair=[*pre, "$A:0", *post, *pre, "$B:1", *post],
        special_tokens=list(dict.fromkeys(prefix + suffix)),
    )
    return processors.Sequence([byte_level, template])


def _build_tokenizer_config(meta: _GGUFMetadata) -> dict[str, Any]:
    tokens: list[str] = list(meta.require("tokenizer.ggml.tokens"))

    def token_for(key: str) -> str | None:
        token_id = meta.get(key)
        return None if token_id is None or not 0 <= token_id < len(tokens) else tokens[token_id]

    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token_for("tokenizer.ggml.bos_token_id"),
        "eos_token": token_for("tokenizer.ggml.eos_token_id"),
        "unk_token": token_for("tokenizer.ggml.unknown_token_id"),
        "pad_token": token_for("tokenizer.ggml.padding_token_id"),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(meta.arch("context_length", 2048)),
    }
    template = meta.get("tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    return config


# --------------------------------------------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------------------------------------------


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _move_into_place(staging: Path, out_dir: Path, overwrite: bool) -> None:
    """Rename the finished staging folder to `out_dir`; an old folder is swapped out first, then deleted."""
    old: Path | None = None
    if out_dir.exists():
        if not overwrite:
            raise ValueError(f"output folder {str(out_dir)!r} appeared during conversion; not replacing it")
        old = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
        old.rmdir()
        out_dir.rename(old)
    staging.rename(out_dir)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
