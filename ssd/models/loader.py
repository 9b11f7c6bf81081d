"""Load an HF checkpoint folder (config.json + safetensors) into a :class:`DecoderLM`.

The module is built on the meta device and materialised uninitialised, then every parameter is filled
tensor by tensor from safetensors, so peak memory stays about one model size and no time is spent on a
random init that would be overwritten. All names are checked before any data is read: a checkpoint that
does not match the architecture fails fast with the list of missing and unexpected tensors.

Under tensor parallelism each rank reads only its slice of every split tensor (safetensors slices are read
lazily from the file), so no rank ever materialises the full model.

Projections a checkpoint stores as GGUF blocks (a GGUF import with ``keep_blocks``; config.json's
``quantization_config``) become block-quantized products (``ssd/models/block_quant.py``) holding those blocks;
their float weights are never materialised.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open

from ssd.models.arch import ModelArchConfig
from ssd.models.block_quant import Blocks, BlockKind, BlockQuantProduct, blocks_from_gguf, stored_block_types
from ssd.models.decoder import DecoderLM
from ssd.models.layers import MergedLinear
from ssd.models.parallel import SourceSlice
from ssd.models.registry import get_model_class

if TYPE_CHECKING:
    from ssd.distributed.comm import TensorParallelGroup

logger = logging.getLogger(__name__)

_INDEX_FILE = "model.safetensors.index.json"
_SINGLE_FILE = "model.safetensors"
_MAX_LISTED = 20  # names listed in an error message before eliding


@dataclass(frozen=True)
class _Target:
    """Where one checkpoint tensor goes: a parameter, or a row range of a fused parameter; ``source`` is the
    slice of the checkpoint tensor this rank holds (``None``: all of it)."""

    param: torch.nn.Parameter
    rows: slice | None = None
    source: SourceSlice | None = None

    def view(self) -> torch.Tensor:
        rows = self.rows
        if rows is None and self.source is not None and self.source.dim == 0:
            # A vocabulary-parallel shard is padded to ceil(V / tp) rows; the last rank's tail stays zero.
            rows = slice(0, self.source.stop - self.source.start)
        return self.param.data if rows is None else self.param.data[rows]

    def read(self, f, name: str) -> torch.Tensor:  # noqa: ANN001 - safetensors' file handle has no public type
        if self.source is None:
            return f.get_tensor(name)
        lazy = f.get_slice(name)
        if self.source.dim == 0 or len(lazy.get_shape()) == 1:
            return lazy[self.source.start : self.source.stop]
        return lazy[:, self.source.start : self.source.stop]


def read_hf_config(folder: str | Path) -> dict:
    """The raw ``config.json`` dict; raises FileNotFoundError/ValueError naming the path on problems."""
    folder = Path(folder)
    if not folder.exists():
        raise FileNotFoundError(f"model folder {folder} does not exist")
    if not folder.is_dir():
        raise ValueError(f"model path {folder} is not a folder; pass the folder holding config.json")
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise FileNotFoundError(f"model folder {folder} has no config.json (expected {config_path})")
    try:
        data = json.loads(config_path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{config_path} is not valid JSON: {err}") from err
    if not isinstance(data, dict):
        raise ValueError(f"{config_path} must hold a JSON object, got {type(data).__name__}")
    return data


def stores_blocks(folder: str | Path | None) -> bool:
    """Whether the checkpoint ``folder`` stores GGUF blocks (False where it cannot be read: loading it says
    why)."""
    try:
        return folder is not None and bool(stored_block_types(read_hf_config(folder)))
    except (OSError, ValueError):
        return False


def load_arch_config(folder: str | Path) -> ModelArchConfig:
    """Parse ``config.json`` of a model folder; config errors are prefixed with the file's path."""
    data = read_hf_config(folder)
    try:
        return ModelArchConfig.from_hf_config(data)
    except ValueError as err:
        raise ValueError(f"{Path(folder) / 'config.json'}: {err}") from err


