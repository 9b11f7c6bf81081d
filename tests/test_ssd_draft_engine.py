"""The SSD draft's computation in-process (no worker): serving, glue/fork/tree decode, fallbacks, Saguaro.

The reference for every speculation is the draft model run alone on the branch's full text (a fresh paged
session, ``model_utils.PagedSession``), so tree attention, scratch slots, RoPE positions and the KV kept
across rounds are all checked against plain decoding. Rounds are scripted: each sequence gets a chosen
outcome (a cached key, an uncached recovery token, the bonus), so hits and both fallbacks occur in a known
order. The target vocabulary is padded past the draft's (as for a draft with a smaller embedding) and the
last ids are unusable, so masking is exercised too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from model_utils import PagedSession
from ssd.core.block_pool import BlockPool
from ssd.core.kv_cache_manager import KVCacheManager
from ssd.runtime.model_runner import ModelRunner
from ssd.options import Fallback
from ssd.sample.sampler import SamplingTensors, processed_probs
from ssd.sampling_params import SamplingParams
from ssd.speculative.drafting import DraftDistribution
from ssd.speculative.async_draft.draft_engine import DraftEngine
from ssd.speculative.async_draft.draft_state import SpeculateRow, SpeculationResult
from ssd.speculative.async_draft.planning.dynamic_fanout import DynamicFanOut, Outcome, dynamic_branches, keeps_drafting
from ssd.speculative.async_draft.planning.fanout import FanOutPlan, per_k_counts

K = 3
BLOCK = 4  # small blocks: glue and scratch regions straddle block boundaries
NUM_BLOCKS = 160
VOCAB = 512  # the draft checkpoint's embedding rows
TARGET_VOCAB = VOCAB + 8  # the target's (padded) vocabulary: q rows have this width
USABLE = VOCAB - 12  # ids the tokenizer can produce; the rest must never be drafted
ATOL = 2e-5

GREEDY = SamplingParams(temperature=0.0)
SAMPLED = [
    SamplingParams(temperature=0.9, seed=7),
    SamplingParams(temperature=1.3, top_k=40),
    SamplingParams(temperature=0.7, top_p=0.9, seed=3),
]


@pytest.fixture(scope="module")
def draft_path(checkpoint_factory):
    return checkpoint_factory()


def make_engine(path, saguaro_c: float = 1.0, pad_filler: bool = False) -> DraftEngine:
    runner = ModelRunner(str(path), "float32", "cpu", BLOCK, 256, None, 0.5, num_blocks=NUM_BLOCKS)
    kv = KVCacheManager(BlockPool(NUM_BLOCKS, BLOCK, True))
    return DraftEngine(runner, kv, DraftDistribution(TARGET_VOCAB, USABLE), K, saguaro_c, seed=0, pad_filler=pad_filler)


class Reference:
    """The draft model decoding one text alone (no tree, no reused KV), masked like the engine must mask."""

    def __init__(self, engine: DraftEngine) -> None:
        self.model = engine.runner.model
        self._cache: dict[tuple[int, ...], torch.Tensor] = {}

    def logits(self, tokens: list[int]) -> torch.Tensor:
        """Masked logits ``[len(tokens), TARGET_VOCAB]``: row i predicts the token after tokens[: i + 1]."""
        key = tuple(tokens)
        if key not in self._cache:
            session = PagedSession(self.model, num_blocks=len(tokens) // BLOCK + 2, block_size=BLOCK)
            raw = session.step({0: list(tokens)})[0]  # [T, VOCAB]
            out = torch.full((len(tokens), TARGET_VOCAB), float("-inf"))  # [T, V]
            out[:, :USABLE] = raw[:, :USABLE]
            self._cache[key] = out
        return self._cache[key]

    def ranking(self, tokens: list[int], row: int) -> list[int]:
        """Token ids by decreasing draft logit after ``tokens[: row + 1]``."""
        return torch.argsort(self.logits(tokens)[row], descending=True).tolist()

    def argmaxes(self, prefix: list[int], tokens: list[int]) -> list[int]:
        """The draft's argmax after prefix + tokens[:j] for each j: equals ``tokens`` exactly when ``tokens`` is
        the plain greedy continuation of ``prefix`` (one forward instead of len(tokens))."""
        rows = self.logits(prefix + tokens[:-1])[len(prefix) - 1 :]  # [len(tokens), V]
        return rows.argmax(dim=-1).tolist()

    def q(self, tokens: list[int], params: SamplingParams, num_scaled: int, c: float, row: int = -1) -> torch.Tensor:
        """The distribution a draft after ``tokens[: row + 1]`` must be drawn from: processed probs, with
        Saguaro's factor c on the ``num_scaled`` likeliest tokens, renormalised."""
        logits = self.logits(tokens)[row][None]  # [1, V]
        probs = processed_probs(logits, SamplingTensors.from_params([params], "cpu"))[0]  # [V]
        if c < 1.0 and num_scaled > 0:
            top = torch.topk(logits[0], num_scaled).indices  # [F]
            probs = probs.clone()
            probs[top] *= c
            probs = probs / probs.sum()
        return probs


