"""Speculative verification: exact outcomes on hand-built cases and statistical exactness.

Statistical tests fail when a chi-square / binomial p-value is below ALPHA = 1e-4 (a test with several
sub-tests splits ALPHA between them, Bonferroni), so each test's false-failure rate for a correct
verifier is at most 1e-4. All seeds are fixed, so runs are deterministic.
"""

import numpy as np
import pytest
import torch
from scipy import stats

from ssd.sample.sampler import make_generator, sample, sample_with_uniforms
from ssd.sample.rejection import VerifyResult, verify

ALPHA = 1e-4


def chi_square_pvalue(counts, probs) -> float:
    """Goodness of fit; bins expecting < 5 samples are pooled so the chi-square approximation holds."""
    counts = np.asarray(counts, dtype=np.float64).ravel()
    probs = np.asarray(probs, dtype=np.float64).ravel()
    probs = probs / probs.sum()
    assert counts[probs == 0].sum() == 0, "a zero-probability outcome was emitted"
    expected = probs * counts.sum()
    big = expected >= 5
    obs, exp = list(counts[big]), list(expected[big])
    if (~big & (probs > 0)).any():
        obs.append(counts[~big].sum())
        exp.append(expected[~big].sum())
    if len(obs) < 2:
        return 1.0
    return float(stats.chisquare(obs, exp).pvalue)


def dist(*values) -> list[float]:
    total = sum(values)
    return [v / total for v in values]


def one_hot(i: int, vocab: int = 5) -> list[float]:
    return [1.0 if j == i else 0.0 for j in range(vocab)]


def run(p, q, d, greedy, gens=None, n=None) -> VerifyResult:
    p = torch.tensor(p, dtype=torch.float32)
    q = torch.tensor(q, dtype=torch.float32)
    d = torch.tensor(d, dtype=torch.int64)
    b = p.shape[0]
    greedy = torch.tensor(greedy)
    gens = gens if gens is not None else [make_generator(i, "cpu") for i in range(b)]
    return verify(p, q, d, greedy, gens, n)


# ---------------------------------------------------------------- greedy


GREEDY_P = [  # argmax 2, 4, 1, 0; deliberately not one-hot
    dist(1, 2, 5, 1, 1),
    dist(1, 1, 1, 1, 3),
    dist(2, 6, 1, 1, 1),
    dist(4, 1, 1, 1, 3),
]


@pytest.mark.parametrize(
    "drafts, accepted, output",
    [
        ([2, 4, 1], 3, [2, 4, 1, 0]),  # all accepted: bonus = argmax p_3
        ([2, 3, 1], 1, [2, 4]),  # second rejected: correction = argmax p_1
        ([0, 4, 1], 0, [2]),  # first rejected
        ([2, 4, 3], 2, [2, 4, 1]),
    ],
)
def test_greedy_exact(drafts, accepted, output):
    nan_q = [[float("nan")] * 5] * 3  # greedy rows never read q
    res = run([GREEDY_P], [nan_q], [drafts], [True])
    assert res.num_accepted == [accepted]
    assert res.output_tokens == [output]


def test_greedy_ties_use_lowest_index():
    p = [[0.4, 0.4, 0.2], [0.1, 0.45, 0.45]]
    res = run([p], [[[0.0] * 3]], [[1]], [True])  # argmax p_0 = 0, so draft 1 is rejected
    assert res.output_tokens == [[0]]
    res = run([p], [[[0.0] * 3]], [[0]], [True])
    assert res.output_tokens == [[0, 1]]


# ---------------------------------------------------------------- sampled, certain outcomes


def test_sampled_one_hot_all_accepted_and_bonus():
    p = [one_hot(3), one_hot(1), one_hot(4), one_hot(0)]
    q = [one_hot(3), one_hot(1), one_hot(4)]
    for seed in range(20):
        res = run([p], [q], [[3, 1, 4]], [False], gens=[make_generator(seed, "cpu")])
        assert res.num_accepted == [3] and res.output_tokens == [[3, 1, 4, 0]]


def test_sampled_certain_rejection_and_residual_recovery():
    # d_2 = 2 has p_1(2) = 0: always rejected. Residual max(0, p_1 - q_2) = [0.5, 0, 0, 0, 0] -> token 0.
    p = [one_hot(3), dist(1, 1, 0, 0, 0), one_hot(4)]
    q = [one_hot(3), dist(0, 1, 1, 0, 0)]
    for seed in range(20):
        res = run([p], [q], [[3, 2]], [False], gens=[make_generator(seed, "cpu")])
        assert res.num_accepted == [1] and res.output_tokens == [[3, 0]]


