"""DraftDistribution: the draft-side shortcuts (greedy argmax and top candidates on the draft's own columns)
agree exactly with the definition over the target vocabulary (``masked_logits``), and ``draw`` samples from
exactly the distribution it returns while advancing generators like ``sample``."""

from __future__ import annotations

import pytest
import torch

from ssd.sample.sampler import SamplingTensors, processed_probs, sample
from ssd.sampling_params import SamplingParams
from ssd.speculative.drafting import DraftDistribution

TARGET_VOCAB = 64
USABLE = 60  # target ids 60..63 can never be proposed


def reduced() -> DraftDistribution:
    """A 12-id draft vocabulary in scrambled target order, with one id without a target (-1) and one
    mapping to an unusable target id."""
    draft_to_target = torch.tensor([41, 3, 17, -1, 59, 8, 62, 0, 33, 25, 12, 50])
    return DraftDistribution(TARGET_VOCAB, USABLE, draft_to_target)


def ordered() -> DraftDistribution:
    """A reduced vocabulary whose proposable ids come first, in ascending target order (as one built from target
    ids in order is): its columns are read as a slice, without a copy."""
    draft_to_target = torch.tensor([0, 3, 8, 12, 17, 25, 33, 41, 50, 59, 62, -1])
    dist = DraftDistribution(TARGET_VOCAB, USABLE, draft_to_target)
    assert dist._columns == slice(0, 10)
    return dist


def full() -> DraftDistribution:
    """A draft with the target's vocabulary but a shorter embedding (the rest is padding)."""
    return DraftDistribution(TARGET_VOCAB, USABLE)


@pytest.mark.parametrize("make, width", [(reduced, 12), (ordered, 12), (full, 62)])
def test_greedy_tokens_equal_argmax_of_masked_logits(make, width):
    dist = make()
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(50, width, generator=gen)
    logits[:10] = torch.randint(0, 3, (10, width), generator=gen).float()  # many ties: lowest target id wins
    masked = dist.masked_logits(logits)  # [N, V]
    assert torch.equal(dist.greedy_tokens(logits), masked.argmax(dim=-1))
    assert (dist.greedy_tokens(logits) < USABLE).all()


@pytest.mark.parametrize("make, width", [(reduced, 12), (ordered, 12), (full, 62)])
def test_top_tokens_equal_topk_of_masked_logits(make, width):
    dist = make()
    logits = torch.randn(20, width, generator=torch.Generator().manual_seed(1))  # distinct values
    masked = dist.masked_logits(logits)
    for n in (1, 3, 5):
        assert torch.equal(dist.top_tokens(logits, n), torch.topk(masked, n, dim=-1).indices)
    proposable = int(torch.isfinite(masked[0]).sum())
    assert dist.top_tokens(logits, 100).shape == (20, proposable)  # never an id that cannot be proposed


def test_draw_all_greedy_skips_probs_and_advances_generators_like_sample():
    dist = reduced()
    logits = torch.randn(3, 12, generator=torch.Generator().manual_seed(2))
    params = [SamplingParams(temperature=0.0)] * 3
    gens = [torch.Generator().manual_seed(s) for s in (5, 6, 7)]
    twins = [torch.Generator().manual_seed(s) for s in (5, 6, 7)]
    tokens, probs = dist.draw(logits, params, gens, None)
    assert probs is None
    masked = dist.masked_logits(logits)
    expected = sample(processed_probs(masked, SamplingTensors.from_params(params, "cpu")), twins,
                      torch.ones(3, dtype=torch.bool))
    assert torch.equal(tokens, expected)
    for g, t in zip(gens, twins):
        assert torch.equal(g.get_state(), t.get_state())


def test_draw_mixed_batch_samples_from_the_returned_probs():
    dist = reduced()
    logits = torch.randn(4, 12, generator=torch.Generator().manual_seed(3))
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, seed=1),
              SamplingParams(temperature=1.2, top_k=3), SamplingParams(temperature=0.0)]
    gens = [torch.Generator().manual_seed(s) for s in range(4)]
    twins = [torch.Generator().manual_seed(s) for s in range(4)]
    tokens, probs = dist.draw(logits, params, gens, None)
    st = SamplingTensors.from_params(params, "cpu")
    expected_probs = processed_probs(dist.masked_logits(logits), st)
    assert torch.allclose(probs, expected_probs)
    assert torch.equal(tokens, sample(expected_probs, twins, st.greedy))
    assert (probs[:, USABLE:] == 0).all()
    assert all(probs[i, t] > 0 for i, t in enumerate(tokens.tolist()))
    for i in (0, 3):
        assert tokens[i] == dist.greedy_tokens(logits[i : i + 1])[0]


def test_draw_applies_the_adjust_hook():
    dist = reduced()
    logits = torch.randn(2, 12, generator=torch.Generator().manual_seed(4))
    params = [SamplingParams(temperature=1.0, seed=3)] * 2
    forced = torch.zeros(2, TARGET_VOCAB)
    forced[:, 33] = 1.0  # the hook puts all mass on target id 33 (draft id 8)
    tokens, probs = dist.draw(logits, params, [None, None], torch.Generator().manual_seed(0),
                              adjust=lambda lg, pr: forced)
    assert tokens.tolist() == [33, 33] and torch.equal(probs, forced)


@pytest.mark.parametrize("make, width", [(reduced, 12), (ordered, 12), (full, 62)])
def test_token_probs_equal_the_softmax_of_masked_logits(make, width):
    dist = make()
    logits = torch.randn(6, width, generator=torch.Generator().manual_seed(2))
    probs = torch.softmax(dist.masked_logits(logits), dim=-1)  # [N, V], 0 where the draft cannot propose
    tokens = torch.randint(0, TARGET_VOCAB, (6, 5), generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(dist.token_probs(logits, tokens), probs.gather(1, tokens), rtol=1e-5, atol=1e-7)