def assert_same_processed(actual: torch.Tensor, expected: torch.Tensor, top_p: float) -> None:
    """Equal processed distributions, allowing a top-p cut to fall on the other side of one boundary token.

    The branch's q comes from a batched tree forward and the reference from a plain forward of the same text;
    their logits differ by float rounding (~1e-6), and top-p keeps a token iff the mass above it is below
    top_p, so a token sitting on that boundary may be kept by one and dropped by the other. Such a token must
    be the least likely kept one (the smallest positive entry); everything else must match after
    renormalising on the common support.
    """
    differ = (actual > 0) != (expected > 0)  # [V]
    if differ.any():
        assert top_p < 1.0, "supports differ without top-p"
        assert int(differ.sum()) <= 2, f"supports differ on {int(differ.sum())} tokens"
        for dist in (actual, expected):
            extra = differ & (dist > 0)
            if extra.any():  # the extra token is this distribution's least likely kept token
                assert float(dist[extra].max()) <= float(dist[dist > 0].min()) + 1e-6
        common = ~differ
        actual = actual * common / (actual * common).sum()
        expected = expected * common / (expected * common).sum()
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=0)


@dataclass
class Track:
    """What the test knows about one sequence: committed text, last speculation, last fan-out built."""

    seq_id: int
    text: list[int]  # committed tokens; the last one is pending
    params: SamplingParams
    spec: list[int] = field(default_factory=list)  # e_1..e_n returned last round
    tree_depth: int = K  # drafts the last round asked for: the length of every branch built after it
    fan_out: list[int] = field(default_factory=list)  # F_0..F_K of the latest build_cache


