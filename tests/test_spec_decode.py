"""Speculative decoding with a draft model is exact.

- greedy: the tokens equal plain autoregressive decoding of the target, for mixed-length batches of 1..8,
  K in {1, 3, 5, 8}, drafts that agree often, rarely, or always (draft == target), with chunked prefill,
  preemption and prefix-cache hits in the run;
- sampling: the joint distribution of the first four tokens (all produced by verification: the first round
  speculates from the prefill step) equals the target's processed distribution, enumerated exactly from
  ``transformers`` logits with ``processed_probs``; chi-square test with false-failure rate ALPHA; greedy
  requests mixed into a sampled batch still equal AR;
- seeded requests reproduce their tokens whatever batch they are in (AR and SD).

Drafts: a *close* draft is the target's checkpoint with Gaussian noise added to every weight (greedy
acceptance about 50%, so every acceptance length occurs); a *random* draft is an unrelated checkpoint with
the same tokenizer (almost every greedy draft is rejected). Sampling tests use a 259-token vocabulary (the
smallest byte-level tokenizer) and a target whose LM head is scaled up, so that a few thousand samples
cover the joint distribution well; their drafts are noisy copies of it (acceptance about 40% and 10%).
"""

from __future__ import annotations

import dataclasses
import functools
import shutil
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import scipy.stats
import torch
import transformers
from safetensors.torch import load_file, save_file

from ssd import LLM, SamplingParams
from ssd.sample.sampler import SamplingTensors, processed_probs

BLOCK = 16
MAX_LEN = 128
ALPHA = 1e-4  # false-failure rate of each chi-square test for a correct engine (over the choice of seeds)


def modified_copy(src: Path, dst: Path, noise: float = 0.0, head_scale: float = 1.0, seed: int = 0) -> Path:
    """Copy a checkpoint folder, adding ``noise * std(W)`` Gaussian noise to every tensor W and scaling the
    LM head (a larger head makes the distributions peakier). The tokenizer is copied unchanged."""
    shutil.copytree(src, dst)
    tensors = load_file(src / "model.safetensors")
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name in sorted(tensors):
        w = tensors[name]
        out[name] = w + noise * w.std() * torch.randn(w.shape, generator=gen)
    out["lm_head.weight"] = out["lm_head.weight"] * head_scale
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def models(checkpoint_factory, tmp_path_factory):
    """Checkpoint folders by role, built lazily."""
    root = tmp_path_factory.mktemp("spec_models")

    @functools.cache
    def get(name: str) -> str:
        if name == "target":
            return str(checkpoint_factory(arch="llama"))
        if name == "close":
            return str(modified_copy(Path(get("target")), root / "close", noise=0.04, seed=11))
        if name == "random":
            return str(checkpoint_factory(arch="llama", seed=1, num_layers=1))
        # vocabulary 259 (bytes + 3 specials, the smallest tokenizer) with a peaky LM head for sampling tests
        if name == "small_target":
            base = checkpoint_factory(arch="llama", vocab_size=259)
            return str(modified_copy(Path(base), root / "small_target", head_scale=4.0))
        if name == "small_close":
            return str(modified_copy(Path(get("small_target")), root / "small_close", noise=0.05, seed=5))
        if name == "small_far":
            return str(modified_copy(Path(get("small_target")), root / "small_far", noise=0.12, seed=6))
        raise KeyError(name)

    return get


NGRAM = "ngram"  # as ``draft``: method "ngram", prompt lookup alone


