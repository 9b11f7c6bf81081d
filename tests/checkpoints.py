"""Tiny random Hugging Face checkpoints (model + tokenizer) for tests.

Tests compare the engine against ``transformers`` on real checkpoint folders written by ``save_pretrained``,
so the loader, tokenizer and chat template paths are exercised exactly as with downloaded models, without
network access. Everything is deterministic for a given ``seed``.

Stable API (shared by all test files; keep backwards compatible):

    make_checkpoint(path, arch="llama", *, vocab_size=512, hidden_size=64, intermediate_size=128,
                    num_layers=2, num_heads=4, num_kv_heads=2, tie_word_embeddings=False, seed=0,
                    rope_scaling=None, max_position_embeddings=2048, **overrides) -> Path

``arch`` is one of "llama", "qwen2", "qwen3", "mistral". ``overrides`` go straight into the HF config
(e.g. ``head_dim=32``, ``attention_bias=True``, ``rope_theta=500000.0``). Qwen3 defaults to an explicit
``head_dim`` of ``2 * hidden_size // num_heads`` so that code paths that wrongly assume hidden/heads fail.

The tokenizer is a byte-level BPE trained on the built-in text below (vocab <= vocab_size) with special
tokens ``<|endoftext|>`` (pad), ``<|im_start|>``, ``<|im_end|>`` (eos; ``config.eos_token_id`` matches) and
a ChatML-style Jinja chat template.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

TRAINING_TEXT = [
    "The quick brown fox jumps over the lazy dog. A stitch in time saves nine. All that glitters is not gold.",
    "Once upon a time there was a small village by the river. Every morning the baker opened his shop and the "
    "smell of fresh bread filled the street. Children ran to school, and farmers carried their vegetables to "
    "the market in the square.",
    "Speculative decoding lets a small draft model guess several tokens ahead. The large target model checks "
    "all of them in one forward pass, and the output distribution stays exactly the same as before.",
    "The weather was cold and windy, so she wore a warm coat and a red scarf. Snow covered the hills, and the "
    "lake in the valley had turned to ice. In the evening they sat by the fire and told stories.",
    "Numbers: one, two, three, four, five, six, seven, eight, nine, ten. 0 1 2 3 4 5 6 7 8 9 10 100 1000.",
    "Question: What is the capital of France? Answer: The capital of France is Paris. Question: What is two "
    "plus two? Answer: Two plus two is four.",
    "def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(add(i, i))\n",
    "Hello! How are you today? I am fine, thank you. Could you please tell me the way to the station? Turn "
    "left at the corner, walk straight for five minutes, and you will see it on your right.",
]

PAD_TOKEN = "<|endoftext|>"
EOS_TOKEN = "<|im_end|>"
SPECIAL_TOKENS = [PAD_TOKEN, "<|im_start|>", EOS_TOKEN]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_ARCHS = ("llama", "qwen2", "qwen3", "mistral")
INIT_STD = 0.15  # well above HF's 0.02 so logits are spread out and greedy argmax has no near-ties


def make_checkpoint(
    path: Path,
    arch: str = "llama",
    *,
    vocab_size: int = 512,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    tie_word_embeddings: bool = False,
    seed: int = 0,
    rope_scaling: dict[str, Any] | None = None,
    max_position_embeddings: int = 2048,
    **overrides: Any,
) -> Path:
    """Write a random ``arch`` model and a small tokenizer into ``path``; returns ``path``."""
    import transformers

    if arch not in _ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose from {_ARCHS}")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer(vocab_size)
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    pad_id = tokenizer.convert_tokens_to_ids(PAD_TOKEN)

    config_cls = {
        "llama": transformers.LlamaConfig,
        "qwen2": transformers.Qwen2Config,
        "qwen3": transformers.Qwen3Config,
        "mistral": transformers.MistralConfig,
    }[arch]
    kwargs: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        tie_word_embeddings=tie_word_embeddings,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        initializer_range=INIT_STD,
    )
    if arch == "qwen3":
        kwargs["head_dim"] = 2 * hidden_size // num_heads
    if arch == "mistral":
        kwargs["sliding_window"] = None
    if rope_scaling is not None:
        kwargs["rope_scaling"] = dict(rope_scaling)
    kwargs.update(overrides)
    config = config_cls(**kwargs)

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomize(model, seed)
    model.generation_config.eos_token_id = eos_id
    model.generation_config.pad_token_id = pad_id
    model.generation_config.bos_token_id = None
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Re-draw every parameter from a seeded generator: HF leaves norms at 1 and biases at 0, which would let
    a loader that drops or misplaces them pass unnoticed."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            if "norm" in name:
                param.copy_(1.0 + 0.1 * noise)
            elif name.endswith("bias"):
                param.copy_(0.1 * noise)
            else:
                param.copy_(INIT_STD * noise)


def make_tokenizer(vocab_size: int = 512):  # -> transformers.PreTrainedTokenizerFast
    """Byte-level BPE over :data:`TRAINING_TEXT` with at most ``vocab_size`` entries (deterministic)."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    min_size = 256 + len(SPECIAL_TOKENS)
    if vocab_size < min_size:
        raise ValueError(f"vocab_size must be >= {min_size} for a byte-level tokenizer, got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(TRAINING_TEXT, trainer=trainer)
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        chat_template=CHAT_TEMPLATE,
    )
