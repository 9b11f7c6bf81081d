"""Import a GGUF file (llama.cpp's format) into a Hugging Face-style checkpoint folder.

Our loader reads HF folders (config.json, model.safetensors, tokenizer.json), so a GGUF file is converted
once instead of teaching every component a second format. The import is exact up to dequantization: each
quantized tensor is expanded to float32 with gguf's reference dequantizer and then cast to the chosen dtype,
and the layout changes llama.cpp's converter made (q/k row permutation for Llama's RoPE) are undone so the
weights follow the HF rotate-half convention.

Supported: architectures llama, qwen2, qwen3; tokenizer model "gpt2" (byte-level BPE) with the
pre-tokenizers listed in `gguf_tokenizer._PRE_TOKENIZERS`; every tensor type gguf's dequantizer handles.

This module is the entry point (:func:`convert_gguf`) and the on-disk protocol (staging folder, atomic rename,
the import record). The work is split by concern: :mod:`ssd.models.gguf_metadata` (metadata access,
architectures), :mod:`ssd.models.gguf_tensors` (name mapping, dequantization, safetensors),
:mod:`ssd.models.gguf_config` (config.json, rope scaling) and :mod:`ssd.models.gguf_tokenizer` (tokenizer).
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ssd.models.block_quant import STORED_BLOCKS_METHOD
from ssd.models.gguf_config import build_config, generation_config, llama3_rope_divisors
from ssd.models.gguf_metadata import GGUFMetadata, gguf_architecture
from ssd.models.gguf_tensors import (
    SAFETENSORS_DTYPE,
    hf_tensor_name,
    plan_tensors,
    unpermute_rope_rows,
    write_safetensors,
)
from ssd.models.gguf_tokenizer import build_tokenizer, build_tokenizer_config, byte_level_alphabet

logger = logging.getLogger(__name__)

IMPORT_RECORD_NAME = "gguf_import.json"
"""Written last into the folder; its presence (with the source hash) marks a complete import."""

IMPORT_FORMAT_VERSION = 1
"""Bumped whenever the converter's output changes, so cached folders from older versions are redone."""

_DTYPES: dict[str, torch.dtype] = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}

__all__ = [  # the helpers tests and tools use are re-exported from the modules that own them
    "IMPORT_FORMAT_VERSION",
    "IMPORT_RECORD_NAME",
    "ImportRecord",
    "byte_level_alphabet",
    "convert_gguf",
    "file_sha256",
    "hf_tensor_name",
    "llama3_rope_divisors",
    "resolve_dtype",
    "unpermute_rope_rows",
]


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
        if dtype in SAFETENSORS_DTYPE:
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
    keep_blocks: bool = False,
) -> Path:
    """Convert a GGUF file into an HF checkpoint folder at `out_dir` and return its path.

    `keep_blocks`: projections stored as Q8_0, Q4_0 or Q4_1 keep the file's blocks (listed in config.json's
    `quantization_config`, run by the weight format "gguf" on CPU in float32) instead of being dequantized;
    every other tensor is dequantized to `dtype` as usual.

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
    meta = GGUFMetadata(reader)
    arch = gguf_architecture(meta.architecture)
    plan = plan_tensors(reader, meta, arch, keep_blocks)
    config = build_config(meta, arch, plan, torch_dtype)
    kept = {item.hf_name: item.block_kind for item in plan.tensors if item.block_kind is not None}
    if kept:
        config["quantization_config"] = {"quant_method": STORED_BLOCKS_METHOD, "block_types": kept}
    tokenizer = build_tokenizer(meta)
    tokenizer_config = build_tokenizer_config(meta)
    logger.info(
        "converting %s (%s, %d tensors: %s) to %s as %s",
        gguf_path.name, meta.architecture, len(plan.tensors), dict(plan.tensor_types), out_dir, torch_dtype,
    )

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.partial-", dir=out_dir.parent))
    try:
        _write_json(staging / "config.json", config)
        _write_json(staging / "generation_config.json", generation_config(config))
        write_safetensors(staging / "model.safetensors", plan, torch_dtype)
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