def make_llm(model: str, draft: str | None = None, k: int = 3, prompt_lookup: bool = True,
             draft_weight_format: str = "auto", adaptive_lookahead: bool = False,
             prompt_step_speculation: bool | None = None, **kwargs) -> LLM:
    """An engine on the test models; ``prompt_step_speculation=None`` keeps the engine's default."""
    options = dict(dtype="float32", kv_cache_memory="16MiB", max_model_len=MAX_LEN, block_size=BLOCK, seed=0)
    options.update(kwargs)
    if draft == NGRAM:
        spec = {"method": NGRAM, "num_speculative_tokens": k, "adaptive_lookahead": adaptive_lookahead}
        if prompt_step_speculation is not None:
            spec["prompt_step_speculation"] = prompt_step_speculation
        options["speculative_config"] = spec
    elif draft is not None:
        spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": k, "prompt_lookup": prompt_lookup,
                "draft_weight_format": draft_weight_format, "adaptive_lookahead": adaptive_lookahead}
        if prompt_step_speculation is not None:
            spec["prompt_step_speculation"] = prompt_step_speculation
        options["speculative_config"] = spec
    return LLM(model, **options)


def assert_all_released(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.requests and not engine.has_unfinished()
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_total_blocks
    proposer = engine.proposer
    if proposer is not None and hasattr(proposer, "mirrors"):  # an ngram proposer has no draft KV
        assert proposer.mirrors == {}
        assert proposer.kv_manager.num_free_blocks == proposer.kv_manager.num_total_blocks


def assert_stats_consistent(llm: LLM, outputs) -> None:
    """Engine-wide counters are the sum of the per-request ones, and emitted = accepted + rounds."""
    total = llm.stats
    assert total.num_drafts == sum(o.spec_stats.num_drafts for o in outputs)
    assert total.num_draft_tokens == sum(o.spec_stats.num_draft_tokens for o in outputs)
    assert total.num_accepted_tokens == sum(o.spec_stats.num_accepted_tokens for o in outputs)
    assert total.num_emitted_tokens == total.num_accepted_tokens + total.num_drafts
    assert sum(total.acceptance_histogram) == total.num_drafts
    for o in outputs:
        assert o.speculation == "draft_model"
        assert o.spec_stats.num_emitted_tokens <= len(o.token_ids)


# --------------------------------------------------------------------------------------------- greedy
def _greedy_prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(99)
    lengths = [1, 2, 7, 15, 16, 17, 31, 100]  # the last one runs into max_model_len
    return [torch.randint(3, 512, (n,), generator=gen).tolist() for n in lengths]


GREEDY_PROMPTS = _greedy_prompts()
GREEDY_PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (40, 33, 17, 40, 2, 40, 29, 40)
]


@pytest.fixture(scope="module")
def ar_greedy(models):
    """Plain autoregressive greedy outputs of the target: (token ids, finish reason) per prompt."""
    llm = make_llm(models("target"))
    outputs = llm.generate(GREEDY_PROMPTS, GREEDY_PARAMS)
    assert len(outputs[-1].token_ids) == MAX_LEN - len(GREEDY_PROMPTS[-1])  # stopped by max_model_len
    return [(o.token_ids, o.finish_reason) for o in outputs]


def _check_greedy(outputs, ar_greedy, indices) -> None:
    for out, i in zip(outputs, indices):
        assert (out.token_ids, out.finish_reason) == ar_greedy[i], f"prompt {i} differs from AR"


@pytest.mark.parametrize("k", [1, 3, 5, 8])
@pytest.mark.parametrize("draft", ["close", "random"])
def test_greedy_sd_equals_ar(models, ar_greedy, draft, k):
    llm = make_llm(models("target"), models(draft), k=k, max_num_seqs=8)
    outputs = llm.generate(GREEDY_PROMPTS, GREEDY_PARAMS)
    _check_greedy(outputs, ar_greedy, range(8))
    assert_stats_consistent(llm, outputs)
    stats = llm.stats
    assert stats.num_drafts > 0 and len(stats.acceptance_histogram) == k + 1
    if draft == "close":  # real rejections and real acceptances, at every depth
        assert 0.0 < stats.acceptance_rate < 1.0
        assert stats.acceptance_histogram[0] > 0 and stats.num_accepted_tokens_per_pos[k - 1] > 0
        # the random target repeats itself: prompt lookup copies drafts, and some are right
        assert 0 < stats.num_accepted_copied_tokens <= stats.num_copied_tokens < stats.num_draft_tokens
    else:
        assert stats.acceptance_rate < 0.1
    assert_all_released(llm)