@pytest.mark.parametrize("p0", [dist(0, 3, 7, 0, 0), dist(0, 3, 0, 7, 0)])
def test_draft_with_zero_q_is_rejected_without_crash(p0):
    # d_1 = 3 could not have come from q_1 = one-hot(1): reject whether p_0(3) is 0 or 0.7.
    # The residual max(0, p_0 - q_1) then has all its mass on the single token p_0 puts 0.7 on.
    p = [p0, one_hot(0)]
    q = [one_hot(1)]
    expected = int(np.argmax(p0))
    for seed in range(20):
        res = run([p], [q], [[3]], [False], gens=[make_generator(seed, "cpu")])
        assert res.num_accepted == [0] and res.output_tokens == [[expected]]


def test_all_zero_residual_falls_back_to_p():
    # p == q, and the draft (q = 0 there) is rejected: residual is all zero, so the recovery is drawn
    # from p with the row's final uniform (entry n_i = 1 of its rand(2) draw).
    p0 = dist(1, 3, 0, 0, 0)
    for seed in range(20):
        res = run([[p0, one_hot(4)]], [[p0]], [[2]], [False], gens=[make_generator(seed, "cpu")])
        u = torch.rand(2, dtype=torch.float64, generator=make_generator(seed, "cpu"))
        expected = sample_with_uniforms(torch.tensor([p0]), u[1:]).item()
        assert res.num_accepted == [0] and res.output_tokens == [[expected]]


def test_variable_num_draft_tokens_and_padding():
    p_greedy = GREEDY_P  # argmax 2, 4, 1, 0
    p_hot = [one_hot(1), one_hot(2), one_hot(3), one_hot(4)]
    q_hot = [one_hot(1), one_hot(2), one_hot(3)]
    res = run(
        [p_greedy, p_greedy, p_hot, p_hot, p_greedy],
        [q_hot] * 5,
        [[2, -1, -1], [-1, -1, -1], [1, 2, -1], [-1, -1, -1], [2, 4, 1]],
        [True, True, False, False, True],
        n=[1, 0, 2, 0, 3],
    )
    assert res.num_accepted == [1, 0, 2, 0, 3]
    assert res.output_tokens == [[2, 4], [2], [1, 2, 3], [1], [2, 4, 1, 0]]


def test_draft_beyond_num_draft_tokens_is_ignored():
    # Row uses 1 of K = 2 drafts; the second (wrong) draft must not matter: bonus comes from p_1.
    res = run([GREEDY_P[:3]], [[[0.0] * 5] * 2], [[2, 0]], [True], n=[1])
    assert res.output_tokens == [[2, 4]]


def test_k_zero_is_plain_sampling():
    p = torch.tensor([[dist(1, 2, 3, 4, 0)], [dist(0, 0, 1, 3, 0)]])  # [B, 1, V]
    q = torch.zeros(2, 0, 5)
    d = torch.zeros(2, 0, dtype=torch.int64)
    res = verify(p, q, d, torch.tensor([False, True]), [make_generator(0, "cpu"), None])
    assert res.num_accepted == [0, 0]
    assert res.output_tokens[1] == [3] and len(res.output_tokens[0]) == 1


def test_shape_errors():
    p = torch.rand(2, 3, 5)
    q = torch.rand(2, 2, 5)
    d = torch.zeros(2, 2, dtype=torch.int64)
    g = torch.zeros(2, dtype=torch.bool)
    with pytest.raises(ValueError, match="draft_probs"):
        verify(p, q[:, :1], d, g, [None, None])
    with pytest.raises(ValueError, match="draft_tokens"):
        verify(p, q, d[:1], g, [None, None])
    with pytest.raises(ValueError, match="generators"):
        verify(p, q, d, g, [None])
    with pytest.raises(ValueError, match="num_draft_tokens"):
        verify(p, q, d, g, [None, None], num_draft_tokens=[3, 0])


# ---------------------------------------------------------------- reproducibility


def _random_case(b: int, k: int, vocab: int, seed: int):
    rng = np.random.RandomState(seed)
    p = torch.tensor(rng.dirichlet(np.ones(vocab), size=(b, k + 1)), dtype=torch.float32)
    q = torch.tensor(rng.dirichlet(np.ones(vocab), size=(b, k)), dtype=torch.float32)
    d = torch.tensor(rng.randint(0, vocab, size=(b, k)), dtype=torch.int64)
    return p, q, d


