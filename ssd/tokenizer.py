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

    @property
    def hf_tokenizer(self) -> Any:
        """The underlying Hugging Face tokenizer (grammar libraries read its vocabulary)."""
        return self._tok

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


_INCOMPLETE = "\ufffd"  # what decoding shows for a multi-byte character whose last bytes have not come yet


@dataclass
class DecodeWindow:
    """Decodes a growing token sequence a bounded window at a time.

    Decoding all output tokens at every step costs O(n) per step, O(n^2) per request. Tokens before
    ``read_offset`` have final text; each call decodes only ``ids[prefix_offset:]`` and keeps the part after
    ``ids[prefix_offset:read_offset]``. The context tokens are decoded along because some decoders treat the
    first token of a decode call differently (SentencePiece drops its leading space): with the same first
    token in both decodes, the difference cancels, and the tail equals what decoding all tokens gives there.

    A tail ending in U+FFFD is a multi-byte character split across tokens: its text is not final, so it is
    reported without the trailing U+FFFD and the offsets stay until a later token completes it (or the request
    ends: ``complete`` reports it as it is, as decoding all tokens would).

    The ids passed must extend the ids passed before (the output of one request only grows).
    """

    tokenizer: Tokenizer
    skip_special_tokens: bool = True
    prefix_offset: int = 0  # first context token
    read_offset: int = 0  # first token whose text may not be final
    num_reported: int = 0  # characters of the not-final tail already reported
    _context_ids: list[int] = field(default_factory=list, repr=False)  # ids[prefix_offset:read_offset]

    def peek(self, ids: list[int]) -> str:
        """Text that :meth:`advance` would report now (without ``complete``), leaving the state alone."""
        tail, _ = self._tail(ids, complete=False)
        return tail[self.num_reported :]

    def advance(self, ids: list[int], complete: bool = False) -> str:
        """Text added since the last call; ``complete``: no more tokens follow, report everything."""
        tail, final = self._tail(ids, complete)
        new = tail[self.num_reported :]
        if not final:
            self.num_reported = len(tail)
            return new
        if tail:  # a context whose text is empty would not hold the first-token treatment
            self.prefix_offset = self.read_offset
        self.read_offset = len(ids)
        self.num_reported = 0
        self._context_ids = list(ids[self.prefix_offset : self.read_offset])
        return new

    def _tail(self, ids: list[int], complete: bool) -> tuple[str, bool]:
        """(text of ``ids[read_offset:]``, whether it is final)."""
        if ids[self.prefix_offset : self.read_offset] != self._context_ids:
            raise ValueError("token ids must extend the ids decoded before")
        decode = self.tokenizer.decode
        context = decode(self._context_ids, skip_special_tokens=self.skip_special_tokens)
        text = decode(ids[self.prefix_offset :], skip_special_tokens=self.skip_special_tokens)
        tail = text[len(context) :]
        if not complete and tail.endswith(_INCOMPLETE):
            return tail.rstrip(_INCOMPLETE), False
        return tail, True


@dataclass
class IncrementalDetokenizer:
    """Keeps a request's output text up to date and finds stop strings in newly produced text.

    Each step decodes only the tokens since the last stable point (:class:`DecodeWindow`) and searches for
    stop strings only where one could newly end, so a step costs the same at the thousandth token as at the
    first. The text equals decoding all output tokens at once.

    ``text`` is the text released to the caller so far. While the request runs, a tail of the decoded text
    that could be the start of a stop string is held back: if the stop string then completes, released text
    would otherwise have to be taken back, and streamed deltas would no longer add up to the final text.
    """

    tokenizer: Tokenizer
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    text: str = ""
    _held: str = field(default="", repr=False)  # decoded text after ``text`` that may start a stop string
    _window: DecodeWindow = field(init=False, repr=False)
    _max_stop: int = field(init=False, repr=False)  # length of the longest stop string

    def __post_init__(self) -> None:
        self._window = DecodeWindow(self.tokenizer, self.skip_special_tokens)
        self._max_stop = max((len(s) for s in self.stop), default=0)

    def update(self, output_token_ids: list[int], finished: bool = False) -> tuple[str, bool]:
        """Decode the new tokens; returns (text released since the last call, whether a stop string was found).

        ``output_token_ids``: all output tokens so far (extending those of the last call). ``finished``: the
        request ends with these tokens (length or stop token), so nothing is held back.
        """
        new = self._window.advance(output_token_ids, complete=finished)
        start, searched = self._search_text(new)
        unreleased = self._held + new
        hit = self._find_stop(searched)
        if hit is not None:
            index, stop = hit
            end = index + len(stop) if self.include_stop_str_in_output else index
            released = searched[len(self.text) - start : end]  # a stop never starts in released text
            self.text += released
            self._held = ""
            return released, True
        held = 0 if finished else self._held_back(searched)
        released = unreleased[: len(unreleased) - held]
        self._held = unreleased[len(released) :]
        self.text += released
        return released, False

    def finds_stop(self, output_token_ids: list[int]) -> bool:
        """Whether these tokens complete a stop string (no state change). Lets the engine stop in the middle
        of a speculative round, at the same token as plain decoding would."""
        if not self.stop:
            return False
        _, searched = self._search_text(self._window.peek(output_token_ids))
        return self._find_stop(searched) is not None

    def _search_text(self, new: str) -> tuple[int, str]:
        """(offset in the whole text, text) where a stop string could end in ``new``: the decoded text from
        ``max(len(stop)) - 1`` characters before ``new`` on. Held-back text is shorter than that, so the offset
        is never past the released text."""
        start = max(0, len(self.text) + len(self._held) - self._max_stop + 1) if self.stop else len(self.text)
        return start, self.text[start:] + self._held + new

    def _find_stop(self, searched: str) -> tuple[int, str] | None:
        """The earliest stop string in ``searched`` (index into it); ties go to the smaller string."""
        if not self.stop:
            return None
        hits = [(searched.find(s), s) for s in self.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        return min(hits) if hits else None

    def _held_back(self, text: str) -> int:
        """Length of the longest tail of ``text`` that is a proper prefix of some stop string."""
        longest = 0
        for stop in self.stop:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:n]):
                    longest = n
                    break
        return longest