@pytest.mark.parametrize("adaptive", [False, True])
@pytest.mark.parametrize("k", [1, 4])
def test_greedy_ngram_equals_ar(models, ar_greedy, k, adaptive):
    """Prompt lookup alone (method "ngram"): the random target repeats itself, so copies are proposed, some
    accepted, and rounds where nothing matched decode plainly; the tokens are AR's."""
    llm = make_llm(models("target"), NGRAM, k=k, max_num_seqs=8, adaptive_lookahead=adaptive)
    outputs = llm.generate(GREEDY_PROMPTS, GREEDY_PARAMS)
    _check_greedy(outputs, ar_greedy, range(8))
    stats = llm.stats
    assert all(o.speculation == NGRAM for o in outputs)
    assert 0 < stats.num_accepted_tokens <= stats.num_draft_tokens == stats.num_copied_tokens
    assert stats.num_drafts > 0 and stats.num_emitted_tokens == stats.num_accepted_tokens + stats.num_drafts
    assert llm.engine.proposer._lookups == {}
    assert_all_released(llm)


def test_ngram_config_errors():
    from ssd.config import SpeculativeConfig

    with pytest.raises(ValueError, match="prompt lookup alone; leave 'model' unset"):
        SpeculativeConfig(method=NGRAM, model="some/draft")
    with pytest.raises(ValueError, match="needs prompt_lookup=True"):
        SpeculativeConfig(method=NGRAM, prompt_lookup=False)
    assert SpeculativeConfig(method=NGRAM).model is None


@pytest.mark.parametrize("draft", ["close", "random"])
def test_greedy_sd_with_adaptive_lookahead_equals_ar(models, ar_greedy, draft):
    """Each step's K comes from measured acceptance and step times (0 = plain decoding, exploration visits
    every K): whatever it picks, the tokens equal AR, and the policy learned from rounds and steps."""
    llm = make_llm(models("target"), models(draft), k=4, max_num_seqs=8, adaptive_lookahead=True)
    policy = llm.engine.rounds.policy
    outputs = llm.generate(GREEDY_PROMPTS, GREEDY_PARAMS)
    _check_greedy(outputs, ar_greedy, range(8))
    assert_stats_consistent(llm, outputs)
    assert any(policy.step_time(b, 0) is not None for b in range(1, 9))  # a cost line was measured
    rates = policy.conditional_acceptance()
    assert (rates[0] < 0.3) if draft == "random" else (rates[0] > 0.3)
    assert policy._seq_counts == {}  # finished sequences were forgotten
    assert_all_released(llm)


@pytest.mark.parametrize("batch_size", range(1, 9))
def test_greedy_sd_equals_ar_for_each_batch_size(models, ar_greedy, batch_size):
    k = (1, 3, 5, 8)[batch_size % 4]
    indices = [(3 * batch_size + j) % 8 for j in range(batch_size)]  # a different mix of lengths each time
    llm = make_llm(models("target"), models("close"), k=k, max_num_seqs=8, prompt_lookup=batch_size % 2 == 0)
    outputs = llm.generate([GREEDY_PROMPTS[i] for i in indices], [GREEDY_PARAMS[i] for i in indices])
    _check_greedy(outputs, ar_greedy, indices)
    assert_all_released(llm)