def test_num_draft_tokens_zero_equals_sample():
    p, q, d = _random_case(1, 3, 7, seed=0)
    for seed in range(30):
        res = verify(p, q, d, torch.tensor([False]), [make_generator(seed, "cpu")], [0])
        tok = sample(p[:, 0], [make_generator(seed, "cpu")], torch.tensor([False]))
        assert res.output_tokens == [[tok.item()]]


def test_seeded_row_independent_of_batch_and_consumes_n_plus_one_doubles():
    p, q, d = _random_case(4, 3, 6, seed=1)
    greedy = torch.tensor([False, True, False, False])
    n = [3, 3, 1, 2]
    for seed in range(10):
        gens = [make_generator(seed, "cpu"), make_generator(seed, "cpu"), None, make_generator(50, "cpu")]
        batch = verify(p, q, d, greedy, gens, n, default_generator=torch.Generator().manual_seed(seed))
        alone_gen = make_generator(seed, "cpu")
        alone = verify(p[:1], q[:1], d[:1], greedy[:1], [alone_gen], n[:1])
        assert batch.output_tokens[0] == alone.output_tokens[0]
        for g, count, s in ((gens[0], 4, seed), (gens[1], 4, seed), (gens[3], 3, 50), (alone_gen, 4, seed)):
            ref = make_generator(s, "cpu")
            torch.rand(count, dtype=torch.float64, generator=ref)
            assert torch.equal(g.get_state(), ref.get_state())


# ---------------------------------------------------------------- statistical exactness


def _exactness_setup(vocab: int, seed: int):
    """A toy target P and draft Q over two steps; Q has zeros where P has mass and vice versa."""
    rng = np.random.RandomState(seed)
    p0 = rng.dirichlet(np.ones(vocab))
    p1 = rng.dirichlet(np.ones(vocab), size=vocab)  # p1[x] = target after first token x
    p2 = rng.dirichlet(np.ones(vocab), size=(vocab, vocab))  # p2[x, y]
    q1 = rng.dirichlet(np.ones(vocab) * 0.5)
    q2 = rng.dirichlet(np.ones(vocab) * 0.5, size=vocab)
    p0[0] = 0.0  # p has a zero where q has mass: drafts of token 0 are always rejected first
    p0 /= p0.sum()
    q1[1] = 0.0  # q has a zero where p has mass: only the residual can produce token 1
    q1 /= q1.sum()
    q2[:, 2] = 0.0
    q2 /= q2.sum(axis=1, keepdims=True)
    return [torch.tensor(a, dtype=torch.float64) for a in (p0, p1, p2, q1, q2)]


@pytest.mark.parametrize("per_row_generators", [False, True])
def test_emitted_tokens_are_distributed_as_target(per_row_generators):
    vocab = 5  # two draft positions (d1, d2) below
    b = 24_000 if per_row_generators else 60_000
    p0, p1, p2, q1, q2 = _exactness_setup(vocab, seed=3)
    g = torch.Generator().manual_seed(17)
    d1 = torch.multinomial(q1.expand(b, vocab), 1, generator=g).squeeze(1)  # [b]
    d2 = torch.multinomial(q2[d1], 1, generator=g).squeeze(1)  # [b]
    target = torch.stack([p0.expand(b, vocab), p1[d1], p2[d1, d2]], dim=1).float()  # [b, 3, V]
    draft = torch.stack([q1.expand(b, vocab), q2[d1]], dim=1).float()  # [b, 2, V]
    n = [i % 3 for i in range(b)]  # rows with 0, 1 and 2 drafts
    tokens = torch.stack([d1, d2], dim=1)  # [b, 2]
    n_t = torch.tensor(n)
    tokens[n_t < 2, 1] = -1  # padding beyond n_i must be ignored
    tokens[n_t < 1, 0] = -1
    gens = [make_generator(i, "cpu") for i in range(b)] if per_row_generators else [None] * b
    res = verify(target, draft, tokens, torch.zeros(b, dtype=torch.bool), gens, n,
                 default_generator=torch.Generator().manual_seed(23))
    assert all(len(o) == a + 1 for o, a in zip(res.output_tokens, res.num_accepted))
    assert all(a <= ni for a, ni in zip(res.num_accepted, n))

    # Continue every row to three tokens by sampling the target directly, then compare the joint law
    # of the first three tokens with p0(x) p1[x](y) p2[x, y](z).
    fill = torch.Generator().manual_seed(29)
    lengths = torch.tensor([min(len(o), 3) for o in res.output_tokens])  # [b]
    triples = torch.tensor([(o + [0, 0])[:3] for o in res.output_tokens])  # [b, 3]
    second = torch.multinomial(p1[triples[:, 0]], 1, generator=fill).squeeze(1)  # [b]
    triples[:, 1] = torch.where(lengths < 2, second, triples[:, 1])
    third = torch.multinomial(p2[triples[:, 0], triples[:, 1]], 1, generator=fill).squeeze(1)  # [b]
    triples[:, 2] = torch.where(lengths < 3, third, triples[:, 2])
    triples = triples.numpy()
    joint = (p0[:, None, None] * p1[:, :, None] * p2).numpy()  # [V, V, V]
    flat = triples[:, 0] * vocab * vocab + triples[:, 1] * vocab + triples[:, 2]
    counts = np.bincount(flat, minlength=vocab**3)

    tests = 1 + 1 + vocab  # joint, first-token marginal, second | first for each first token
    assert chi_square_pvalue(counts, joint) > ALPHA / tests
    assert chi_square_pvalue(np.bincount(triples[:, 0], minlength=vocab), p0.numpy()) > ALPHA / tests
    # The emitted second token, where the verifier emitted one, conditional on the first.
    emitted = [(o[0], o[1]) for o in res.output_tokens if len(o) >= 2]
    pairs = np.array(emitted)
    for x in range(vocab):
        ys = pairs[pairs[:, 0] == x, 1]
        if len(ys) >= 50:
            assert chi_square_pvalue(np.bincount(ys, minlength=vocab), p1[x].numpy()) > ALPHA / tests


NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
DEVICES = ["cpu", pytest.param("cuda", marks=NEEDS_CUDA)]


@pytest.mark.parametrize("device", DEVICES)
def test_mean_acceptance_matches_closed_form_k1(device):
    vocab, b = 8, 100_000
    rng = np.random.RandomState(4)
    p0 = torch.tensor(rng.dirichlet(np.ones(vocab)))
    p1 = torch.tensor(rng.dirichlet(np.ones(vocab)))
    q = torch.tensor(rng.dirichlet(np.ones(vocab)))
    g = torch.Generator().manual_seed(31)
    d = torch.multinomial(q.expand(b, vocab), 1, replacement=True, generator=g)  # [b, 1]
    target = torch.stack([p0, p1]).float().expand(b, 2, vocab)  # [b, 2, V]
    draft = q.float().expand(b, 1, vocab)  # [b, 1, V]
    res = verify(target.to(device), draft.to(device), d.to(device), torch.zeros(b, dtype=torch.bool),
                 [None] * b, default_generator=torch.Generator(device=device).manual_seed(37))
    accepted = sum(res.num_accepted)
    rate = float(torch.minimum(p0, q).sum())
    assert 0.3 < rate < 0.9  # a non-trivial case
    assert stats.binomtest(accepted, b, rate).pvalue > ALPHA / 2
    first = np.bincount([o[0] for o in res.output_tokens], minlength=vocab)
    assert chi_square_pvalue(first, p0.numpy()) > ALPHA / 2


def test_mixed_greedy_and_sampled_rows_in_one_batch():
    p, q, d = _random_case(6, 3, 6, seed=5)
    greedy = torch.tensor([True, False, True, False, True, False])
    gens = [make_generator(i, "cpu") for i in range(6)]
    res = verify(p, q, d, greedy, gens)
    argmax = p.argmax(-1)  # [B, K+1]
    for i in (0, 2, 4):
        k = res.num_accepted[i]
        assert d[i, :k].tolist() == argmax[i, :k].tolist()
        assert k == 3 or d[i, k] != argmax[i, k]
        assert res.output_tokens[i][-1] == argmax[i, k]
    for i in (1, 3, 5):
        rows = slice(i, i + 1)
        alone = verify(p[rows], q[rows], d[rows], greedy[rows], [make_generator(i, "cpu")])
        assert alone.output_tokens[0] == res.output_tokens[i]


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_generators_on_device(device):
    p, q, d = _random_case(3, 2, 6, seed=6)
    greedy = torch.tensor([False, True, False])
    outs = []
    for _ in range(2):
        gens = [make_generator(i, device) for i in range(3)]
        outs.append(verify(p.to(device), q.to(device), d.to(device), greedy.to(device), gens, [2, 2, 1]))
    assert outs[0] == outs[1]
    cpu = verify(p, q, d, greedy, [None] * 3, [2, 2, 1])
    assert outs[0].output_tokens[1] == cpu.output_tokens[1]  # greedy rows agree across devices