def load_model(
    path: str | Path,
    dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    tp: "TensorParallelGroup | None" = None,
) -> tuple[DecoderLM, ModelArchConfig]:
    """Build the model for the checkpoint at ``path`` and load its weights cast to ``dtype`` on ``device``
    (this rank's shard of them when ``tp`` is given)."""
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype must be a floating-point torch.dtype such as torch.bfloat16, got {dtype!r}")
    folder = Path(path)
    cfg = load_arch_config(folder)
    files = _safetensors_files(folder)
    block_types = stored_block_types(read_hf_config(folder))
    if block_types and (dtype != torch.float32 or (tp is not None and tp.world_size > 1)):
        raise ValueError(f"checkpoint {folder} stores GGUF blocks, which run on CPU in float32 on one rank; got "
                         f"dtype {dtype}{'' if tp is None else f', tensor parallelism {tp.world_size}'}")

    with torch.device("meta"):
        model = get_model_class(cfg.architecture)(cfg, dtype=dtype, tp=tp)
    model.to_empty(device=device)
    model.requires_grad_(False)

    targets = _weight_targets(model)
    plan = _plan_loads(folder, files, targets, cfg)
    stored: dict[int, list[tuple[int, Blocks, BlockKind]]] = {}  # id(param) -> (first row, blocks, kind)
    for file, names in plan.items():
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for ckpt_name, target_name in names:
                target = targets[target_name]
                if ckpt_name in block_types:
                    rows, in_features = target.view().shape
                    blocks = blocks_from_gguf(f.get_tensor(ckpt_name), block_types[ckpt_name], in_features)
                    if blocks.values.shape[0] != rows:
                        raise ValueError(f"tensor {ckpt_name} in {file} holds {blocks.values.shape[0]} rows of "
                                         f"blocks, expected {rows} for this config")
                    first = 0 if target.rows is None else target.rows.start
                    stored.setdefault(id(target.param), []).append((first, blocks, block_types[ckpt_name]))
                    continue
                tensor = target.read(f, ckpt_name)
                if target.source is not None and target.rows is None:
                    target.param.data.zero_()  # padding rows of a vocabulary shard
                dest = target.view()
                if tuple(tensor.shape) != tuple(dest.shape):
                    raise ValueError(
                        f"tensor {ckpt_name} in {file} has shape {tuple(tensor.shape)}, "
                        f"expected {tuple(dest.shape)} for this config"
                    )
                dest.copy_(tensor)
    _attach_blocks(model, stored)
    model.eval()
    logger.info("loaded %s (%d layers) from %s as %s", cfg.architecture, cfg.num_hidden_layers, folder, dtype)
    return model, cfg


def _attach_blocks(model: DecoderLM, stored: dict[int, list[tuple[int, Blocks, BlockKind]]]) -> None:
    """Give each projection whose rows were all stored as blocks of one kind a product over them (the parts of
    a fused projection stacked in row order) and release its float weight. A fused projection whose parts
    differ (llama.cpp's mixes such as Q4_K_M store some v projections in Q6_K) gets its blocks dequantized into
    its float weight instead, which its weight format then quantizes like any float matrix."""
    for name, module in model.named_modules():
        parts = stored.pop(id(getattr(module, "weight", None)), None)
        if parts is None:
            continue
        parts.sort(key=lambda part: part[0])
        kinds = {kind for _, _, kind in parts}
        rows = sum(blocks.values.shape[0] for _, blocks, _ in parts)
        in_features = module.weight.shape[1]
        if len(kinds) > 1 or rows != module.weight.shape[0]:
            logger.info("%s: parts stored as %s and float: dequantized", name, sorted(k.value for k in kinds))
            for first, blocks, _ in parts:
                module.weight.data[first : first + blocks.values.shape[0]] = blocks.dequantize()[:, :in_features]
            continue
        kind = kinds.pop()
        module.matmul = BlockQuantProduct.from_blocks(_stacked([blocks for _, blocks, _ in parts]), kind, in_features)
        module.weight = torch.nn.Parameter(module.weight.new_empty(0), requires_grad=False)


def _stacked(parts: list[Blocks]) -> Blocks:
    """Blocks of several row ranges, in order, as one."""
    def cat(field: str) -> torch.Tensor | None:
        tensors = [getattr(part, field) for part in parts]
        return None if tensors[0] is None else torch.cat(tensors)

    return Blocks(cat("values"), cat("scales"), cat("mins"), cat("supers"))


def _safetensors_files(folder: Path) -> list[Path]:
    index_path = folder / _INDEX_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as err:
            raise ValueError(f"{index_path} is not a valid safetensors index (needs 'weight_map'): {err}") from err
        files = [folder / name for name in sorted(set(weight_map.values()))]
        absent = [str(f) for f in files if not f.is_file()]
        if absent:
            raise FileNotFoundError(f"{index_path} lists shard files that do not exist: {', '.join(absent)}")
        return files
    if (folder / _SINGLE_FILE).is_file():
        return [folder / _SINGLE_FILE]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"model folder {folder} has no *.safetensors weights (only safetensors is supported)")
    return files