def expected_self_draft_rounds(num_prompt: int, max_tokens: int, k: int, prompt_step: bool = True) -> list[int]:
    """Draft counts of the rounds of a request whose every draft is accepted.

    A decoding step speculates min(K, tokens still allowed - 1) drafts, where the tokens still allowed are
    bounded by max_tokens and max_model_len (the bonus token takes the last place). A round accepting all j
    drafts emits j + 1 tokens; when exactly one token is left the step is plain decoding (no round). Without
    ``prompt_step`` speculation the prompt's step emits the first token alone.
    """
    rounds, num_out = [], 0 if prompt_step else 1
    while num_out < max_tokens and num_prompt + num_out < MAX_LEN:
        left = min(max_tokens - num_out, MAX_LEN - num_prompt - num_out)
        j = min(k, left - 1)
        if j > 0:
            rounds.append(j)
        num_out += j + 1
    return rounds


@pytest.mark.parametrize("k", [1, 3, 5, 8])
def test_self_draft_accepts_every_draft(models, ar_greedy, k):
    """Draft == target, greedy: every round accepts all of its drafts. Every round but the last has K drafts
    and emits K + 1 tokens; the last has min(K, tokens left - 1) (see expected_self_draft_rounds). So each
    request's round count, draft/accepted counters, acceptance histogram and mean acceptance length (K + 1
    except for the last round) are known exactly. Prompt lookup is off: its copies are not the target's picks;
    dense draft weights: float16 ones could flip a near tie of the target's."""
    target = models("target")
    llm = make_llm(target, target, k=k, max_num_seqs=8, prompt_lookup=False, draft_weight_format="dense",
                   prompt_step_speculation=True)
    outputs = llm.generate(GREEDY_PROMPTS, GREEDY_PARAMS)
    _check_greedy(outputs, ar_greedy, range(8))
    for prompt, params, out in zip(GREEDY_PROMPTS, GREEDY_PARAMS, outputs):
        rounds = expected_self_draft_rounds(len(prompt), params.max_tokens, k)
        stats = out.spec_stats
        histogram = [0] * (k + 1)
        for j in rounds:
            histogram[j] += 1
        assert stats.num_drafts == len(rounds)
        assert stats.num_draft_tokens == stats.num_accepted_tokens == sum(rounds)
        assert stats.acceptance_histogram + [0] * (k + 1 - len(stats.acceptance_histogram)) == histogram
        assert stats.mean_acceptance_length == pytest.approx(sum(j + 1 for j in rounds) / len(rounds))
        assert rounds[:-1] == [k] * (len(rounds) - 1)
        # The prompt's step already verifies a speculation: its tokens are left out of the decode rate.
        assert out.metrics.num_first_step_tokens == rounds[0] + 1
        later = out.metrics.num_output_tokens - rounds[0] - 1
        if later > 0:
            elapsed = out.metrics.finished_time - out.metrics.first_token_time
            assert out.metrics.decode_tokens_per_s == pytest.approx(later / elapsed)
    assert llm.stats.acceptance_rate == 1.0
    assert_stats_consistent(llm, outputs)


def test_without_prompt_step_speculation_the_first_token_comes_alone(models, ar_greedy):
    """prompt_step_speculation=False: the prompt's step emits exactly its one token (no draft prefill or
    drafts before it), speculation starts with the next step, and the tokens still equal AR (draft ==
    target: every later round is fully accepted, so the rounds are known exactly)."""
    target = models("target")
    llm = make_llm(target, target, k=3, max_num_seqs=8, prompt_lookup=False, draft_weight_format="dense",
                   prompt_step_speculation=False)
    outputs = llm.generate(GREEDY_PROMPTS, GREEDY_PARAMS)
    _check_greedy(outputs, ar_greedy, range(8))
    for prompt, params, out in zip(GREEDY_PROMPTS, GREEDY_PARAMS, outputs):
        rounds = expected_self_draft_rounds(len(prompt), params.max_tokens, 3, prompt_step=False)
        assert out.metrics.num_first_step_tokens == 1
        assert out.spec_stats.num_drafts == len(rounds)
        assert out.spec_stats.num_draft_tokens == out.spec_stats.num_accepted_tokens == sum(rounds)
    assert_stats_consistent(llm, outputs)


