"""Typed access to a GGUF file's key/value metadata, and the architectures the GGUF import supports.

Shared by the tensor, config and tokenizer parts of the import (:mod:`ssd.models.gguf_import`), each of
which reads metadata; a missing required key fails with the key's name rather than a ``KeyError`` deep inside.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


class GGUFMetadata:
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
class GGUFArch:
    """How one GGUF architecture maps onto an HF model class."""

    hf_class: str
    model_type: str
    permuted_qk: bool  # llama.cpp's Llama converter interleaves q/k rows for its RoPE kernel
    qkv_bias: bool | None  # True: required; False: forbidden; None: optional
    qk_norm: bool


ARCHITECTURES: dict[str, GGUFArch] = {
    "llama": GGUFArch("LlamaForCausalLM", "llama", permuted_qk=True, qkv_bias=None, qk_norm=False),
    "qwen2": GGUFArch("Qwen2ForCausalLM", "qwen2", permuted_qk=False, qkv_bias=True, qk_norm=False),
    "qwen3": GGUFArch("Qwen3ForCausalLM", "qwen3", permuted_qk=False, qkv_bias=False, qk_norm=True),
}


def gguf_architecture(architecture: str) -> GGUFArch:
    arch = ARCHITECTURES.get(architecture)
    if arch is None:
        raise ValueError(
            f"GGUF architecture {architecture!r} is not supported; supported: {sorted(ARCHITECTURES)}"
        )
    return arch