class Harness:
    def __init__(self, engine: DraftEngine, c: float = 1.0) -> None:
        self.engine = engine
        self.ref = Reference(engine)
        self.c = c
        self.tracks: dict[int, Track] = {}

    def prefill(self, tracks: list[Track]) -> None:
        self.engine.prefill([(t.seq_id, list(t.text), t.params) for t in tracks])
        for t in tracks:
            self.tracks[t.seq_id] = t

    def serve(
        self, outcomes: dict[int, tuple[int, int]], fallback: str, num_drafts: int = K
    ) -> dict[int, SpeculationResult]:
        """Commit each sequence's outcome (k, t*) (k = -1: first round, t* = its first token) and check what
        comes back: a hit returns the cached entry, any greedy speculation equals plain greedy decoding,
        and every q equals the reference distribution its token was drawn from."""
        rows, expected_hit, cached = [], {}, {}
        for seq_id, (k, token) in outcomes.items():
            track = self.tracks[seq_id]
            new = [token] if k < 0 else track.spec[:k] + [token]
            state = self.engine.states[seq_id]
            cached[seq_id] = state.cache.get((k, token)) if k >= 0 else None
            expected_hit[seq_id] = cached[seq_id] is not None  # served as it is, even if shorter than asked
            rows.append(SpeculateRow(seq_id, new, k, num_drafts))
            track.text = track.text + new
        results = self.engine.speculate(rows, fallback)
        out = {}
        for row, result in zip(rows, results):
            track = self.tracks[row.seq_id]
            assert result.hit == expected_hit[row.seq_id], f"seq {row.seq_id}"
            unpadded = result.fallback == "random" and not self.engine.pad_filler
            if result.hit:
                assert len(result.tokens) == min(num_drafts, len(cached[row.seq_id].tokens))
            else:
                assert len(result.tokens) == (0 if unpadded else num_drafts)
            if result.hit:
                assert result.fallback is None
                assert result.tokens == cached[row.seq_id].tokens[:num_drafts]
                if cached[row.seq_id].probs is not None:
                    assert torch.equal(result.probs, cached[row.seq_id].probs[:num_drafts])
            else:
                assert result.fallback == fallback
            if result.fallback == "random":
                self._check_filler(track, result, num_drafts)
            else:
                self._check_speculation(track, result.tokens, result.probs, track.fan_out if not result.hit else None)
            track.spec = list(result.tokens)
            track.tree_depth = num_drafts
            out[row.seq_id] = result
        return out

    def _check_filler(self, track: Track, result: SpeculationResult, n: int) -> None:
        """Without prompt lookup nothing predicts a token for free: the filler is empty, or with padding the
        pending token n times."""
        pending = track.text[-1]
        n = n if self.engine.pad_filler else 0
        assert result.tokens == [pending] * n and result.copied == [False] * n
        if track.params.is_greedy:
            assert result.probs is None
        else:
            expected = torch.zeros(n, TARGET_VOCAB)  # [n, V]
            expected[:, pending] = 1.0
            assert torch.equal(result.probs, expected)

    def _check_speculation(self, track, tokens, probs, jit_fan_out) -> None:
        """``jit_fan_out``: for a jit draft, the fan-out whose F_j scaled the draw at step j (Saguaro)."""
        if track.params.is_greedy:
            assert probs is None
            assert tokens == self.ref.argmaxes(track.text, tokens)
            return
        assert probs is not None and probs.shape == (len(tokens), TARGET_VOCAB)
        if jit_fan_out is None:
            return  # a hit: its q was checked against the reference when the cache was built
        text = track.text + tokens[:-1]
        for j, token in enumerate(tokens):
            f = jit_fan_out[j] if j < len(jit_fan_out) else 0
            expected = self.ref.q(text, track.params, f, self.c, row=len(track.text) - 1 + j)
            torch.testing.assert_close(probs[j], expected, atol=ATOL, rtol=0)
            assert probs[j, token] > 0

    def build(self, fan_outs: dict[int, FanOutPlan], should_stop=None, depth: int | None = None) -> None:
        """Build the cache, then check the keys (fork) and every branch (tree decode) against references;
        ``depth``: the tokens per branch of a build that ``should_stop`` cuts short."""
        stats = self.engine.build_cache(fan_outs, should_stop)
        for seq_id, plan in fan_outs.items():
            track = self.tracks[seq_id]
            weights = None
            if isinstance(plan, DynamicFanOut):
                outcomes = self.expected_outcomes(track, plan.budget)
                weights = {(o.k, o.token): o.weight for o in outcomes}
                keys = set(weights)
                track.fan_out = per_k_counts(outcomes, K)
            else:
                track.fan_out = list(plan)
                keys = self.expected_keys(track)
            assert stats.fan_outs[seq_id] == self.engine.states[seq_id].fan_out == track.fan_out
            cache = self.engine.states[seq_id].cache
            assert set(cache) == keys, f"seq {seq_id}"
            full = track.tree_depth if depth is None else depth
            for (k, c), entry in cache.items():
                prefix = track.text + track.spec[:k] + [c]
                n = full if weights is None else self.dynamic_length(prefix, entry.tokens, weights[(k, c)],
                                                                     min(weights.values()), full)
                self._check_branch(track, prefix, entry, n)

    def expected_keys(self, track: Track) -> set[tuple[int, int]]:
        """C_k: the F_k likeliest draft tokens after e_1..e_k, without the draft e_{k+1} for k < n."""
        n = len(track.spec)
        keys = set()
        for k in range(n + 1):
            f = track.fan_out[k] if k < len(track.fan_out) else 0
            order = self.ref.ranking(track.text + track.spec, len(track.text) - 1 + k)
            candidates = [t for t in order if k == n or t != track.spec[k]][:f]
            keys.update((k, c) for c in candidates)
        return keys

    def expected_outcomes(self, track: Track, budget: int) -> list[Outcome]:
        """The `budget` likeliest outcomes by the reference's draft probabilities: e_{i+1} accepted at the
        engine's calibrated rate for its probability, recoveries by their probability without e_{k+1}."""
        n = len(track.spec)
        rows = torch.softmax(self.ref.logits(track.text + track.spec), dim=-1)[len(track.text) - 1 :]  # [n+1, V]
        drafted = [float(rows[k, track.spec[k]]) for k in range(n)]
        candidates = []
        for k in range(n + 1):
            order = self.ref.ranking(track.text + track.spec, len(track.text) - 1 + k)[: budget + 1]
            if k < n:
                ranked = [(t, float(rows[k, t]) / (1.0 - drafted[k])) for t in order if t != track.spec[k]]
            else:
                ranked = [(t, float(rows[k, t])) for t in order]
            candidates.append(ranked[:budget])
        accept = [self.engine.calibration.rate(p) for p in drafted]
        return dynamic_branches(candidates, accept, budget)

    def dynamic_length(self, prefix: list[int], tokens: list[int], weight: float, marginal: float, limit: int) -> int:
        """How many tokens a dynamic branch drafts: it goes on while ``keeps_drafting`` says so, with each of
        its tokens accepted at the engine's calibrated rate for the reference's probability of it."""
        rows = torch.softmax(self.ref.logits(prefix + tokens[:-1]), dim=-1)[len(prefix) - 1 :]  # [len(tokens), V]
        path = 1.0
        for j in range(1, limit):
            assert j <= len(tokens), f"the branch stopped after {len(tokens)} tokens, expected more"
            path *= self.engine.calibration.rate(min(1.0, float(rows[j - 1, tokens[j - 1]])))
            if not keeps_drafting(weight, path, marginal):
                return j
        return limit

    def _check_branch(self, track: Track, prefix: list[int], entry, n: int) -> None:
        assert len(entry.tokens) == n
        assert all(0 <= t < USABLE for t in entry.tokens)
        if track.params.is_greedy:
            assert entry.probs is None
            assert entry.tokens == self.ref.argmaxes(prefix, entry.tokens)
            return
        assert entry.probs.shape == (n, TARGET_VOCAB)
        text = prefix + entry.tokens[:-1]  # one forward gives every depth's distribution
        for j, token in enumerate(entry.tokens):
            f = track.fan_out[j] if j < len(track.fan_out) else 0
            expected = self.ref.q(text, track.params, f, self.c, row=len(prefix) - 1 + j)
            assert_same_processed(entry.probs[j], expected, track.params.top_p)
            assert entry.probs[j, token] > 0

    def key_at(self, seq_id: int, k: int, rank: int = 0) -> tuple[int, int]:
        """An outcome whose key is cached: the rank-th candidate at acceptance length k."""
        track = self.tracks[seq_id]
        order = self.ref.ranking(track.text + track.spec, len(track.text) - 1 + k)
        cached = [t for t in order if (k, t) in self.engine.states[seq_id].cache]
        return k, cached[rank]

    def uncached_at(self, seq_id: int, k: int) -> tuple[int, int]:
        """A valid outcome at k (never the rejected draft) whose key was not prepared."""
        track = self.tracks[seq_id]
        cache = self.engine.states[seq_id].cache
        for t in range(USABLE):
            if (k, t) not in cache and (k == len(track.spec) or t != track.spec[k]):
                return k, t
        raise AssertionError("every token is cached")

    def release_all(self) -> None:
        for seq_id in list(self.tracks):
            self.engine.release(seq_id)
        assert self.engine.kv.num_free_blocks == NUM_BLOCKS  # nothing leaked: mirrors, glue, scratch


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(3, USABLE, (n,), generator=gen).tolist() for n in (5, 13, 22)]


