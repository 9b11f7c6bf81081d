"""Rebuild a model's Hugging Face tokenizer (tokenizer.json, tokenizer_config.json) from GGUF metadata.

GGUF keeps the vocabulary, merges, token types and llama.cpp's name for the pre-tokenizer; this part maps
them back onto a ``tokenizers`` byte-level BPE equal to the model's original tokenizer.json, with the split
patterns of the supported model families (:data:`_PRE_TOKENIZERS`) and BOS/EOS insertion as llama.cpp does it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from ssd.models.gguf_metadata import GGUFMetadata

logger = logging.getLogger(__name__)

# GGUF token types (llama.cpp's llama_token_type).
_TOKEN_NORMAL = 1
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4


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


def build_tokenizer(meta: GGUFMetadata) -> Any:
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


def _post_processor(meta: GGUFMetadata, tokens: list[str], processors: Any) -> Any:
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


def build_tokenizer_config(meta: GGUFMetadata) -> dict[str, Any]:
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
