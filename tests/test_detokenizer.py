"""Incremental detokenization (ssd.tokenizer.IncrementalDetokenizer / DecodeWindow) on a real byte-level BPE.

The tiny test tokenizer knows only ASCII merges, so emoji and CJK characters become 3-4 single-byte tokens:
every multi-byte character is split across tokens, which is the case the window must wait on. Random token
ids add invalid UTF-8 (lone continuation bytes) and special tokens in the middle of the output.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass, field

import pytest

from ssd.tokenizer import DecodeWindow, IncrementalDetokenizer, Tokenizer

TEXTS = [
    "The quick brown fox 🦊 jumps over the lazy dog.",
    "日本語のテキスト and English, mixed: 你好，世界！",
    "emoji run 🙂🙃😀👍🏽 then ascii",
    "accents: café naïve über ça — “quotes” …",
]


@pytest.fixture(scope="module")
def tokenizer(checkpoint_factory) -> Tokenizer:
    return Tokenizer(checkpoint_factory("llama"))


class CountingTokenizer:
    """Forwards to a tokenizer and records how many ids each decode call was given."""

    def __init__(self, inner: Tokenizer) -> None:
        self.inner = inner
        self.lengths: list[int] = []

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        self.lengths.append(len(token_ids))
        return self.inner.decode(token_ids, skip_special_tokens=skip_special_tokens)


@dataclass
class FullRedecodeReference:
    """The previous implementation (decode everything each step), kept as the oracle the window must match."""

    tokenizer: Tokenizer
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    text: str = ""
    decoded: str = ""

    def update(self, ids: list[int], finished: bool = False) -> tuple[str, bool]:
        full = self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
        if not finished and full.endswith("\ufffd"):
            full = full.rstrip("\ufffd")
        stopped = False
        if self.stop:
            search_from = max(0, len(self.decoded) - max(len(s) for s in self.stop) + 1)
            hits = [(i, s) for i, s in ((full.find(s, search_from), s) for s in self.stop) if i >= 0]
            if hits:
                index, stop = min(hits)
                full = full[: index + len(stop)] if self.include_stop_str_in_output else full[:index]
                stopped = True
        self.decoded = full
        held = 0
        if not (stopped or finished):
            for stop in self.stop:
                for n in range(min(len(stop) - 1, len(full)), held, -1):
                    if full.endswith(stop[:n]):
                        held = n
                        break
        release = full[: len(full) - held]
        previous, self.text = self.text, release
        return (release[len(previous) :] if release.startswith(previous) else release), stopped


def _random_ids(tokenizer: Tokenizer, rng: random.Random) -> list[int]:
    """Encoded multi-byte text, with random ids (any byte, special tokens) spliced in."""
    ids = tokenizer.encode(rng.choice(TEXTS))
    for _ in range(rng.randint(0, 6)):
        ids.insert(rng.randint(0, len(ids)), rng.randrange(len(tokenizer)))
    return ids


def _chunks(ids: list[int], rng: random.Random) -> list[int]:
    """Prefix lengths at which the engine would call update: 1 token a step, or several (speculative round)."""
    ends, n = [], 0
    while n < len(ids):
        n = min(len(ids), n + rng.choice([1, 1, 1, 2, 3, 5]))
        ends.append(n)
    return ends


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_text_equals_full_decode_for_random_sequences(tokenizer: Tokenizer, skip_special_tokens: bool) -> None:
    rng = random.Random(0)
    for _ in range(60):
        ids = _random_ids(tokenizer, rng)
        detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
        deltas = []
        ends = _chunks(ids, rng)
        for end in ends:
            delta, stopped = detok.update(ids[:end], finished=end == len(ids))
            assert not stopped
            deltas.append(delta)
            if end < len(ids):
                assert not delta.endswith("\ufffd")  # a split character is not released half-decoded
        expected = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        assert detok.text == expected
        assert "".join(deltas) == expected


def test_multibyte_characters_wait_for_their_last_byte(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("a🙂b")
    assert len(ids) >= 6  # a, 4 bytes of the emoji, b: the emoji is split across tokens
    detok = IncrementalDetokenizer(tokenizer)
    deltas = [detok.update(ids[:end])[0] for end in range(1, len(ids) + 1)]
    assert deltas[0] == "a"
    assert all(d == "" for d in deltas[1:4])  # emoji incomplete: nothing released, no U+FFFD
    assert deltas[4] == "🙂"
    assert "".join(deltas) == "a🙂b"


def test_incomplete_character_at_the_end_is_reported_when_finished(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("x🙂")[:-1]  # the emoji's last byte never comes
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.update(ids)[0] == "x"
    delta, _ = detok.update(ids, finished=True)
    assert detok.text == tokenizer.decode(ids) and delta.endswith("\ufffd")


@pytest.mark.parametrize("include", [False, True])
def test_matches_full_redecode_step_by_step_with_stop_strings(tokenizer: Tokenizer, include: bool) -> None:
    """Same deltas, same stop decisions, same text at every step as decoding everything each step."""
    rng = random.Random(1)
    candidates = ["fox", "o", "🙂", "本語", "lazy dog", "the", ", ", "xyz", "ü"]
    for _ in range(80):
        ids = _random_ids(tokenizer, rng)
        stop = rng.sample(candidates, rng.randint(1, 3))
        detok = IncrementalDetokenizer(tokenizer, stop, include)
        reference = FullRedecodeReference(tokenizer, stop, include)
        for end in _chunks(ids, rng):
            finished = end == len(ids)
            assert detok.finds_stop(ids[:end]) == _reference_finds_stop(reference, ids[:end])
            got = detok.update(ids[:end], finished)
            assert got == reference.update(ids[:end], finished)
            assert detok.text == reference.text
            if got[1] or finished:
                break


def _reference_finds_stop(reference: FullRedecodeReference, ids: list[int]) -> bool:
    """finds_stop of the old implementation: an update on a copy of the reference."""
    return dataclasses.replace(reference).update(ids)[1]


def test_stop_string_cuts_the_text(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("The quick brown fox jumps")
    for include, expected in ((False, "The quick "), (True, "The quick brown")):
        detok = IncrementalDetokenizer(tokenizer, ["brown", "zebra"], include)
        deltas, stopped = [], False
        for end in range(1, len(ids) + 1):
            delta, stopped = detok.update(ids[:end])
            deltas.append(delta)
            if stopped:
                break
        assert stopped and detok.text == expected and "".join(deltas) == expected


def test_stop_prefix_is_held_back_then_released(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("one two three")
    detok = IncrementalDetokenizer(tokenizer, ["two four"])
    released = [detok.update(ids[:end])[0] for end in range(1, len(ids) + 1)]
    assert not detok.text.endswith("two")  # "two" could start "two four": held back while running
    delta, stopped = detok.update(ids, finished=True)
    assert not stopped and detok.text == "one two three" and "".join(released) + delta == "one two three"


def test_stop_string_split_inside_a_multibyte_character(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("ab🙂cd")
    detok = IncrementalDetokenizer(tokenizer, ["🙂"])
    for end in range(1, len(ids) + 1):
        _, stopped = detok.update(ids[:end])
        if stopped:
            break
    assert stopped and detok.text == "ab"


def test_finds_stop_leaves_state_alone(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("hello brown fox")
    detok = IncrementalDetokenizer(tokenizer, ["fox"])
    detok.update(ids[:2])
    before = (detok.text, detok._held, detok._window.read_offset, detok._window.prefix_offset)
    assert detok.finds_stop(ids)
    assert (detok.text, detok._held, detok._window.read_offset, detok._window.prefix_offset) == before
    released = detok.text
    delta, stopped = detok.update(ids)
    assert stopped and released + delta == detok.text == "hello brown "


def test_each_step_decodes_a_bounded_window(tokenizer: Tokenizer) -> None:
    counting = CountingTokenizer(tokenizer)
    ids = tokenizer.encode(" ".join(TEXTS) * 8)
    assert len(ids) > 500
    detok = IncrementalDetokenizer(counting, ["never appears"])  # type: ignore[arg-type]
    for end in range(1, len(ids) + 1):
        detok.update(ids[:end], finished=end == len(ids))
        detok.finds_stop(ids[:end])
    assert detok.text == tokenizer.decode(ids)
    assert max(counting.lengths) <= 10  # a 4-byte character plus context, never the whole output


def test_ids_that_do_not_extend_the_previous_ones_are_refused(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("The quick brown fox")
    window = DecodeWindow(tokenizer)
    window.advance(ids[:5])
    with pytest.raises(ValueError, match="extend"):
        window.advance(ids[:2])
    with pytest.raises(ValueError, match="extend"):
        window.advance([ids[0] + 1, *ids[1:]])


def test_engine_output_text_equals_decode_of_its_tokens(checkpoint_factory, tokenizer: Tokenizer) -> None:
    """End to end: random sampling emits byte tokens (split and invalid UTF-8) and special tokens."""
    from ssd import LLM, SamplingParams

    llm = LLM(str(checkpoint_factory("llama")), dtype="float32", kv_cache_memory="8MiB", max_model_len=256, seed=0)
    try:
        params = SamplingParams(max_tokens=64, temperature=1.5, seed=3, ignore_eos=True)
        outputs = llm.generate(["日本 🙂 fox", "The quick"], params)
    finally:
        llm.shutdown()
    for out in outputs:
        assert len(out.token_ids) == 64
        assert out.text == tokenizer.decode(out.token_ids)