FAN_OUTS = [[2, 2, 2, 2], [3, 1, 0, 2], [1, 2, 1, 1]]


def _scripted_rounds(h: Harness, seq_ids: list[int]) -> None:
    """Rounds: first (jit), hits at k = 0 / bonus / middle, misses served by jit and by the filler, a round
    after the filler (whose glue holds no valid drafts), short rounds (2 drafts of K), and a round whose
    lookahead grows back to K (the shorter cached speculations serve it as they are)."""
    a, b, c = seq_ids
    first = {s: (-1, 100 + s) for s in seq_ids}
    h.serve(first, "jit")
    h.build({s: f for s, f in zip(seq_ids, FAN_OUTS)})

    results = h.serve({a: h.key_at(a, 0, 1), b: h.key_at(b, K), c: h.uncached_at(c, 1)}, "jit")
    assert [results[s].hit for s in seq_ids] == [True, True, False]
    h.build({a: FAN_OUTS[1], b: FAN_OUTS[2], c: FAN_OUTS[0]})

    results = h.serve({a: h.uncached_at(a, 2), b: h.key_at(b, 1), c: h.uncached_at(c, K)}, "random")
    assert [results[s].hit for s in seq_ids] == [False, True, False]
    h.build({s: f for s, f in zip(seq_ids, FAN_OUTS)})

    # after a filler: the outcome is almost always k = 0 (a hit when the recovery token was prepared)
    results = h.serve({a: h.key_at(a, 0), b: h.key_at(b, 1), c: h.uncached_at(c, 0)}, "jit")
    assert [results[s].hit for s in seq_ids] == [True, True, False]
    h.build({s: f for s, f in zip(seq_ids, FAN_OUTS)})

    results = h.serve({a: h.key_at(a, 1), b: h.uncached_at(b, 0), c: h.key_at(c, 1, 1)}, "jit", num_drafts=2)
    assert [results[s].hit for s in seq_ids] == [True, False, True]
    h.build({s: f for s, f in zip(seq_ids, FAN_OUTS)})
    results = h.serve({a: h.key_at(a, 2), b: h.key_at(b, 0), c: h.key_at(c, 1)}, "jit", num_drafts=2)
    assert all(results[s].hit for s in seq_ids)

    # the lookahead grows back to K: keys cached for 2-draft speculations serve their 2 tokens
    h.build({s: f for s, f in zip(seq_ids, FAN_OUTS)})
    results = h.serve({a: h.key_at(a, 0), b: h.key_at(b, 1), c: h.key_at(c, 1)}, "jit")
    assert all(results[s].hit and len(results[s].tokens) == 2 for s in seq_ids)
    h.build({s: f for s, f in zip(seq_ids, FAN_OUTS)})  # K deep again
    results = h.serve({a: h.key_at(a, 2), b: h.key_at(b, 1), c: h.key_at(c, 0)}, "random")
    assert all(results[s].hit and len(results[s].tokens) == K for s in seq_ids)


