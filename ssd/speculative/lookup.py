"""Prompt lookup: propose the token that followed an earlier occurrence of the context's last tokens.

Code, and answers that quote their question, repeat spans of their own context; a small draft model copies
them poorly. A :class:`PromptLookup` watches one sequence's token list and, given the tokens drafted after it
so far (the *tail*), finds the earlier position whose preceding tokens match the context's suffix longest
(at least ``min_n``, counted up to ``max_n``; the most recent such position on ties) and proposes the token
found there. The drafting code uses the proposal instead of the draft model's token, with a one-hot q: the
decision depends only on the context, never on a random draw, so speculative sampling stays exact.

The index maps every ``min_n``-gram of the sequence to the positions that follow it and grows as the
sequence does; a lookup costs a dictionary probe, a short scan of the tail, and at most ``max_n``
comparisons per candidate position (the most recent :data:`MAX_CANDIDATES`).
"""

from __future__ import annotations

from collections.abc import Sequence

from ssd.options import LookupConfig

MAX_CANDIDATES = 64  # earlier occurrences of the min_n-gram examined per lookup, most recent first


def new_lookup(config: LookupConfig, tokens: list[int]) -> "PromptLookup | None":
    """A lookup over ``tokens`` (kept by reference: appended tokens are seen), or None where ``config`` turns
    prompt lookup off."""
    return PromptLookup(tokens, config.min_n, config.max_n) if config.enabled else None


def copied_token(lookup: "PromptLookup | None", tail: Sequence[int] = ()) -> int | None:
    """``lookup.propose(tail)``, or None where prompt lookup is off (no lookup)."""
    return None if lookup is None else lookup.propose(tail)


def copied_run(lookup: "PromptLookup | None", limit: int) -> list[int]:
    """Up to ``limit`` tokens copied one after another (each lookup sees the copies before it), stopping at the
    first position without an earlier match; empty where prompt lookup is off."""
    tokens: list[int] = []
    while len(tokens) < limit and (token := copied_token(lookup, tokens)) is not None:
        tokens.append(token)
    return tokens


class PromptLookup:
    def __init__(self, tokens: list[int], min_n: int = 2, max_n: int = 8) -> None:
        self.tokens = tokens  # shared with the sequence; only ever appended to
        self.min_n = min_n
        self.max_n = max_n
        self._index: dict[tuple[int, ...], list[int]] = {}  # n-gram -> positions of the token after it
        self._indexed = 0  # tokens seen by the index

    def _catch_up(self) -> None:
        tokens, n = self.tokens, self.min_n
        for end in range(max(self._indexed, n), len(tokens)):  # tokens[end-n:end] is followed by tokens[end]
            self._index.setdefault(tuple(tokens[end - n : end]), []).append(end)
        self._indexed = len(tokens)

    def propose(self, tail: Sequence[int] = ()) -> int | None:
        """The token predicted after ``tokens + tail``, or None when the suffix never occurred before."""
        self._catch_up()
        base, n = self.tokens, self.min_n
        num_base = len(base)
        length = num_base + len(tail)
        if length <= n:
            return None

        def at(i: int) -> int:
            return base[i] if i < num_base else tail[i - num_base]

        key = tuple(at(i) for i in range(length - n, length))
        # Positions whose n-gram straddles into the tail are not in the index: scan them (the tail is short).
        recent = [end for end in range(length - 1, max(n, num_base) - 1, -1)
                  if all(at(end - n + j) == key[j] for j in range(n))]
        room = MAX_CANDIDATES - len(recent)
        indexed = self._index.get(key, [])
        candidates = recent + indexed[-room:][::-1] if room > 0 else recent[:MAX_CANDIDATES]
        best_end, best_len = -1, 0
        for end in candidates:
            matched = n
            while matched < self.max_n and end - matched - 1 >= 0 and at(end - matched - 1) == at(length - matched - 1):
                matched += 1
            if matched > best_len:  # candidates run most recent first: ties keep the more recent one
                best_end, best_len = end, matched
                if matched == self.max_n:
                    break
        return at(best_end) if best_end >= 0 else None