def test_greedy_sd_with_chunked_prefill_preemption_and_prefix_cache(models, ar_greedy):
    """A small token budget (chunked prefill, lookahead capped by the budget) and a 9-block target pool
    (preemption of speculating sequences); run twice so the second run also reuses cached prefixes."""
    target = models("target")
    probe = make_llm(target)
    llm = make_llm(
        target,
        models("close"),
        k=5,
        kv_cache_memory=9 * probe.engine.runner.bytes_per_block(),
        max_num_batched_tokens=20,
        max_num_seqs=8,
    )
    assert llm.engine.kv_manager.num_total_blocks == 9
    for _ in range(2):
        outputs = llm.generate(GREEDY_PROMPTS, GREEDY_PARAMS)
        _check_greedy(outputs, ar_greedy, range(8))
        assert sum(o.metrics.num_preemptions for o in outputs) > 0
        assert_all_released(llm)
    assert sum(o.metrics.num_cached_prompt_tokens for o in outputs) > 0
    assert 0.0 < llm.stats.acceptance_rate < 1.0


# --------------------------------------------------------------------------------------------- sampling
SAMPLE_PROMPT = "Once upon a time there was a king"  # 33 tokens: 2 blocks come from the prefix cache
DEPTH = 4  # tokens per request; their joint distribution is tested
OTHER = -1  # bin label: "any token not enumerated at this position"


@dataclass
class Partition:
    """A partition of the token sequences of a fixed length into bins with exact probabilities.

    ``support[prefix]`` holds the tokens of nonzero probability after each expanded prefix, so a sample
    the target could never produce (e.g. a token outside top-k) is caught exactly, not statistically.
    """

    probs: dict[tuple, float]
    support: dict[tuple, set[int]]

    def bin_of(self, sample: tuple) -> tuple | None:
        """The sample's bin, or None if the target gives it probability 0."""
        for d in range(len(sample)):
            prefix = sample[:d]  # expanded: the root is, and the loop only goes on below expanded nodes
            if sample[d] not in self.support[prefix]:
                return None
            child = sample[: d + 1]
            if child not in self.support and child not in self.probs:
                return prefix + (OTHER,)
        return sample


def exact_partition(hf, prompt_ids: list[int], params: SamplingParams, depth: int, min_prob: float) -> Partition:
    """Enumerate the target's processed distribution over the next ``depth`` tokens.

    Every prefix with probability >= min_prob is expanded; the children below min_prob of an expanded
    prefix are lumped into one bin ``prefix + (OTHER,)``. The bins depend only on the model, never on the
    samples.
    """
    level = {(): 1.0}
    probs: dict[tuple, float] = {}
    support: dict[tuple, set[int]] = {}
    with torch.no_grad():
        for _ in range(depth):
            prefixes = list(level)
            rows = []
            for start in range(0, len(prefixes), 256):
                chunk = prefixes[start : start + 256]
                ids = torch.tensor([prompt_ids + list(p) for p in chunk])  # [P, T], equal lengths: no padding
                logits = hf(ids).logits[:, -1].float()  # [P, V]
                st = SamplingTensors.from_params([params] * len(chunk), "cpu")
                rows.append(processed_probs(logits, st).double())  # [P, V]
            next_level = {}
            for prefix, row in zip(prefixes, torch.cat(rows)):
                support[prefix] = set((row > 0).nonzero().flatten().tolist())
                joint = level[prefix] * row / row.sum()  # [V]
                keep = joint >= min_prob
                for t in keep.nonzero().flatten().tolist():
                    next_level[prefix + (t,)] = float(joint[t])
                probs[prefix + (OTHER,)] = float(joint[~keep].sum())
            level = next_level
    probs.update(level)
    return Partition(probs, support)