@pytest.mark.parametrize("pad_filler", [False, True])
def test_greedy_rounds_equal_plain_decoding_of_each_branch(draft_path, pad_filler):
    """Every cached branch and every speculation (hit, jit) is the plain greedy decoding of its text; random
    fillers are empty or padded, and the tree after either drafts K tokens per branch."""
    h = Harness(make_engine(draft_path, pad_filler=pad_filler))
    tracks = [Track(10 + i, p, GREEDY) for i, p in enumerate(_prompts())]
    h.prefill(tracks)
    _scripted_rounds(h, [t.seq_id for t in tracks])
    h.release_all()


@pytest.mark.parametrize("saguaro_c", [1.0, 0.5])
def test_sampled_branches_use_the_drafts_processed_distribution(draft_path, saguaro_c):
    """Each drafted token (tree or jit) carries the q it was drawn from, equal to the draft's processed
    distribution (temperature/top-k/top-p, Saguaro scaling) computed from the branch's full text alone."""
    h = Harness(make_engine(draft_path, saguaro_c), saguaro_c)
    tracks = [Track(20 + i, p, params) for i, (p, params) in enumerate(zip(_prompts(), SAMPLED))]
    h.prefill(tracks)
    _scripted_rounds(h, [t.seq_id for t in tracks])
    h.release_all()


def test_mixed_greedy_and_sampled_batch(draft_path):
    h = Harness(make_engine(draft_path))
    tracks = [Track(30 + i, p, params) for i, (p, params) in enumerate(zip(_prompts(), [GREEDY, SAMPLED[0], GREEDY]))]
    h.prefill(tracks)
    _scripted_rounds(h, [t.seq_id for t in tracks])
    h.release_all()


