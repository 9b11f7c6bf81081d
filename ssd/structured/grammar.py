"""Grammar state per sequence, compiled with llguidance against the model's tokenizer.

llguidance was chosen by measurement (``bench/structured_masks.py``, ``bench/results/structured_masks.json``):
at the default target's 49,152-token vocabulary it computes a mask in 0.01-0.07 ms a token (mean; xgrammar
0.001-0.007 ms, outlines-core 0.001-0.04 ms), all under 1% of a decode step; it installs as one wheel without
dependencies (xgrammar pulls triton and a TVM runtime), and it compiles JSON schemas, regexes, Lark / GBNF
grammars and choices alike, with rollback, which speculation needs.

A :class:`Grammar` follows the tokens a sequence has emitted. Verification asks it for the mask of every
position of a round (:meth:`Grammar.masks_along`: the state after each prefix of the drafts, rolled back
afterwards; a draft step asks :meth:`Grammar.mask_after` for one), and the engine then advances it by the tokens
the round emitted (:meth:`Grammar.advance`). Masks are memoised until the next advance, so a round's verification
reuses its draft steps' masks; callers must not modify the tensors they get.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import Any

import torch

from ssd.structured.bitmask import bitmask_width
from ssd.structured.spec import StructuredOutputs
from ssd.tokenizer import Tokenizer


class GrammarCompiler:
    """Compiles :class:`StructuredOutputs` for one tokenizer. llguidance is imported, and the tokenizer loaded and
    converted (~0.3 s), at the first compile: an engine or draft worker that never sees a constraint pays nothing."""

    def __init__(self, load_tokenizer: Callable[[], Tokenizer], vocab_size: int) -> None:
        self._load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size
        self._lltokenizer: Any = None
        self._eos_token_id: int | None = None

    @classmethod
    def for_tokenizer(cls, tokenizer: Tokenizer, vocab_size: int) -> GrammarCompiler:
        return cls(lambda: tokenizer, vocab_size)

    @classmethod
    def for_folder(cls, path: str, vocab_size: int) -> GrammarCompiler:
        """The tokenizer is read from ``path`` at the first compile (a draft worker's view of the target's)."""
        return cls(lambda: Tokenizer(path), vocab_size)

    def _tokenizer(self) -> Any:
        if self._lltokenizer is None:
            import llguidance.hf

            tokenizer = self._load_tokenizer()
            self._eos_token_id = tokenizer.eos_token_id
            self._lltokenizer = llguidance.hf.from_tokenizer(
                tokenizer.hf_tokenizer, n_vocab=self.vocab_size, eos_token=self._eos_token_id
            )
        return self._lltokenizer

    def compile(self, spec: StructuredOutputs) -> Grammar:
        """A fresh grammar state for one sequence; ``ValueError`` naming the problem if it does not compile."""
        import llguidance

        if spec.kind in ("json", "json_object"):
            options = {"whitespace_flexible": False} if spec.disable_any_whitespace else None
            try:
                text = llguidance.LLMatcher.grammar_from_json_schema(spec.schema_text(), overrides=options)
            except ValueError as exc:
                raise ValueError(f"structured outputs: the {spec.kind} schema is not valid: {exc}") from exc
        elif spec.kind == "regex":
            text = llguidance.grammar_from("regex", spec.regex)
        elif spec.kind == "grammar":
            text = llguidance.grammar_from("grammar", spec.grammar)
        else:
            text = llguidance.grammar_from("choice", json.dumps(list(spec.choice or ())))
        matcher = llguidance.LLMatcher(self._tokenizer(), text, log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured outputs: the {spec.kind} does not compile: {matcher.get_error().strip()}")
        return Grammar(matcher, self.vocab_size, self._eos_token_id)


class Grammar:
    """One sequence's grammar state: which tokens may come next, advanced token by token."""

    def __init__(self, matcher: Any, vocab_size: int, eos_token_id: int | None) -> None:
        self._matcher = matcher
        self.width = bitmask_width(vocab_size)
        self._eos_token_id = eos_token_id
        # masks computed since the last advance, by the drafts they follow: a round's verification reuses its
        # draft steps' masks, and a cache build's branches their shared prefixes'
        self._memo: dict[tuple[int, ...], torch.Tensor] = {}

    def masks_along(self, drafts: list[int]) -> torch.Tensor:
        """``[len(drafts) + 1, width]`` int32 bitmasks: row j allows the tokens that may follow ``drafts[:j]``.

        The state is left where it was. Rows past the first draft the grammar refuses repeat that position's mask:
        the refused draft is rejected there (the target's masked probability of it is 0), so later rows are never
        used, but they stay valid distributions.
        """
        valid = self._valid_prefix(drafts)
        rows = self._masks(drafts, range(valid + 1))
        return torch.stack(rows + [rows[-1]] * (len(drafts) - valid))

    def mask_after(self, drafts: list[int]) -> torch.Tensor:
        """``[width]``: the tokens that may follow ``drafts`` (or their longest prefix the grammar allows); the
        state is left where it was. What a draft step masks its next draft with."""
        return self._masks(drafts, [self._valid_prefix(drafts)])[0]

    def _valid_prefix(self, drafts: list[int]) -> int:
        """How many leading drafts the grammar allows, stopping at an EOS: nothing follows one, and an EOS consumed
        once the grammar has stopped is not recorded by llguidance (rolling back over it would undo one token too
        many)."""
        valid = self._matcher.validate_tokens(drafts) if drafts else 0
        if self._eos_token_id in drafts[:valid]:
            valid = drafts.index(self._eos_token_id)
        return valid

    def _masks(self, drafts: list[int], ends: Iterable[int]) -> list[torch.Tensor]:
        """The masks after ``drafts[:j]`` for each j in ``ends`` (allowed prefixes), computed where not memoised by
        walking the drafts and rolling back."""
        ends = list(ends)
        missing = [j for j in ends if tuple(drafts[:j]) not in self._memo]
        if missing:
            last = max(missing)
            for j in range(last + 1):
                if j in missing:
                    mask = torch.empty(self.width, dtype=torch.int32)
                    self._fill(mask)
                    self._memo[tuple(drafts[:j])] = mask
                if j < last and not self._matcher.consume_token(drafts[j]):
                    raise RuntimeError(f"grammar refused draft {drafts[j]} it had validated: {self._matcher.get_error()}")
            if last:
                self._matcher.rollback(last)
        return [self._memo[tuple(drafts[:j])] for j in ends]

    def advance(self, token: int) -> bool:
        """Advance by an emitted token; True once the grammar is complete (the request ends there)."""
        if not self._matcher.consume_token(token):  # cannot happen: every emitted token comes from a masked row
            raise RuntimeError(f"emitted token {token} breaks the grammar: {self._matcher.get_error()}")
        self._memo.clear()
        return self.terminated

    @property
    def terminated(self) -> bool:
        """The grammar is complete and allows nothing but EOS: the request ends here."""
        return bool(self._matcher.is_stopped())

    def _fill(self, row: torch.Tensor) -> None:
        self._matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())

