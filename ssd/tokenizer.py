"""Tokenizer loading, chat templates, and incremental detokenization with stop strings."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


class Tokenizer:
    """Thin wrapper over a Hugging Face fast tokenizer read from a checkpoint folder."""

    def __init__(self, path: str | Path) -> None:
        from transformers import AutoTokenizer  # heavy import: only when an engine starts

        path = Path(path)
        if not path.is_dir():
            raise FileNotFoundError(f"tokenizer folder {str(path)!r} does not exist")
        try:
            self._tok = AutoTokenizer.from_pretrained(str(path))
        except Exception as exc:  # transformers raises many types; users need the path and the cause
            raise ValueError(f"cannot load a tokenizer from {str(path)!r}: {exc}") from exc
        self.eos_token_id: int | None = self._tok.eos_token_id

    def __len__(self) -> int:
        return len(self._tok)

    def get_vocab(self) -> dict[str, int]:
        return self._tok.get_vocab()

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=True))

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        if not getattr(self._tok, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; use generate() with a plain prompt")
        ids = self._tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "keys"):  # some versions return a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)


@dataclass
class IncrementalDetokenizer:
    """Keeps a request's output text up to date and finds stop strings in newly produced text.

    Decoding the whole output each step is simple and always correct for multi-byte characters; outputs here
    are short enough that its cost is negligible next to a forward pass.
    """

    tokenizer: Tokenizer
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    text: str = ""

    def update(self, output_token_ids: list[int]) -> tuple[str, bool]:
        """Re-decode; returns (new text since last call, whether a stop string was found)."""
        full = self.tokenizer.decode(output_token_ids, skip_special_tokens=self.skip_special_tokens)
        if full.endswith("\ufffd"):  # an incomplete multi-byte character: wait for the next token
            full = full.rstrip("\ufffd")
        previous = self.text
        stopped = False
        if self.stop:
            search_from = max(0, len(previous) - max(len(s) for s in self.stop) + 1)
            hits = [(full.find(s, search_from), s) for s in self.stop]
            hits = [(i, s) for i, s in hits if i >= 0]
            if hits:
                index, stop = min(hits)
                full = full[: index + len(stop)] if self.include_stop_str_in_output else full[:index]
                stopped = True
        self.text = full
        return (full[len(previous) :] if full.startswith(previous) else full), stopped