@pytest.mark.parametrize("params", [[GREEDY] * 3, SAMPLED], ids=["greedy", "sampled"])
def test_first_round_cache_built_after_the_prefill(draft_path, params):
    """After the prefill the prompt is a speculation with no drafts: the build forks only at k = 0 (the
    F_0 likeliest tokens after the prompt, each decoded K deep as plain decoding would), the first request
    (k = 0, the prompt step's token) hits when that token was prepared and falls back when not, and later
    rounds glue and hit as usual."""
    h = Harness(make_engine(draft_path))
    tracks = [Track(50 + i, p, q) for i, (p, q) in enumerate(zip(_prompts(), params))]
    h.prefill(tracks)
    a, b, c = (t.seq_id for t in tracks)
    h.engine.expect_first_round({a: K, b: K, c: K})
    h.build({a: [3, 0, 0, 0], b: [2, 0, 0, 0], c: [1, 0, 0, 0]})
    assert {key for key in h.engine.states[a].cache} == {(0, t) for t in h.ref.ranking(tracks[0].text, -1)[:3]}
    results = h.serve({a: h.key_at(a, 0, 2), b: h.key_at(b, 0), c: h.uncached_at(c, 0)}, "jit")
    assert [results[s].hit for s in (a, b, c)] == [True, True, False]
    h.build({s: f for s, f in zip((a, b, c), FAN_OUTS)})
    results = h.serve({a: h.key_at(a, K), b: h.key_at(b, 1), c: h.key_at(c, 0)}, "jit")
    assert all(results[s].hit for s in (a, b, c))
    h.release_all()


@pytest.mark.parametrize("params", [[GREEDY] * 3, SAMPLED], ids=["greedy", "sampled"])
def test_dynamic_fan_out_builds_each_sequences_likeliest_outcomes(draft_path, params):
    """A dynamic plan forks the `budget` outcomes likeliest by the draft's own probabilities, calibrated by
    the verified rounds so far, and each branch drafts as deep as its path is worth (both checked in
    ``Harness.build``); every branch equals plain decoding, and the served outcomes (the deepest prepared key,
    or an unprepared one) teach the calibration."""
    h = Harness(make_engine(draft_path))
    tracks = [Track(60 + i, p, q) for i, (p, q) in enumerate(zip(_prompts(), params))]
    h.prefill(tracks)
    ids = [t.seq_id for t in tracks]
    h.serve({s: (-1, 100 + s) for s in ids}, "jit")
    # a random checkpoint is nearly uniform; as if the target had accepted 90% of its drafts so far, so that
    # likely branches draft deep and the tree narrows with depth
    for i in range(200):
        for p in np.linspace(0.0, 1.0, 21):
            h.engine.calibration.observe(float(p), False, i % 10 != 0)
    lengths = set()
    for r in range(5):
        h.build({s: DynamicFanOut(budget) for s, budget in zip(ids, (1, 4, 9))})
        lengths.update(len(entry.tokens) for s in ids for entry in h.engine.states[s].cache.values())
        outcomes = {s: max(h.engine.states[s].cache) if (r + i) % 3 else h.uncached_at(s, 0)
                    for i, s in enumerate(ids)}
        results = h.serve(outcomes, "random" if r == 2 else "jit")
        assert [results[s].hit for s in ids] == [bool((r + i) % 3) for i in range(len(ids))]
    assert lengths == set(range(1, K + 1))  # likely branches drafted K tokens, unlikely ones stopped earlier
    calibration = h.engine.calibration
    assert any(calibration.rate(b / 10 + 0.05) != pytest.approx(b / 10 + 0.05) for b in range(10))
    h.release_all()


@pytest.mark.parametrize("steps", [1, 2])
def test_a_build_cut_short_keeps_the_tokens_drafted_so_far(draft_path, steps):
    """When the next request arrives mid-build (``should_stop`` says yes after `steps` tree steps), every
    branch keeps its first `steps` tokens, exactly as a full build would have drafted them, and a lookup
    serves them as a (shorter) hit."""
    h = Harness(make_engine(draft_path))
    tracks = [Track(40 + i, p, params) for i, (p, params) in enumerate(zip(_prompts(), [GREEDY, SAMPLED[0]]))]
    h.prefill(tracks)
    h.serve({t.seq_id: (-1, 42 + i) for i, t in enumerate(tracks)}, "jit")
    asked = []

    def should_stop() -> bool:
        asked.append(True)
        return len(asked) >= steps

    h.build({t.seq_id: [2] * (K + 1) for t in tracks}, should_stop, depth=steps)
    assert len(asked) == steps and h.engine.last_build.depth == steps and h.engine.last_build.cut_short
    results = h.serve({t.seq_id: h.key_at(t.seq_id, 1) for t in tracks}, "jit")
    assert all(r.hit and len(r.tokens) == steps for r in results.values())
    h.build({t.seq_id: [2] * (K + 1) for t in tracks}, lambda: False)  # never asked to stop: full depth
    assert h.engine.last_build.depth == K and not h.engine.last_build.cut_short
    h.release_all()