def _weight_targets(model: DecoderLM) -> dict[str, _Target]:
    """HF checkpoint name -> destination, derived from the module tree so the two can never drift apart."""
    targets: dict[str, _Target] = {}
    for module_name, module in model.named_modules():
        for param_name, param in module.named_parameters(recurse=False):
            full = f"{module_name}.{param_name}" if module_name else param_name
            if isinstance(module, MergedLinear):
                parent = module_name.rsplit(".", 1)[0]
                for shard in module.shard_sizes:
                    hf_name = f"model.{parent}.{_HF_SHARD_NAMES[shard]}.{param_name}"
                    targets[hf_name] = _Target(param, module.shard_slice(shard), module.checkpoint_slice(shard))
                continue
            source = module.checkpoint_slice(param_name) if hasattr(module, "checkpoint_slice") else None
            name = full if full.startswith("lm_head.") else f"model.{full}"
            targets[name] = _Target(param, source=source)
    return targets


_HF_SHARD_NAMES = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "gate": "gate_proj", "up": "up_proj"}


def _is_ignorable(name: str, cfg: ModelArchConfig) -> bool:
    if name.endswith("rotary_emb.inv_freq"):  # old checkpoints saved the RoPE table; we recompute it
        return True
    return cfg.tie_word_embeddings and name == "lm_head.weight"  # tied: the embedding is the head


def _plan_loads(
    folder: Path, files: list[Path], targets: dict[str, _Target], cfg: ModelArchConfig
) -> dict[Path, list[tuple[str, str]]]:
    """Per file, (checkpoint name, target name) pairs; validates the full name set before reading data."""
    plan: dict[Path, list[tuple[str, str]]] = {}
    found: dict[str, Path] = {}
    unexpected: list[str] = []
    for file in files:
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                names = list(f.keys())
        except Exception as err:  # safetensors raises its own error types for corrupt headers
            raise ValueError(f"cannot read safetensors file {file}: {err}") from err
        for name in names:
            if name in targets:
                plan.setdefault(file, []).append((name, name))
                found[name] = file
            elif cfg.tie_word_embeddings and name == "lm_head.weight":
                found[name] = file
            elif not _is_ignorable(name, cfg):
                unexpected.append(name)

    embed = "model.embed_tokens.weight"
    if cfg.tie_word_embeddings and embed not in found and "lm_head.weight" in found:
        # Some tied checkpoints store the shared matrix only under the head's name.
        plan.setdefault(found["lm_head.weight"], []).append(("lm_head.weight", embed))
        found[embed] = found["lm_head.weight"]

    missing = sorted(name for name in targets if name not in found)
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} tensor(s): {_listing(missing)}")
        if unexpected:
            parts.append(f"unexpected {len(unexpected)} tensor(s): {_listing(sorted(unexpected))}")
        raise ValueError(
            f"checkpoint {folder} does not match {cfg.architecture} "
            f"({cfg.num_hidden_layers} layers, tie_word_embeddings={cfg.tie_word_embeddings}): " + "; ".join(parts)
        )
    return plan


def _listing(names: list[str]) -> str:
    shown = ", ".join(names[:_MAX_LISTED])
    return shown if len(names) <= _MAX_LISTED else f"{shown}, ... ({len(names) - _MAX_LISTED} more)"


def load_input_embedding(path: str | Path, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The input embedding ``[V, H]`` of the checkpoint at ``path`` alone (an EAGLE-3 head without its own reads
    the target's), cast to ``dtype``; GGUF blocks are dequantized."""
    folder = Path(path)
    cfg = load_arch_config(folder)
    block_types = stored_block_types(read_hf_config(folder))
    names = ["model.embed_tokens.weight"] + (["lm_head.weight"] if cfg.tie_word_embeddings else [])
    for name in names:  # tied checkpoints may store the shared matrix under the head's name only
        for file in _safetensors_files(folder):
            with safe_open(str(file), framework="pt", device="cpu") as f:
                if name not in f.keys():
                    continue
                tensor = f.get_tensor(name)
                if name in block_types:
                    blocks = blocks_from_gguf(tensor, block_types[name], cfg.hidden_size)
                    tensor = blocks.dequantize()[:, : cfg.hidden_size]
                return tensor.to(dtype)
    raise ValueError(f"checkpoint {folder} has no input embedding ({' or '.join(names)})")