def chi_square_pvalue(samples: list[tuple], partition: Partition) -> float:
    """Pearson chi-square of sample counts against the exact bin probabilities.

    Bins expected to hold fewer than 5 samples are merged into one (the usual validity rule); a sample of
    probability 0 makes the p-value 0.
    """
    n = len(samples)
    counts = Counter(partition.bin_of(tuple(s)) for s in samples)
    if None in counts:
        return 0.0
    observed, expected = [], []
    rest_obs, rest_exp = 0, 0.0
    for key, prob in partition.probs.items():
        if n * prob >= 5:
            observed.append(counts.get(key, 0))
            expected.append(n * prob)
        else:
            rest_obs += counts.get(key, 0)
            rest_exp += n * prob
    if rest_exp > 0:
        observed.append(rest_obs)
        expected.append(rest_exp)
    elif rest_obs:
        return 0.0
    expected_arr = np.array(expected) * n / sum(expected)
    return float(scipy.stats.chisquare(np.array(observed, dtype=float), expected_arr).pvalue)


@dataclass(frozen=True)
class SamplingCase:
    params: SamplingParams
    draft: str | None  # None: plain sampling (checks the test harness itself)
    num_samples: int = 3000
    mix_greedy: bool = False
    # with repeating_prompt, and the prompt's step speculates (it copies the prompt's repeat), else with
    # SAMPLE_PROMPT and the engine's default (speculation starts after the first token)
    prompt_lookup: bool = True


SAMPLING_CASES = {
    "temp1.0_mixed_greedy": SamplingCase(SamplingParams(temperature=1.0), "small_close", mix_greedy=True),
    "temp0.7_model_only": SamplingCase(SamplingParams(temperature=0.7), "small_close", prompt_lookup=False),
    "top_k5": SamplingCase(SamplingParams(temperature=1.0, top_k=5), "small_close"),
    "top_p0.8_far_draft": SamplingCase(SamplingParams(temperature=0.9, top_p=0.8), "small_far"),
    "top_k_top_p_temp0.8": SamplingCase(SamplingParams(temperature=0.8, top_k=12, top_p=0.9), "small_far"),
    "ngram_temp0.9": SamplingCase(SamplingParams(temperature=0.9), NGRAM),
    "ar_control": SamplingCase(SamplingParams(temperature=1.0), None),
}