def test_fork_excludes_the_rejected_draft(draft_path):
    """Greedy drafts are the argmax, so with F_k = 1 the candidate for a rejection at k < K is the
    second-ranked token (the rejected draft itself can never be the recovery), and for k = K the top one."""
    h = Harness(make_engine(draft_path))
    (prompt, *_) = _prompts()
    h.prefill([Track(1, prompt, GREEDY)])
    h.serve({1: (-1, 42)}, "jit")
    h.build({1: [1] * (K + 1)})
    track = h.tracks[1]
    cache = h.engine.states[1].cache
    for k in range(K + 1):
        order = h.ref.ranking(track.text + track.spec, len(track.text) - 1 + k)
        expected = order[1] if k < K else order[0]
        assert [key for key in cache if key[0] == k] == [(k, expected)]
        if k < K:
            assert order[0] == track.spec[k]
    h.release_all()


def test_consistency_decides_the_lookup(draft_path):
    """A key is served only when the committed tokens match the speculation it was built for: the same
    (k, t*) after tokens that disagree with the drafts is a miss (served by the fallback)."""
    for consistent in (True, False):
        h = Harness(make_engine(draft_path))
        (prompt, *_) = _prompts()
        h.prefill([Track(1, prompt, GREEDY)])
        h.serve({1: (-1, 42)}, "jit")
        h.build({1: [2] * (K + 1)})
        track = h.tracks[1]
        k, token = h.key_at(1, 2)
        new = track.spec[:k] + [token]
        if not consistent:
            new[0] = (new[0] + 1) % USABLE  # the target accepted something else
        (result,) = h.engine.speculate([SpeculateRow(1, new, k, K)], "jit")
        assert result.hit is consistent
        assert result.fallback is (None if consistent else Fallback.JIT)
        assert result.tokens == h.ref.argmaxes(track.text + new, result.tokens)
        h.tracks[1].text = track.text + new
        h.release_all()


def test_saguaro_scales_only_the_candidates(draft_path):
    """q_C = q scaled by C on the F_j candidates, renormalised: the ratio q_C / q is C*s on the candidates
    and s elsewhere, with s = 1 / (1 - (1 - C) * q(candidates)); rows sum to 1."""
    c = 0.5
    h = Harness(make_engine(draft_path, c), c)
    (prompt, *_) = _prompts()
    params = SamplingParams(temperature=1.5)
    h.prefill([Track(1, prompt, params)])
    h.serve({1: (-1, 42)}, "jit")
    fan_out = [3, 1, 2, 2]
    h.build({1: fan_out})
    track = h.tracks[1]
    (k, cand), entry = next(iter(h.engine.states[1].cache.items()))
    prefix = track.text + track.spec[:k] + [cand]
    for j in range(K):
        text = prefix + entry.tokens[:j]
        plain = h.ref.q(text, params, 0, 1.0)  # [V]
        scaled = entry.probs[j]  # [V]
        top = torch.topk(h.ref.logits(text)[-1], fan_out[j]).indices
        in_top = torch.zeros(TARGET_VOCAB, dtype=torch.bool)
        in_top[top] = True
        s = 1.0 / (1.0 - (1.0 - c) * float(plain[top].sum()))
        torch.testing.assert_close(scaled[in_top], c * s * plain[in_top], atol=ATOL, rtol=1e-4)
        torch.testing.assert_close(scaled[~in_top], s * plain[~in_top], atol=ATOL, rtol=1e-4)
        assert abs(float(scaled.sum()) - 1.0) < 1e-5
        assert float(scaled[in_top].sum()) < float(plain[in_top].sum())  # mass really moved off them
    h.release_all()


def test_draft_stream_is_not_the_targets(draft_path):
    """The target seeds a request's generator with the request's seed; the draft must draw from another
    stream, or its j-th draft would reuse the target's j-th uniform (e.g. the acceptance test of the draft
    before it), which biases the output (the sampling tests in test_ssd.py detect that bias)."""
    engine = make_engine(draft_path)
    params = SamplingParams(temperature=1.0, seed=1234)
    engine.prefill([(1, [5, 6, 7], params), (2, [5, 6, 7], SamplingParams(temperature=1.0))])
    target = torch.Generator().manual_seed(1234)
    draft = engine.states[1].generator
    assert not torch.equal(draft.get_state(), target.get_state())
    assert not torch.equal(engine.states[2].generator.get_state(), torch.Generator().manual_seed(0).get_state())
