"""Prompt lookup (ssd/speculative/lookup.py): exact proposals, the incremental index, and how drafts use it."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from ssd.config import SpeculativeConfig
from ssd.outputs import SpecStats
from ssd.sampling_params import SamplingParams
from ssd.speculative.drafting import DraftDistribution
from ssd.options import LookupConfig
from ssd.speculative.lookup import MAX_CANDIDATES, PromptLookup, copied_run, new_lookup
from ssd.speculative.async_draft.wire.protocol import SpeculationMsg, decode_message


def reference(context: list[int], min_n: int, max_n: int) -> int | None:
    """Brute force: for n = max_n down to min_n, the token after the most recent earlier occurrence of the
    last n tokens."""
    for n in range(min(max_n, len(context) - 1), min_n - 1, -1):
        suffix = context[len(context) - n :]
        for start in range(len(context) - n - 1, -1, -1):
            if context[start : start + n] == suffix:
                return context[start + n]
    return None


@pytest.mark.parametrize(
    "tokens, tail, expected",
    [
        ([1, 2, 3, 9, 1, 2], (), 3),  # "1 2" was followed by 3
        ([1, 2, 3, 9, 1], (2,), 3),  # the suffix straddles tokens and tail
        ([5, 1, 2, 7, 6, 1, 2, 8, 5, 1], (2,), 7),  # the longer match (5 1 2) wins over the more recent (1 2)
        ([1, 2, 7, 1, 2, 8, 1], (2,), 8),  # equal matches: the most recent
        ([1, 2, 3, 4], (), None),  # the suffix never occurred before
        ([4, 4, 4], (), 4),  # overlapping occurrence
        ([7], (), None),
        ([], (1, 2, 3, 1, 2), 3),  # everything in the tail
    ],
)
def test_proposals(tokens, tail, expected):
    assert PromptLookup(list(tokens), min_n=2, max_n=8).propose(tail) == expected


def test_min_n_and_max_n():
    tokens = [3, 1, 2, 7, 1, 2]
    assert PromptLookup(tokens, min_n=3, max_n=8).propose() is None  # only a 2-token match exists
    assert PromptLookup(tokens, min_n=1, max_n=1).propose() == 7  # "2" -> 7
    # max_n caps the comparison: beyond it, the more recent of two matches wins
    tokens = [9, 9, 1, 2, 5, 0, 9, 1, 2, 6, 9, 9, 1, 2]
    assert PromptLookup(list(tokens), min_n=2, max_n=3).propose() == 6
    assert PromptLookup(list(tokens), min_n=2, max_n=4).propose() == 5


def test_index_grows_with_the_token_list_and_matches_brute_force():
    rng = random.Random(0)
    tokens: list[int] = []
    lookup = PromptLookup(tokens, min_n=2, max_n=6)  # shares the list, as with a sequence's tokens
    for _ in range(600):
        tokens.append(rng.choice([rng.randrange(6), rng.randrange(40)]))  # many repeats, some novelties
        tail = [rng.randrange(6) for _ in range(rng.randrange(5))]
        assert lookup.propose(tail) == reference(tokens + tail, 2, 6)


def test_candidates_are_bounded_most_recent_first():
    tokens = [1, 2, 3] * (3 * MAX_CANDIDATES) + [1, 2]
    assert PromptLookup(tokens).propose() == 3  # a long repetitive context still answers (and quickly)


def test_config_validation_and_disabled():
    assert new_lookup(LookupConfig(enabled=False), [1, 2, 1, 2]) is None
    assert new_lookup(LookupConfig(), [1, 2, 3, 1, 2]).propose() == 3
    for bad in (dict(min_n=0), dict(min_n=3, max_n=2), dict(min_n=1.5)):
        with pytest.raises(ValueError, match="prompt_lookup"):
            LookupConfig(**bad)
    with pytest.raises(ValueError, match="prompt_lookup_max"):
        SpeculativeConfig(model="draft", prompt_lookup_min=4, prompt_lookup_max=3)
    assert SpeculativeConfig(model="draft", prompt_lookup=False).lookup == LookupConfig(False, 2, 8)


def test_forced_drafts_are_one_hot_and_draws_advance_generators_alike():
    """A forced row proposes its token with q one-hot at it (so verification stays exact); every generator
    advances exactly as without forcing, so the other rows' draws do not change."""
    dist = DraftDistribution(target_vocab_size=10, num_usable_tokens=10)
    logits = torch.randn(3, 10, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.0), SamplingParams(temperature=0.7)]

    def draw(forced):
        gens = [torch.Generator().manual_seed(10 + i) for i in range(3)]
        tokens, probs = dist.draw(logits, params, gens, None, forced=forced)
        return tokens, probs, [torch.rand(1, generator=g).item() for g in gens]  # the next draw of each

    free_tokens, free_probs, free_next = draw(None)
    tokens, probs, next_draws = draw([7, None, 2])
    assert tokens.tolist() == [7, free_tokens[1].item(), 2]
    assert next_draws == free_next
    assert torch.equal(probs[0], torch.nn.functional.one_hot(torch.tensor(7), 10).float())
    assert torch.equal(probs[2], torch.nn.functional.one_hot(torch.tensor(2), 10).float())
    assert torch.equal(probs[1], free_probs[1])
    greedy_tokens, greedy_probs = dist.draw(logits, [SamplingParams(temperature=0.0)] * 3, [None] * 3,
                                            torch.Generator().manual_seed(0), forced=[None, 4, None])
    assert greedy_probs is None and greedy_tokens.tolist() == [logits[0].argmax().item(), 4, logits[2].argmax().item()]


