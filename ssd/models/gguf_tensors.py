"""GGUF tensors to safetensors: llama.cpp -> Hugging Face names, validation, dequantization, streamed writing.

Every tensor is mapped and checked before anything is written (:func:`plan_tensors`), so an unsupported file
fails fast. Writing then dequantizes one tensor at a time with gguf's reference dequantizer (float32), undoes
llama.cpp's q/k row permutation for Llama's RoPE, casts to the chosen dtype and appends it to a safetensors
file whose header is known from the shapes alone: peak memory is about one float32 tensor. With
``keep_blocks``, projections whose type has a kernel here (Q8_0, Q4_0, Q4_1, Q4_K: ``ssd/models/block_quant.py``) are
written as their GGUF bytes instead (uint8, ``[out, blocks x block bytes]``, rows unpermuted like the float
ones), so the model runs the file's own blocks (weight format ``"gguf"``).
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch

from ssd.models.gguf_metadata import GGUFArch, GGUFMetadata

logger = logging.getLogger(__name__)

SAFETENSORS_DTYPE = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}
"""The dtypes an import can write, with their safetensors names."""

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
class TensorPlan:
    gguf_tensor: Any  # gguf.ReaderTensor
    hf_name: str
    shape: tuple[int, ...]  # HF (row-major) shape
    rope_heads: int  # > 0: undo llama.cpp's q/k row permutation with this many heads
    block_kind: str | None = None  # kept as GGUF blocks of this kind ("q8_0", "q4_0", "q4_1"), not dequantized

    @property
    def stored_shape(self) -> tuple[int, ...]:
        """Shape in the safetensors file: the HF shape, or [out, bytes per row] for kept blocks."""
        if self.block_kind is None:
            return self.shape
        return (self.shape[0], self.gguf_tensor.n_bytes // self.shape[0])


@dataclass(frozen=True)
class ConversionPlan:
    tensors: list[TensorPlan]
    tensor_types: Counter[str]
    rope_freqs: np.ndarray | None  # [head_dim / 2] llama.cpp frequency divisors, when the file has them
    tied_embeddings: bool
    has_qkv_bias: bool
    head_dim: int
    vocab_rows: int


# GGUF types whose blocks the block-quantized kernel runs as stored (``keep_blocks``)
KEPT_BLOCK_TYPES = {"Q8_0": "q8_0", "Q4_0": "q4_0", "Q4_1": "q4_1", "Q4_K": "q4_k"}


def plan_tensors(reader: Any, meta: GGUFMetadata, arch: GGUFArch, keep_blocks: bool = False) -> ConversionPlan:
    """Map every tensor and validate types and shapes before any output is written (fail fast); with
    ``keep_blocks``, projections of a :data:`KEPT_BLOCK_TYPES` type are planned as blocks."""
    import gguf

    n_heads = int(meta.arch_required("attention.head_count"))
    n_kv_heads = int(meta.arch("attention.head_count_kv", n_heads))
    plans: list[TensorPlan] = []
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
        if arch.permuted_qk and name.endswith(("q_proj.weight", "q_proj.bias")):
            rope_heads = n_heads
        elif arch.permuted_qk and name.endswith(("k_proj.weight", "k_proj.bias")):
            rope_heads = n_kv_heads
        if rope_heads and shape[0] % (2 * rope_heads):
            raise ValueError(f"GGUF tensor {tensor.name!r} shape {shape} does not split into {rope_heads} heads")
        kept = KEPT_BLOCK_TYPES.get(qtype.name) if keep_blocks and name.endswith("_proj.weight") else None
        plans.append(TensorPlan(tensor, name, shape, rope_heads, kept))
        types[qtype.name] += 1

    names = {p.hf_name: p for p in plans}
    if "model.embed_tokens.weight" not in names:
        raise ValueError("GGUF file has no token_embd.weight tensor")
    q_proj = names.get("model.layers.0.self_attn.q_proj.weight")
    if q_proj is None:
        raise ValueError("GGUF file has no blk.0.attn_q.weight tensor")
    has_bias = "model.layers.0.self_attn.q_proj.bias" in names
    if arch.qkv_bias is True and not has_bias:
        raise ValueError(f"{meta.architecture} checkpoints need q/k/v biases but the GGUF file has none")
    if arch.qkv_bias is False and has_bias:
        raise ValueError(f"{meta.architecture} checkpoints have no q/k/v biases but the GGUF file has some")
    if arch.qk_norm and "model.layers.0.self_attn.q_norm.weight" not in names:
        raise ValueError(f"{meta.architecture} checkpoints need attn_q_norm tensors but the GGUF file has none")
    return ConversionPlan(
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


def unpermute_rope_rows(weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k permutation: per head it interleaves the two rotate-half halves row by row.

    llama.cpp writes row (h, 2j + s) from HF row (h, s * head_dim/2 + j); we read it back. Works for weights
    [heads * head_dim, in] and biases [heads * head_dim].
    """
    rest = weight.shape[1:]
    half = weight.shape[0] // n_heads // 2
    return weight.reshape(n_heads, half, 2, *rest).transpose(1, 2).reshape(weight.shape)  # [H*D, ...]


def _iter_converted(plan: ConversionPlan, dtype: torch.dtype) -> Iterator[tuple[TensorPlan, torch.Tensor]]:
    import gguf

    for index, item in enumerate(plan.tensors):
        tensor = item.gguf_tensor
        if item.block_kind is not None:  # the file's bytes; whole rows of blocks, so rows unpermute alike
            raw = torch.from_numpy(np.array(tensor.data, dtype=np.uint8)).reshape(item.stored_shape)
            yield item, unpermute_rope_rows(raw, item.rope_heads).contiguous() if item.rope_heads else raw
            continue
        values = gguf.quants.dequantize(tensor.data, gguf.GGMLQuantizationType(tensor.tensor_type))
        values = np.asarray(values, dtype=np.float32)
        if not (values.flags.writeable and values.flags.c_contiguous):  # F32 data is a read-only file mapping
            values = np.array(values, dtype=np.float32, order="C")
        weight = torch.from_numpy(values).reshape(item.shape)  # [out, in]
        if item.rope_heads:
            weight = unpermute_rope_rows(weight, item.rope_heads)
        logger.debug("tensor %d/%d %s %s", index + 1, len(plan.tensors), item.hf_name, tuple(item.shape))
        yield item, weight.to(dtype).contiguous()


def write_safetensors(path: Path, plan: ConversionPlan, dtype: torch.dtype) -> None:
    """Write the safetensors format directly: the header is known from shapes alone, so each tensor can be
    dequantized, written and dropped in turn instead of holding the whole model in memory."""
    element = torch.empty((), dtype=dtype).element_size()
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for item in plan.tensors:
        kept = item.block_kind is not None
        nbytes = math.prod(item.stored_shape) * (1 if kept else element)
        header[item.hf_name] = {
            "dtype": "U8" if kept else SAFETENSORS_DTYPE[dtype],
            "shape": list(item.stored_shape),
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