def hf_greedy(hf, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation, not stopping at EOS (keyword arguments override the checkpoint's
    generation config; a GenerationConfig object would have its eos_token_id=None filled back in)."""
    with torch.no_grad():
        ids = torch.tensor([prompt_ids])
        out = hf.generate(ids, do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=0)
    out = out[0, len(prompt_ids) :].tolist()
    assert len(out) == max_new_tokens
    return out


@pytest.fixture(scope="module")
def small_hf(models):
    path = models("small_target")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    return hf, tokenizer


def repeating_prompt(hf, prompt_ids: list[int]) -> list[int]:
    """The prompt, the target's greedy continuation of it, then the prompt again: prompt lookup proposes the
    continuation's tokens after the second copy, which the target often (not always) samples."""
    return prompt_ids + hf_greedy(hf, prompt_ids, 8) + prompt_ids


@pytest.mark.parametrize("case_name", list(SAMPLING_CASES))
def test_sampled_distribution_is_exact(models, small_hf, case_name):
    case = SAMPLING_CASES[case_name]
    hf, tokenizer = small_hf
    prompt_ids = tokenizer.encode(SAMPLE_PROMPT)
    if case.prompt_lookup:
        prompt_ids = repeating_prompt(hf, prompt_ids)
    base = dataclasses.replace(case.params, max_tokens=DEPTH, ignore_eos=True)
    seed0 = 100_000 * (list(SAMPLING_CASES).index(case_name) + 1)
    params = [dataclasses.replace(base, seed=seed0 + i) for i in range(case.num_samples)]
    greedy_rows = set(range(7, len(params), 10)) if case.mix_greedy else set()
    for i in greedy_rows:
        params[i] = dataclasses.replace(base, temperature=0.0, seed=seed0 + i)
    draft = models(case.draft) if case.draft not in (None, NGRAM) else case.draft
    llm = make_llm(
        models("small_target"), draft, k=3, max_num_seqs=512, max_num_batched_tokens=8192, max_model_len=128,
        prompt_lookup=case.prompt_lookup, prompt_step_speculation=case.prompt_lookup,
    )
    outputs = llm.generate([prompt_ids] * len(params), params)
    assert all(len(o.token_ids) == DEPTH for o in outputs)

    if greedy_rows:
        greedy = hf_greedy(hf, prompt_ids, DEPTH)
        assert all(outputs[i].token_ids == greedy for i in greedy_rows)

    samples = [tuple(o.token_ids) for i, o in enumerate(outputs) if i not in greedy_rows]
    partition = exact_partition(hf, prompt_ids, base, DEPTH, min_prob=5.0 / len(samples))
    pvalue = chi_square_pvalue(samples, partition)
    assert pvalue > ALPHA, f"{case_name}: samples do not follow the target distribution (p = {pvalue:.3g})"

    if draft == NGRAM:  # copies were proposed, some accepted, some rejected
        assert all(o.speculation == NGRAM for o in outputs)
        stats = llm.stats
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens == stats.num_copied_tokens
    elif draft is not None:  # speculation really happened, with both outcomes
        assert all(o.speculation == "draft_model" for o in outputs)
        assert 0.02 < llm.stats.acceptance_rate < 0.95
        histogram = llm.stats.acceptance_histogram
        assert histogram[0] > 0 and sum(histogram[1:]) > 0
        copied, accepted = llm.stats.num_copied_tokens, llm.stats.num_accepted_copied_tokens
        if case.prompt_lookup:  # copied drafts were proposed, and both accepted and rejected
            assert 0 < accepted < copied, (copied, accepted)
        else:
            assert copied == 0
            if case.draft == "small_close":
                assert histogram[-1] > 0  # all K drafts accepted in some rounds
    if case_name == "temp1.0_mixed_greedy":
        # The test has power: the same samples clearly reject a slightly different temperature.
        wrong_params = dataclasses.replace(base, temperature=1.15)
        wrong = exact_partition(hf, prompt_ids, wrong_params, DEPTH, min_prob=5.0 / len(samples))
        assert chi_square_pvalue(samples, wrong) < ALPHA
    assert_all_released(llm)


# --------------------------------------------------------------------------------------------- seeds
@pytest.mark.parametrize("speculative", [False, True], ids=["ar", "sd"])
def test_seeded_request_reproduces_in_any_batch(models, speculative):
    """The same seeded request yields the same tokens alone, in the middle of a small batch and at the end
    of a full batch of other sampled (seeded and unseeded) and greedy requests of other lengths."""
    draft = models("close") if speculative else None
    llm = make_llm(models("target"), draft, k=4, max_num_seqs=8)
    prompt = GREEDY_PROMPTS[3]
    request = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=32, ignore_eos=True)
    others = [
        SamplingParams(temperature=1.0, seed=7, max_tokens=20, ignore_eos=True),
        SamplingParams(temperature=0.8, max_tokens=25, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
    ]
    (alone,) = llm.generate([prompt], request)
    middle = llm.generate([GREEDY_PROMPTS[0], prompt, GREEDY_PROMPTS[6]], [others[0], request, others[1]])[1]
    full_prompts = GREEDY_PROMPTS[:3] + GREEDY_PROMPTS[4:7] + [GREEDY_PROMPTS[0], prompt]
    full_params = [others[i % 3] for i in range(7)] + [request]
    last = llm.generate(full_prompts, full_params)[-1]
    assert alone.token_ids == middle.token_ids == last.token_ids
    assert len(alone.token_ids) == 32
    different_seed = llm.generate([prompt], dataclasses.replace(request, seed=4321))[0]
    assert different_seed.token_ids != alone.token_ids  # the seed matters
    if speculative:
        assert llm.stats.num_accepted_tokens > 0