def test_spec_stats_count_copied_drafts():
    stats = SpecStats()
    stats.record_round(3, 1, [True, True, False])  # the first copy was accepted, the second rejected
    stats.record_round(2, 2, [False, True])
    stats.record_round(2, 0)  # a proposer that does not say
    assert (stats.num_copied_tokens, stats.num_accepted_copied_tokens) == (3, 2)


def test_speculation_message_carries_copied_flags():
    msg = SpeculationMsg(3, np.array([[5, 6], [7, 8]]), [True, False], [0, 1], [], np.zeros((0, 2, 4), np.float32),
                         copied=np.array([[True, False], [False, True]]))
    again = decode_message(msg.pack())
    assert again.copied.tolist() == [[True, False], [False, True]]
    plain = SpeculationMsg(3, np.array([[5, 6]]), [True], [0], [], np.zeros((0, 2, 4), np.float32))
    assert plain.copied.tolist() == [[False, False]]  # not given: nothing was copied
    with pytest.raises(Exception, match="copied"):
        SpeculationMsg(3, np.array([[5, 6]]), [True], [0], [], np.zeros((0, 2, 4), np.float32),
                       copied=np.array([[True]]))


def test_copied_run_copies_until_no_match_or_limit():
    tokens = [5, 6, 7, 8, 9, 1, 5, 6]  # the suffix 5 6 occurred before, followed by 7 8 9 1 5 6 ...
    lookup = PromptLookup(tokens, min_n=2, max_n=8)
    assert copied_run(lookup, 3) == [7, 8, 9]
    assert copied_run(lookup, 0) == []
    assert copied_run(PromptLookup([1, 2, 3, 4]), 5) == []  # no earlier match
    assert copied_run(None, 4) == []  # prompt lookup off


class _CountingRunner:
    """Stands in for a draft ModelRunner: records each forward's items, returns logits favouring token 7."""

    device = torch.device("cpu")

    def __init__(self) -> None:
        self.calls: list[list[tuple[list[int], int]]] = []

    def forward(self, items):
        self.calls.append([(list(item.token_ids), item.start_pos) for item in items])
        logits = torch.zeros(len(items), 16)
        logits[:, 7] = 5.0
        return logits


def test_copied_drafts_skip_the_draft_forward():
    """A copy is known before its step, so that step runs no draft forward for its row: a row whose drafts are
    all copies runs none (its K/V stays where it was); a drawn draft that prompt lookup then continues leaves
    the copies, and the draft before them, for the row's next forward (next round's catch-up)."""
    from ssd.core.sequence import Sequence
    from ssd.speculative.drafting import draft_sequentially

    greedy = SamplingParams(temperature=0.0)
    repeating = Sequence(0, [1, 2, 3, 4, 1, 2, 3, 4, 1, 2], greedy)  # lookup copies 3, 4, 1, ...
    novel = Sequence(1, [1, 7, 3, 9, 1], greedy)  # no match until the draft draws 7: then (1, 7) -> 3 -> 9
    for seq in (repeating, novel):
        seq.num_computed_tokens = seq.num_tokens - 1  # the pending token is the last one
    runner = _CountingRunner()
    drafts = draft_sequentially(runner, [repeating, novel], [3, 3], [None, None], DraftDistribution(16, 16), None,
                                lookups=[PromptLookup(repeating.token_ids), PromptLookup(novel.token_ids)])
    assert drafts.tokens.tolist() == [[3, 4, 1], [7, 3, 9]]
    assert drafts.copied.tolist() == [[True, True, True], [False, True, True]]
    assert drafts.probs.argmax(-1).tolist() == [[3, 4, 1], [7, 3, 9]] and torch.all(drafts.probs.sum(-1) == 1)
    assert runner.calls == [[([1], 4)]]  # one forward: the novel row's pending token; copies need none
    assert drafts.computed == [9, 5]  # K/V held: neither row's drafts (7 and the copies wait)
    assert repeating.num_computed_tokens == 9 and novel.num_computed_tokens == 5
