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
            raise FileNotFoundError(
                f"tokenizer folder {str(path)!r} does not exist; pass a checkpoint folder holding the tokenizer files"
            )
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

    ``text`` is the text released to the caller so far. While the request runs, a tail of the decoded text
    that could be the start of a stop string is held back: if the stop string then completes, released text
    would otherwise have to be taken back, and streamed deltas would no longer add up to the final text.
    """

    tokenizer: Tokenizer
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    text: str = ""
    _decoded: str = field(default="", repr=False)  # everything decoded so far (cut at a stop string)

    def update(self, output_token_ids: list[int], finished: bool = False) -> tuple[str, bool]:
        """Re-decode; returns (text released since the last call, whether a stop string was found).

        ``finished``: the request ends with these tokens (length or stop token), so nothing is held back.
        """
        full = self._decode(output_token_ids, complete=finished)
        stopped = False
        hit = self._find_stop(full)
        if hit is not None:
            index, stop = hit
            full = full[: index + len(stop)] if self.include_stop_str_in_output else full[:index]
            stopped = True
        self._decoded = full
        release = full if stopped or finished else full[: len(full) - self._held_back(full)]
        previous = self.text
        self.text = release
        return (release[len(previous) :] if release.startswith(previous) else release), stopped

    def finds_stop(self, output_token_ids: list[int]) -> bool:
        """Whether these tokens complete a stop string (no state change). Lets the engine stop in the middle
        of a speculative round, at the same token as plain decoding would."""
        return bool(self.stop) and self._find_stop(self._decode(output_token_ids)) is not None

    def _decode(self, output_token_ids: list[int], complete: bool = False) -> str:
        full = self.tokenizer.decode(output_token_ids, skip_special_tokens=self.skip_special_tokens)
        if not complete and full.endswith("\ufffd"):  # an incomplete multi-byte character: wait for more
            full = full.rstrip("\ufffd")
        return full

    def _find_stop(self, full: str) -> tuple[int, str] | None:
        """The earliest stop string in text not searched before (a stop may start in earlier text)."""
        if not self.stop:
            return None
        search_from = max(0, len(self._decoded) - max(len(s) for s in self.stop) + 1)
        hits = [(full.find(s, search_from), s) for s in self.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        return min(hits) if hits else None

    def _held_back(self, full: str) -> int:
        """Length of the longest tail of ``full`` that is a proper prefix of some stop string."""
        longest = 0
        for stop in self.stop:
            for n in range(min(len(stop) - 1, len(full)), longest, -1):
                if full.endswith(stop[:n]):
                    longest = n
                    break
        return longest
