"""Architecture name -> model class.

The loader looks classes up here so that adding an architecture (or a tensor-parallel variant) is one entry,
and an unsupported checkpoint fails with the list of what is supported.
"""

from __future__ import annotations

from ssd.models.decoder import DecoderLM

_MODEL_CLASSES: dict[str, type[DecoderLM]] = {
    "LlamaForCausalLM": DecoderLM,
    "MistralForCausalLM": DecoderLM,
    "Qwen2ForCausalLM": DecoderLM,
    "Qwen3ForCausalLM": DecoderLM,
}


def supported_architectures() -> list[str]:
    return sorted(_MODEL_CLASSES)


def get_model_class(architecture: str) -> type[DecoderLM]:
    try:
        return _MODEL_CLASSES[architecture]
    except KeyError:
        raise ValueError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(supported_architectures())}"
        ) from None
