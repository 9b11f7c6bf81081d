"""SSD end to end (draft in its own process): exact greedy tokens, exact sampling, draft = target, faults.

Exactness is the product: whatever the lookahead, fan-out, fallback, batch, prefix-cache reuse or
preemption, SSD must emit plain autoregressive decoding's greedy tokens, and its samples must follow the
target's processed distribution. The draft is a slightly perturbed copy of the target (``SIGMA`` below), so
rounds accept partially: cache hits, misses and every acceptance length occur. Each SSD engine costs a
process start, so one engine serves all the checks of its configuration.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import signal
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

from ssd import LLM, SamplingParams
from ssd.speculative.async_draft.planning.fanout import fold_fan_out
from ssd_utils import ExactJoint, chi_square_gof, exact_joint, make_corrupt_checkpoint, make_perturbed_draft

BLOCK = 16
MAX_LEN = 160
SIGMA = 0.04  # relative weight noise of the draft: about 40-60% of drafts accepted
SHARED = 40  # tokens of the prefix shared by two prompts
BASE = dict(dtype="float32", block_size=BLOCK, max_model_len=MAX_LEN, seed=0)


def _prompts() -> list[list[int]]:
    """Mixed lengths around block boundaries; prompts 6 and 7 share a 40-token prefix."""
    gen = torch.Generator().manual_seed(4321)

    def rand(n: int) -> list[int]:
        return torch.randint(3, 500, (n,), generator=gen).tolist()

    shared = rand(SHARED)
    return [rand(1), rand(3), rand(8), rand(16), rand(17), rand(31), shared + rand(5), shared + rand(9), rand(70)]


PROMPTS = _prompts()
# Different lengths: near its end a request gets fewer than K drafts (lookahead clamped to its budget).
GREEDY = [SamplingParams(temperature=0.0, max_tokens=20 + 4 * i, ignore_eos=True) for i in range(len(PROMPTS))]


@dataclass
class Models:
    target: Path
    draft: Path
    corrupt: Path
    expected: list[list[int]]  # plain AR greedy continuation of each prompt (GREEDY options)
    bytes_per_block: int


@pytest.fixture(scope="module")
def models(checkpoint_factory, tmp_path_factory) -> Models:
    target = checkpoint_factory()
    root = tmp_path_factory.mktemp("ssd_drafts")
    draft = make_perturbed_draft(target, root / "draft", SIGMA)
    corrupt = make_corrupt_checkpoint(target, root / "corrupt")
    with LLM(str(target), kv_cache_memory="16MiB", **BASE) as ar:
        outputs = ar.generate(PROMPTS, GREEDY)
        bpb = ar.engine.runner.bytes_per_block()
    return Models(target, draft, corrupt, [o.token_ids for o in outputs], bpb)


def _ssd(models: Models, draft: Path | None = None, kv_blocks: int | None = None, max_num_seqs: int = 8,
         max_num_batched_tokens: int = 2048, **spec) -> LLM:
    memory = "16MiB" if kv_blocks is None else kv_blocks * models.bytes_per_block
    return LLM(
        str(models.target),
        kv_cache_memory=memory,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        speculative_config={"method": "ssd", "model": str(draft or models.draft), **spec},
        **BASE,
    )


def _assert_greedy(outputs, models: Models, indices) -> None:
    assert len(outputs) == len(indices)
    for out, i in zip(outputs, indices):
        assert out.prompt_token_ids == PROMPTS[i]
        assert out.token_ids == models.expected[i], f"prompt {i} (length {len(PROMPTS[i])}) differs from AR"
        assert out.finish_reason == "length"


def _no_children_after_shutdown(llm: LLM, pid: int | None) -> None:
    llm.shutdown()
    assert llm.engine.proposer is None
    assert not [p for p in multiprocessing.active_children() if p.name == "ssd-draft" or p.pid == pid]
    if pid is not None:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)  # reaped, not a zombie


def test_two_engines_in_one_process_plan_the_same_layout(models):
    """The first SSD engine pins this process to its target cores; a second one must still plan from the
    process's own cores (not put its draft on the first engine's target core), and the affinity comes back
    when the last engine shuts down."""
    before = os.sched_getaffinity(0)
    with _ssd(models, num_speculative_tokens=2) as first:
        with _ssd(models, num_speculative_tokens=2) as second:
            assert second.engine.layout == first.engine.layout
            assert os.sched_getaffinity(0) == set(first.engine.layout.rank_cpus[0] or before)
        assert os.sched_getaffinity(0) == set(first.engine.layout.rank_cpus[0] or before)
    assert os.sched_getaffinity(0) == before


# ------------------------------------------------------------------------------------------------
# greedy: token for token equal to plain AR decoding

GREEDY_CONFIGS = {
    "K1-fanout1-jit": dict(num_speculative_tokens=1, fan_out=1, fallback="jit"),
    "K3-fanout2-random-full-builds": dict(num_speculative_tokens=3, fan_out=2, fallback="random",
                                          interruptible_build=False),
    "K5-list-auto-chunked-full-builds": dict(
        num_speculative_tokens=5, fan_out=[3, 2, 1, 1, 1, 2], fan_out_miss=[4, 1, 0, 0, 0, 1], fallback="auto",
        max_num_batched_tokens=24, interruptible_build=False,
    ),
    "K3-auto-jit-preempt": dict(num_speculative_tokens=3, fan_out="auto", fallback="jit", kv_blocks=12),
    "K5-auto-random-preempt": dict(num_speculative_tokens=5, fan_out="auto", fallback="random", kv_blocks=14),
    "K3-fanout2-jit-no-lookup": dict(num_speculative_tokens=3, fan_out=2, fallback="jit", prompt_lookup=False),
    "K3-fanout2-random-no-lookup": dict(num_speculative_tokens=3, fan_out=2, fallback="random", prompt_lookup=False),
    "K4-auto-auto-adaptive": dict(num_speculative_tokens=4, fan_out="auto", fallback="auto", adaptive_lookahead=True),
    "K3-auto-random-no-prompt-step": dict(num_speculative_tokens=3, fan_out="auto", fallback="random",
                                          prompt_step_speculation=False),
    "K4-dynamic-random-preempt": dict(num_speculative_tokens=4, fan_out="dynamic", fallback="random", kv_blocks=14),
    "K3-dynamic-budget5-jit-miss-list": dict(num_speculative_tokens=3, fan_out="dynamic", fan_out_budget=5,
                                             fan_out_miss=[2, 1, 0, 1], fallback="jit"),
}
ALLOWED_FALLBACKS = {"jit": {"jit"}, "random": {"random"}, "auto": {"jit", "random"}}


@pytest.mark.parametrize("name", list(GREEDY_CONFIGS))
def test_greedy_equals_autoregressive(models, name):
    """Batch 1, then the whole set (batches up to 8 with requests joining as others finish), then the
    prompts longer than a block again (prefix-cache hits on target and draft). Every token equals plain
    AR decoding."""
    config = dict(GREEDY_CONFIGS[name])
    K = config["num_speculative_tokens"]
    preempt = "kv_blocks" in config
    with _ssd(models, **config) as llm:
        assert llm.engine.proposer.available, llm.engine.proposer.failure
        all_outputs = []
        for indices in ([5], list(range(len(PROMPTS))), [4, 5, 6, 7, 8]):
            outputs = llm.generate([PROMPTS[i] for i in indices], [GREEDY[i] for i in indices])
            _assert_greedy(outputs, models, indices)
            all_outputs.extend(outputs)
        assert all(o.speculation == "ssd" for o in all_outputs)
        # the last run reused cached prefixes (all of them, unless the tiny pool evicted some)
        cached = [o.metrics.num_cached_prompt_tokens for o in outputs]
        assert sum(cached) > 0 if preempt else min(cached) >= BLOCK
        if preempt:
            assert sum(o.metrics.num_preemptions for o in all_outputs) > 0
        assert llm.engine.kv_manager.num_free_blocks == llm.engine.kv_manager.num_total_blocks

        s = llm.stats
        assert s.cache_lookups == s.num_drafts > 0  # every speculative round looked the cache up
        assert 0 < s.cache_hits < s.cache_lookups
        assert sum(s.fallbacks.values()) == s.cache_lookups - s.cache_hits
        assert set(s.fallbacks) <= ALLOWED_FALLBACKS[config["fallback"]]
        if config["fallback"] != "auto":
            assert set(s.fallbacks) == {config["fallback"]}
        assert 0 < s.acceptance_rate < 1
        assert s.acceptance_histogram[0] > 0
        assert 0 <= s.draft_builds_cut_short <= s.draft_builds
        if not config.get("interruptible_build", True):  # every build reaches K: some round verifies K drafts
            assert s.draft_builds_cut_short == 0
            assert len(s.acceptance_histogram) == K + 1 and s.acceptance_histogram[K] > 0
        else:  # builds cut short serve fewer drafts; the target's tiny model verifies faster than K draft steps
            assert len(s.acceptance_histogram) <= K + 1
        assert s.num_accepted_tokens == s.accepted_on_hit + s.accepted_on_miss
        if config.get("prompt_lookup", True):  # random checkpoints repeat themselves: copies happen and some hold
            assert 0 < s.num_accepted_copied_tokens < s.num_copied_tokens < s.num_draft_tokens
        else:
            assert s.num_copied_tokens == 0
            if config["fallback"] == "random":  # nothing to copy: every miss verifies no draft at all
                assert s.rounds_on_miss > 0 and s.accepted_on_miss == 0
                assert s.num_draft_tokens <= K * s.rounds_on_hit
        per_request = sum(o.spec_stats.cache_hits for o in all_outputs)
        assert per_request == s.cache_hits
        pid = llm.engine.proposer.pid
        _no_children_after_shutdown(llm, pid)


# ------------------------------------------------------------------------------------------------
# draft = target, greedy: every round hits (after the first when the prompt's step speculates) and accepts everything


def _full_acceptance_rounds(max_tokens: int, K: int, prompt_step: bool = False) -> list[int]:
    """Drafts per speculative round when every round accepts everything: from the prefill step on (the
    prompt's last token is the first pending token) with ``prompt_step`` speculation, else from the step
    after it (the prompt's step emits its one token alone), each round gets min(K, tokens left - 1) drafts and
    emits that many + 1; with none left over the step decodes plainly."""
    rounds, produced = [], 0 if prompt_step else 1
    while produced < max_tokens:
        n = min(K, max_tokens - produced - 1)
        if n > 0:
            rounds.append(n)
        produced += n + 1
    return rounds


@pytest.mark.parametrize("prompt_step", [False, True], ids=["first-round-after-prompt", "prompt-step-speculates"])
def test_draft_equal_to_target_hits_every_round_and_accepts_everything(models, prompt_step):
    """Greedy with the target as its own draft: every round finds its key (k = all drafts, t* = the bonus,
    which is the draft's own top candidate) and accepts all of its drafts, so the rounds are exactly those
    of full acceptance (``_full_acceptance_rounds``), including the short last ones. The first round has a
    key too when the prompt's step emits its token alone (the default): the worker builds its cache while
    the target computes the prompt (candidates for that token; the last request, which joins while the
    others decode, gets it with their next cache build); when the prompt's step speculates,
    that first round has nothing cached and misses. Prompt lookup is off: a copied token would be a draft the
    target's own model did not choose; dense weights: the draft must be the target to the last bit (float16
    weights could flip a near tie); builds never cut short (a hit would then hold fewer than K drafts)."""
    K = 3
    misses = 1 if prompt_step else 0  # per request
    with _ssd(models, draft=models.target, max_num_seqs=len(PROMPTS) - 1, num_speculative_tokens=K, fan_out=1,
              fallback="jit", prompt_lookup=False, draft_weight_format="dense", interruptible_build=False,
              prompt_step_speculation=prompt_step) as llm:
        outputs = llm.generate(PROMPTS, GREEDY)
        _assert_greedy(outputs, models, range(len(PROMPTS)))
        for out, params in zip(outputs, GREEDY):
            s = out.spec_stats
            rounds = _full_acceptance_rounds(params.max_tokens, K, prompt_step)
            assert s.num_drafts == len(rounds) > 1
            assert s.num_draft_tokens == s.num_accepted_tokens == sum(rounds)
            assert s.acceptance_histogram == [rounds.count(k) for k in range(K + 1)]
            assert s.cache_lookups == s.num_drafts
            assert s.cache_hits == s.cache_lookups - misses
            assert s.fallbacks == ({"jit": 1} if misses else {})
            assert s.accepted_on_miss == (rounds[0] if misses else 0)
        total = llm.stats
        assert total.cache_hits == total.cache_lookups - misses * len(PROMPTS)
        assert total.num_accepted_tokens == total.num_draft_tokens
        # F = 1: a build after a speculation of n drafts has K + 1 branches: one per k, and the K - n
        # candidates of the unreachable k > n folded onto the bonus (``fold_fan_out``); a first-round build
        # after the prefill (n = 0) has all K + 1 at k = 0. Each reply reports the build before it, so the
        # build after the very last speculation request is never counted; that request may hold the last
        # round of every sequence still running (at most K + 1 branches each).
        rounds = [n for params in GREEDY for n in _full_acceptance_rounds(params.max_tokens, K, prompt_step)]
        rounds += [] if prompt_step else [0] * len(PROMPTS)
        built = sum(sum(fold_fan_out([1] * (K + 1), n)) for n in rounds)
        assert built - len(PROMPTS) * (K + 1) <= total.draft_build_branches <= built
        _no_children_after_shutdown(llm, llm.engine.proposer.pid)


def test_interrupted_builds_still_hit_every_round_and_accept_everything(models):
    """Draft = target, greedy, builds interruptible (the default): a build the next request cuts short
    leaves every branch with fewer drafts, and the lookup still hits and its drafts are all accepted; the
    tokens equal AR, and the worker's build counts reach the engine's statistics."""
    K = 3
    # A fixed K: an adaptive round without drafts (exploring K = 0) leaves the draft's cache one step behind,
    # and the next lookup of that sequence misses by design.
    with _ssd(models, draft=models.target, num_speculative_tokens=K, fan_out=1, fallback="jit",
              prompt_lookup=False, draft_weight_format="dense", adaptive_lookahead=False) as llm:
        outputs = llm.generate(PROMPTS, GREEDY)
        _assert_greedy(outputs, models, range(len(PROMPTS)))
        s = llm.stats
        assert s.cache_hits == s.cache_lookups  # the first round's cache is built while the prompt is computed
        assert s.num_accepted_tokens == s.num_draft_tokens
        assert 0 <= s.draft_builds_cut_short <= s.draft_builds and s.draft_builds > len(PROMPTS)


def test_adaptive_lookahead_hits_whatever_lookahead_each_round_chooses(models):
    """With an adaptive lookahead the worker still builds every cache for the full K, so a round may verify
    fewer drafts than the next one asks for and the next lookup still hits: draft = target, greedy, the
    lookahead scripted to change every step (3, 1, 2, ...): every round hits (the first from the cache the
    worker built while the target computed the prompt) and accepts all its drafts, and the tokens equal AR."""
    K = 3
    with _ssd(models, draft=models.target, num_speculative_tokens=K, fan_out=1, fallback="jit",
              prompt_lookup=False, draft_weight_format="dense", adaptive_lookahead=True,
              interruptible_build=False) as llm:
        script = itertools.cycle([3, 1, 2, 1, 3, 2])
        llm.engine.rounds.policy.choose = lambda seq_ids: next(script)
        outputs = llm.generate(PROMPTS, GREEDY)
        _assert_greedy(outputs, models, range(len(PROMPTS)))
        s = llm.stats
        assert s.cache_hits == s.cache_lookups
        assert s.num_accepted_tokens == s.num_draft_tokens
        assert all(s.acceptance_histogram[k] > 0 for k in (1, 2, 3))  # every lookahead was verified
        _no_children_after_shutdown(llm, llm.engine.proposer.pid)


# ------------------------------------------------------------------------------------------------
# sampling: the target's exact distribution

SAMPLE_PROMPT = [17, 244, 90, 3, 411, 58]
REPEATING_PROMPT = [17, 244, 90, 3, 17, 244, 90, 3, 17, 244]  # prompt lookup copies from it
NUM_SAMPLES = 1500
NUM_TOKENS = 5
ALPHA = 1e-4  # false-failure rate of each chi-square test (for a random choice of seeds)
WRONG_TEMPERATURE = 0.6  # a bias the test must detect: total variation 0.1 over the 32 paths
SAMPLED = SamplingParams(temperature=1.0, top_k=2, max_tokens=NUM_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def exact(models) -> ExactJoint:
    """The target's exact distribution of the first NUM_TOKENS tokens (top-k 2: 32 paths)."""
    return exact_joint(models.target, SAMPLE_PROMPT, NUM_TOKENS, SAMPLED)


@pytest.fixture(scope="module")
def exact_repeating(models) -> ExactJoint:
    return exact_joint(models.target, REPEATING_PROMPT, NUM_TOKENS, SAMPLED)


# The first three and the dynamic fan-out exercise the draft model alone, the others prompt lookup too; builds
# are interruptible (the default: hits cut short serve fewer drafts) except where the name says "full-builds";
# the prompt's step speculates only where the name says "prompt-step" (there it copies the prompt's repeat at
# once).
SAMPLING_CONFIGS = {
    "saguaro1-jit-full-builds": dict(num_speculative_tokens=2, fan_out=2, fallback="jit", saguaro_c=1.0,
                                     prompt_lookup=False, interruptible_build=False),
    # F = 1 scales only the top token: with top-k 2 and F = 2 the whole support would be scaled (no change)
    "saguaro0.5-jit": dict(num_speculative_tokens=2, fan_out=1, fallback="jit", saguaro_c=0.5, prompt_lookup=False),
    "random-fallback": dict(num_speculative_tokens=2, fan_out=[2, 1, 1], fallback="random", saguaro_c=0.5,
                            prompt_lookup=False),
    "lookup-jit-full-builds": dict(num_speculative_tokens=3, fan_out=2, fallback="jit", saguaro_c=0.5,
                                   interruptible_build=False),
    "lookup-random-prompt-step": dict(num_speculative_tokens=3, fan_out=[2, 1, 1, 2], fallback="random",
                                      prompt_step_speculation=True),
    "adaptive-jit": dict(num_speculative_tokens=3, fan_out=2, fallback="jit", adaptive_lookahead=True),
    "dynamic-saguaro0.5-random": dict(num_speculative_tokens=2, fan_out="dynamic", fallback="random", saguaro_c=0.5,
                                      prompt_lookup=False),
}


@pytest.mark.parametrize("name", list(SAMPLING_CONFIGS))
def test_sampling_matches_the_target_distribution(models, exact, exact_repeating, name):
    """The first NUM_TOKENS tokens of NUM_SAMPLES seeded requests follow the target's exact joint
    distribution (chi-square goodness of fit over 32 paths, rare ones pooled). Five tokens span the
    prefill token, a first round served by the fallback and later rounds served by hits and misses.
    Greedy requests share the batches and must still equal AR. With prompt lookup the prompt repeats
    itself, so copied drafts (one-hot q) are proposed, accepted and rejected."""
    config = SAMPLING_CONFIGS[name]
    K = config["num_speculative_tokens"]
    lookup = config.get("prompt_lookup", True)
    prompt, exact = (REPEATING_PROMPT, exact_repeating) if lookup else (SAMPLE_PROMPT, exact)
    greedy_idx = [0, 3, 6]
    prompts = [PROMPTS[i] for i in greedy_idx] + [prompt] * NUM_SAMPLES
    params = [GREEDY[i] for i in greedy_idx] + [replace(SAMPLED, seed=seed) for seed in range(NUM_SAMPLES)]
    with _ssd(models, max_num_seqs=128, **config) as llm:
        outputs = llm.generate(prompts, params)
        counters = llm.stats
        _no_children_after_shutdown(llm, llm.engine.proposer.pid)
    _assert_greedy(outputs[: len(greedy_idx)], models, greedy_idx)
    samples = [tuple(o.token_ids) for o in outputs[len(greedy_idx) :]]
    assert all(o.speculation == "ssd" for o in outputs)
    result = chi_square_gof(samples, exact)
    assert result.df >= 10
    assert result.p_value > ALPHA, f"{name}: chi2 = {result.statistic:.1f} on {result.df} df, p = {result.p_value:.2e}"
    # the run covered what the test claims to cover
    assert counters.cache_hits > 0 and counters.cache_lookups > counters.cache_hits
    assert counters.acceptance_histogram[0] > 0
    if config.get("interruptible_build", True):
        assert counters.draft_builds_cut_short > 0  # shorter hits were served and verified
    else:
        assert counters.draft_builds_cut_short == 0 and counters.acceptance_histogram[K] > 0
    fallback = config["fallback"]
    assert set(counters.fallbacks) == {fallback}
    if lookup:
        assert 0 < counters.num_accepted_copied_tokens < counters.num_copied_tokens


def test_chi_square_has_power(models, exact):
    """The goodness-of-fit test can fail: NUM_SAMPLES paths drawn from the exact joint at temperature 0.6
    instead of 1.0 are rejected, while paths drawn from the right joint pass. (Exactness bugs found so far,
    such as drafts correlated with their own acceptance draws, were biases of this size or larger.)"""
    gen = torch.Generator().manual_seed(0)

    def draw(joint: ExactJoint) -> list[tuple[int, ...]]:
        paths = list(joint.probs)
        weights = torch.tensor([joint.probs[p] for p in paths], dtype=torch.float64)
        return [paths[i] for i in torch.multinomial(weights, NUM_SAMPLES, replacement=True, generator=gen).tolist()]

    assert chi_square_gof(draw(exact), exact).p_value > ALPHA
    biased = exact_joint(models.target, SAMPLE_PROMPT, NUM_TOKENS, replace(SAMPLED, temperature=WRONG_TEMPERATURE))
    assert chi_square_gof(draw(biased), exact).p_value < ALPHA


# ------------------------------------------------------------------------------------------------
# faults: a dead, broken or hung draft never changes the output


def test_killed_draft_worker_leaves_exact_plain_decoding(models):
    """SIGKILL the worker between two engine steps, once speculative rounds have run: every request
    finishes with AR's tokens, the ones still running report speculation disabled, later requests are served
    exactly without speculation, and shutdown leaves no child process."""
    with _ssd(models, num_speculative_tokens=3, fan_out=2, fallback="jit") as llm:
        engine = llm.engine
        proposer = engine.proposer
        pid = proposer.pid
        ids = [engine.add_request(p, sp).request_id for p, sp in zip(PROMPTS, GREEDY)]
        finished = {}
        running_at_kill: set[str] = set()
        while engine.has_unfinished():
            outputs = engine.step()
            finished.update((o.request_id, o) for o in outputs if o.finished)
            if not running_at_kill and any(len(o.token_ids) >= 6 for o in outputs):
                assert proposer.available
                os.kill(pid, signal.SIGKILL)
                running_at_kill = {r.request_id for r in engine.requests.values()}
        _assert_greedy([finished[i] for i in ids], models, range(len(PROMPTS)))
        assert running_at_kill
        for request_id in ids:
            expected = "disabled" if request_id in running_at_kill else "ssd"
            assert finished[request_id].speculation.startswith(expected)
        assert not proposer.available and proposer.failure
        again = llm.generate(PROMPTS[:3], GREEDY[:3])
        _assert_greedy(again, models, range(3))
        assert all(o.speculation.startswith("disabled") for o in again)
        _no_children_after_shutdown(llm, pid)


def test_draft_that_fails_to_load_leaves_exact_plain_decoding(models):
    """Config and tokenizer are fine (the engine accepts the draft) but the weights are garbage: the worker
    reports its start failure and the engine serves every request exactly without speculation."""
    with _ssd(models, draft=models.corrupt, num_speculative_tokens=3) as llm:
        proposer = llm.engine.proposer
        assert not proposer.available
        assert "failed to start" in proposer.failure
        outputs = llm.generate(PROMPTS, GREEDY)
        _assert_greedy(outputs, models, range(len(PROMPTS)))
        assert all(o.speculation.startswith("disabled") for o in outputs)
        assert all(o.spec_stats.cache_hits == 0 for o in outputs)
        _no_children_after_shutdown(llm, proposer.pid)


def test_hung_draft_worker_times_out(models):
    """SIGSTOP the worker: the next round waits draft_timeout_s, then the engine gives the worker up (and
    kills it) and finishes every request exactly by plain decoding."""
    with _ssd(models, num_speculative_tokens=3, fan_out=2, fallback="jit", draft_timeout_s=1.0) as llm:
        proposer = llm.engine.proposer
        pid = proposer.pid
        finished = {}
        stopped = False
        try:
            for out in llm.stream(PROMPTS, GREEDY):
                if out.finished:
                    finished[out.request_id] = out
                if not stopped and len(out.token_ids) >= 6:
                    if proposer.available:  # (a slow round may already have timed out on a loaded machine)
                        os.kill(pid, signal.SIGSTOP)
                    stopped = True
        finally:
            if proposer.available:  # the timeout never fired: do not leave a stopped process behind
                os.kill(pid, signal.SIGKILL)
                proposer.shutdown()
        outputs = sorted(finished.values(), key=lambda o: int(o.request_id))
        _assert_greedy(outputs, models, range(len(PROMPTS)))
        assert stopped and not proposer.available
        assert "did not answer" in proposer.failure
        assert any(o.speculation.startswith("disabled") for o in outputs)
        _no_children_after_shutdown(llm, pid)


def test_interruptible_build_option_and_flag():
    import argparse

    from ssd.cli.common import add_engine_args, engine_kwargs
    from ssd.config import SpeculativeConfig

    assert SpeculativeConfig(method="ssd", model="d").interruptible_build is True
    with pytest.raises(ValueError, match="interruptible_build must be True or False"):
        SpeculativeConfig(method="ssd", model="d", interruptible_build="no")
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    spec = engine_kwargs(parser.parse_args(["--model", "t", "--draft", "d", "--full-builds"]))["speculative_config"]
    assert spec["interruptible_build"] is False
    spec = engine_kwargs(parser.parse_args(["--model", "t", "--draft", "d"]))["speculative_config"]
    assert spec["interruptible_build"] is True and spec["prompt_step_speculation"] is False
    assert spec["prompt_step_speculation"] is SpeculativeConfig(method="ssd", model="d").prompt_step_speculation
    spec = engine_kwargs(parser.parse_args(["--model", "t", "--draft", "d", "--prompt-step-speculation"]))
    assert spec["speculative_config"]["prompt_step_speculation"] is True
    spec = engine_kwargs(parser.parse_args(["--model", "t", "--draft", "d", "--no-prompt-step-speculation"]))
    assert spec["speculative_config"]["prompt_step_speculation"] is False
    with pytest.raises(ValueError, match="prompt_step_speculation must be True or False"):
        SpeculativeConfig(method="ssd", model="d", prompt_step_speculation=1)
