"""Sampler: exact processed distributions, distributional correctness of `sample`, reproducibility.

Statistical tests use a chi-square goodness-of-fit test and fail when p < 1e-4, i.e. each has a
false-failure rate of 1e-4 for a correct sampler (all seeds are fixed, so a run is deterministic).
"""

import math

import numpy as np
import pytest
import torch
from scipy import stats

from ssd.sample.sampler import (
    SamplingTensors,
    compute_logprobs,
    expand,
    make_generator,
    processed_probs,
    sample,
    sample_with_uniforms,
)
from ssd.sampling_params import SamplingParams

ALPHA = 1e-4  # false-failure rate of each statistical test


def chi_square_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Goodness of fit; bins expecting < 5 samples are pooled so the chi-square approximation holds."""
    counts = np.asarray(counts, dtype=np.float64).ravel()
    probs = np.asarray(probs, dtype=np.float64).ravel()
    probs = probs / probs.sum()  # float32 inputs sum to 1 only to ~1e-7
    assert counts[probs == 0].sum() == 0, "a zero-probability outcome was drawn"
    expected = probs * counts.sum()
    big = expected >= 5
    obs = list(counts[big])
    exp = list(expected[big])
    if (~big & (probs > 0)).any():
        obs.append(counts[~big].sum())
        exp.append(expected[~big].sum())
    return float(stats.chisquare(obs, exp).pvalue)


def tensors(*params: SamplingParams) -> SamplingTensors:
    return SamplingTensors.from_params(list(params), "cpu")


def close(actual: torch.Tensor, expected) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=torch.float32), atol=1e-6, rtol=0)


LN = [math.log(x) for x in (1.0, 2.0, 4.0, 8.0)]  # logits whose softmax is [1, 2, 4, 8] / 15


def test_temperature_exact():
    logits = torch.tensor([LN, LN])
    out = processed_probs(logits, tensors(SamplingParams(temperature=1.0), SamplingParams(temperature=0.5)))
    close(out[0], [1 / 15, 2 / 15, 4 / 15, 8 / 15])
    close(out[1], [1 / 85, 4 / 85, 16 / 85, 64 / 85])  # squared weights
    out = processed_probs(torch.tensor([LN]), tensors(SamplingParams(temperature=2.0)))
    s = 1 + math.sqrt(2) + 2 + math.sqrt(8)
    close(out[0], [1 / s, math.sqrt(2) / s, 2 / s, math.sqrt(8) / s])


def test_greedy_is_one_hot_lowest_index_on_ties():
    logits = torch.tensor([[0.0, 5.0, 1.0, 5.0], [3.0, 3.0, 3.0, 3.0], [-1.0, -2.0, -0.5, -7.0]])
    st = tensors(SamplingParams(temperature=0.0), SamplingParams(temperature=0.0), SamplingParams(top_k=1))
    assert st.all_greedy
    out = processed_probs(logits, st)
    close(out, [[0, 1, 0, 0], [1, 0, 0, 0], [0, 0, 1, 0]])


def test_top_k_exact_and_ties():
    logits = torch.tensor([LN, [3.0, 1.0, 2.0, 2.0], LN, LN])
    st = tensors(
        SamplingParams(top_k=2),
        SamplingParams(top_k=2),  # ties at the k-th value are all kept: 3 tokens survive
        SamplingParams(top_k=4),  # k >= V: no-op
        SamplingParams(top_k=-1),
    )
    out = processed_probs(logits, st)
    close(out[0], [0, 0, 4 / 12, 8 / 12])
    e = math.e
    z = e**3 + 2 * e**2
    close(out[1], [e**3 / z, 0, e**2 / z, e**2 / z])
    close(out[2], [1 / 15, 2 / 15, 4 / 15, 8 / 15])
    close(out[3], [1 / 15, 2 / 15, 4 / 15, 8 / 15])


def test_top_p_exact_and_boundaries():
    half = [math.log(x) for x in (0.5, 0.25, 0.125, 0.125)]
    # (thresholds stay off exact cumulative sums, which float rounding could put on either side)
    cases = [
        (0.74, [2 / 3, 1 / 3, 0, 0]),  # 0.5 + 0.25 reaches 0.74: stop there
        (0.49, [1, 0, 0, 0]),  # the first token alone reaches 0.49
        (0.3, [1, 0, 0, 0]),  # at least one token always survives
        (0.8, [0.5, 0.25, 0.125, 0.125]),  # needs the third token; the tied fourth is kept too
        (1.0, [0.5, 0.25, 0.125, 0.125]),
    ]
    logits = torch.tensor([half] * len(cases))
    st = tensors(*[SamplingParams(top_p=tp) for tp, _ in cases])
    out = processed_probs(logits, st)
    for row, (_, expected) in zip(out, cases):
        close(row, expected)
    # Order of tokens in the vocabulary does not matter for the result.
    perm = torch.tensor([2, 0, 3, 1])
    out_perm = processed_probs(logits[:, perm], st)
    torch.testing.assert_close(out_perm, out[:, perm])


def test_combination_temperature_top_k_top_p():
    # T = 0.5 squares the weights [1, 2, 4, 8] -> [1, 4, 16, 64]; top-k 3 drops the first;
    # probabilities [4, 16, 64] / 84; top-p 0.7: 64/84 = 0.762 >= 0.7, so only the last survives.
    # top-p 0.8 keeps 16 and 64 -> [16, 64] / 80.
    logits = torch.tensor([LN, LN, LN])
    st = tensors(
        SamplingParams(temperature=0.5, top_k=3, top_p=0.7),
        SamplingParams(temperature=0.5, top_k=3, top_p=0.8),
        SamplingParams(temperature=0.0, top_k=3, top_p=0.8),
    )
    out = processed_probs(logits, st)
    close(out, [[0, 0, 0, 1], [0, 0, 0.2, 0.8], [0, 0, 0, 1]])


def test_mixed_batch_rows_are_independent():
    torch.manual_seed(0)
    logits = torch.randn(5, 11)
    params = [
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=0.0),
        SamplingParams(top_k=3),
        SamplingParams(top_p=0.6, temperature=1.3),
        SamplingParams(),
    ]
    together = processed_probs(logits, tensors(*params))
    for i, sp in enumerate(params):
        alone = processed_probs(logits[i : i + 1], tensors(sp))
        torch.testing.assert_close(together[i : i + 1], alone, atol=1e-7, rtol=0)
    torch.testing.assert_close(together.sum(-1), torch.ones(5))


def test_three_dim_input_uses_per_row_params():
    torch.manual_seed(1)
    logits = torch.randn(2, 3, 9)  # [N, S, V]
    params = [SamplingParams(temperature=0.6, top_k=4), SamplingParams(top_p=0.5)]
    st = tensors(*params)
    out = processed_probs(logits, st)
    assert out.shape == (2, 3, 9)
    flat = processed_probs(logits.reshape(6, 9), expand(st, 3))
    torch.testing.assert_close(out.reshape(6, 9), flat)
    for i, sp in enumerate(params):
        for s in range(3):
            one = processed_probs(logits[i, s][None], tensors(sp))
            torch.testing.assert_close(out[i, s][None], one, atol=1e-7, rtol=0)


def test_tiny_temperature_and_masked_logits_stay_finite():
    logits = torch.tensor([[1.0, 1.0 - 1e-3, float("-inf"), 0.0]])
    out = processed_probs(logits, tensors(SamplingParams(temperature=1e-8)))
    close(out, [[1, 0, 0, 0]])
    out = processed_probs(logits, tensors(SamplingParams(top_p=0.9, top_k=2)))
    assert torch.isfinite(out).all() and out[0, 2] == 0 and out[0, 3] == 0


def test_shape_errors():
    with pytest.raises(ValueError, match="rows"):
        processed_probs(torch.zeros(3, 4), tensors(SamplingParams()))
    with pytest.raises(ValueError, match="shape"):
        processed_probs(torch.zeros(4), tensors(SamplingParams()))


def test_sample_with_uniforms_edges():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]] * 5)
    u = torch.tensor([0.0, 0.4999, 0.5, 1 - 2**-53, 0.75], dtype=torch.float64)
    assert sample_with_uniforms(probs, u).tolist() == [1, 1, 3, 3, 3]
    # Unnormalised rows work the same.
    assert sample_with_uniforms(probs * 3, u).tolist() == [1, 1, 3, 3, 3]


def test_sample_greedy_rows_are_argmax():
    probs = torch.tensor([[0.1, 0.6, 0.3], [0.5, 0.2, 0.3]])
    greedy = torch.tensor([True, True])
    assert sample(probs, [None, make_generator(1, "cpu")], greedy).tolist() == [1, 0]


CONFIGS = [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.9, top_k=5),
    SamplingParams(temperature=1.0, top_p=0.8),
    SamplingParams(temperature=1.3, top_k=7, top_p=0.8),
]


NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DEVICES = ["cpu", pytest.param("cuda", marks=NEEDS_CUDA)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sp", CONFIGS, ids=lambda sp: f"T{sp.temperature}-k{sp.top_k}-p{sp.top_p}")
def test_sample_matches_processed_probs_statistically(sp, device):
    vocab, n = 12, 40_000
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(5)) * 0.8  # [V]
    st = SamplingTensors.from_params([sp] * n, device)
    probs = processed_probs(logits.to(device).expand(n, vocab), st)  # [n, V]
    num_kept = int((probs[0] > 0).sum())
    assert num_kept >= 5 and (num_kept < vocab) == (sp.top_k > 0 or sp.top_p < 1)  # filters bite
    default = torch.Generator(device=device).manual_seed(11)
    tokens = sample(probs, [None] * n, st.greedy, default_generator=default)
    counts = np.bincount(tokens.cpu().numpy(), minlength=vocab)
    assert chi_square_pvalue(counts, probs[0].double().cpu().numpy()) > ALPHA


def test_seeded_rows_sample_from_processed_probs_statistically():
    vocab, n = 10, 20_000
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(6))
    sp = SamplingParams(temperature=0.8, top_k=8)
    probs = processed_probs(logits[None], tensors(sp)).expand(n, vocab)  # [n, V]
    gens = [make_generator(1000 + i, "cpu") for i in range(n)]
    tokens = sample(probs, gens, torch.zeros(n, dtype=torch.bool))
    counts = np.bincount(tokens.numpy(), minlength=vocab)
    assert chi_square_pvalue(counts, probs[0].double().numpy()) > ALPHA


def _run_seeded(batch_params, logits, seeds, steps=25):
    st = tensors(*batch_params)
    gens = [make_generator(s, "cpu") for s in seeds]
    probs = processed_probs(logits, st)
    default = torch.Generator().manual_seed(99)
    return [sample(probs, gens, st.greedy, default).tolist() for _ in range(steps)]


def test_seeded_request_is_independent_of_batch_position_and_composition():
    torch.manual_seed(2)
    target = SamplingParams(temperature=1.0, seed=7)
    row = torch.randn(1, 20)
    alone = [r[0] for r in _run_seeded([target], row, [7])]
    others = torch.randn(3, 20)
    batch = torch.cat([others[:2], row, others[2:]])
    params = [
        SamplingParams(temperature=0.0, seed=7), SamplingParams(top_k=3), target, SamplingParams(seed=8)
    ]
    mixed = [r[2] for r in _run_seeded(params, batch, [7, None, 7, 8])]
    assert alone == mixed
    assert len(set(alone)) > 3  # the draws really vary from step to step
    # A different seed gives a different stream.
    other_seed = [r[0] for r in _run_seeded([target], row, [123])]
    assert other_seed != alone


def test_sample_consumes_exactly_one_double_per_seeded_row():
    probs = torch.tensor([[0.2, 0.3, 0.5], [1.0, 0.0, 0.0]])
    gens = [make_generator(5, "cpu"), make_generator(6, "cpu")]
    sample(probs, gens, torch.tensor([False, True]))
    for g, seed in zip(gens, (5, 6)):
        ref = make_generator(seed, "cpu")
        torch.rand(1, dtype=torch.float64, generator=ref)
        assert torch.equal(g.get_state(), ref.get_state())


def test_make_generator():
    assert make_generator(None, "cpu") is None
    a, b = make_generator(3, "cpu"), make_generator(3, "cpu")
    assert torch.equal(torch.rand(4, generator=a), torch.rand(4, generator=b))


def test_compute_logprobs_raw_distribution():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.0, 0.0, 5.0, -1.0]])
    ids = torch.tensor([2, 3])
    res = compute_logprobs(logits, ids, num_top=2)
    ref = torch.log_softmax(logits, dim=-1)
    torch.testing.assert_close(res.chosen_logprobs, ref[[0, 1], [2, 3]])
    assert res.chosen_ranks.tolist() == [2, 4]
    assert res.top_ids.tolist() == [[1, 2], [2, 0]] or res.top_ids.tolist() == [[1, 2], [2, 1]]
    torch.testing.assert_close(res.top_logprobs, ref.gather(1, res.top_ids))
    none = compute_logprobs(logits, ids, num_top=0)
    assert none.top_ids is None and none.top_logprobs is None
    torch.testing.assert_close(none.chosen_logprobs, res.chosen_logprobs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu():
    torch.manual_seed(3)
    logits = torch.randn(4, 50)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, top_k=10),
        SamplingParams(top_p=0.7),
        SamplingParams(temperature=1.2, top_k=20, top_p=0.9),
    ]
    cpu = processed_probs(logits, SamplingTensors.from_params(params, "cpu"))
    st = SamplingTensors.from_params(params, "cuda")
    gpu = processed_probs(logits.cuda(), st)
    torch.testing.assert_close(gpu.cpu(), cpu, atol=1e-6, rtol=1e-5)
    gens = [make_generator(i, "cuda") for i in range(4)]
    first = sample(gpu, gens, st.greedy)
    gens = [make_generator(i, "cuda") for i in range(4)]
    assert torch.equal(first, sample(gpu, gens, st.greedy))
    assert first.device.type == "cuda"
