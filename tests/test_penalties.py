"""Penalties, logit bias and min-p (``SamplingParams``; ``ssd/sample/penalties.py``), exact under speculation.

A penalty makes a position's logits depend on the tokens before it, so a verification round must count the drafts
before each of its positions as generated. Checked: the penalty arithmetic against a reference written here; plain
decoding against transformers' logits penalised step by step; greedy tokens of SD, SSD, ngram and EAGLE-3 equal
plain decoding with the same options (and differ from decoding without them); sampled SD and SSD outputs follow
the penalised target distribution (chi-square); bad options are refused naming the field.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import transformers
from eagle3_utils import SPEC_MODES, make_mode_models, self_draft_stats
from ssd_utils import chi_square_gof, exact_joint

from ssd import LLM, SamplingParams
from ssd.sample.penalties import PenaltyRow, apply_penalties
from ssd.sample.sampler import SamplingTensors, processed_probs

ENGINE = dict(dtype="float32", block_size=4, max_model_len=160, kv_cache_memory="16MiB", seed=0)
PROMPTS = [[5, 17, 42, 9, 33, 71, 2, 5, 17], [100, 3, 250, 7], [64, 65, 66, 67, 64, 65, 66, 67, 64]]
PENALISED = dict(repetition_penalty=1.4, frequency_penalty=0.6, presence_penalty=0.4, logit_bias={7: 3.0, 11: -50.0})


def _greedy(**options) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, **options)


# ------------------------------------------------------------------------------------------------ arithmetic
def test_penalties_follow_their_definitions():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=gen) * 4  # [3, V]
    expected = logits.clone().numpy().astype(np.float64)
    params = SamplingParams(**PENALISED)
    prompt, output = [1, 2, 3, 7], [3, 9, 9, 9, 20]
    apply_penalties(logits, [PenaltyRow(1, params, prompt, output)])
    row = expected[1]
    row[7] += 3.0
    row[11] -= 50.0
    for t in {1, 2, 3, 7, 9, 20}:  # in the prompt or the output
        row[t] = row[t] / 1.4 if row[t] > 0 else row[t] * 1.4
    for t, count in ((3, 1), (9, 3), (20, 1)):  # in the output
        row[t] -= 0.6 * count + 0.4
    np.testing.assert_allclose(logits.numpy(), expected, rtol=1e-6, atol=1e-5)  # rows 0 and 2 untouched


def test_min_p_keeps_tokens_within_a_factor_of_the_likeliest():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.12, 0.08]]))
    probs = processed_probs(logits, SamplingTensors.from_params([SamplingParams(min_p=0.2)], "cpu"))[0]
    torch.testing.assert_close(probs, torch.tensor([0.5, 0.3, 0.12, 0.0]) / 0.92)


@pytest.mark.parametrize("options, match", [
    (dict(presence_penalty=2.5), "presence_penalty must be a number in \\[-2, 2\\]"),
    (dict(frequency_penalty="1"), "frequency_penalty must be a number"),
    (dict(repetition_penalty=0.0), "repetition_penalty must be a finite number > 0"),
    (dict(min_p=1.5), "min_p must be a number in \\[0, 1\\]"),
    (dict(logit_bias={-1: 1.0}), "logit_bias keys must be token ids >= 0"),
    (dict(logit_bias={5: 101}), "logit_bias values must be numbers in \\[-100, 100\\]"),
    (dict(logit_bias=[5]), "logit_bias must be a map"),
])
def test_bad_options_are_refused(options, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**options)


def test_logit_bias_keys_may_be_json_strings_and_must_fit_the_vocabulary(checkpoint_factory):
    assert SamplingParams(logit_bias={"42": 5}).logit_bias == {42: 5.0}
    llm = LLM(str(checkpoint_factory()), **ENGINE)
    with pytest.raises(ValueError, match="logit_bias names token ids \\[600\\] outside the model's vocabulary"):
        llm.generate([[1, 2]], SamplingParams(logit_bias={600: 1.0}))
    assert llm.generate([[1, 2]], SamplingParams(max_tokens=2))[0].token_ids  # the engine keeps serving


# ------------------------------------------------------------------------------------------------ greedy
def test_plain_decoding_penalises_like_transformers_logits(checkpoint_factory):
    path = str(checkpoint_factory())
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    params = _greedy(**PENALISED)
    got = LLM(path, **ENGINE).generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, got):
        tokens = list(prompt)
        for _ in range(params.max_tokens):
            with torch.no_grad():
                logits = hf(torch.tensor([tokens])).logits[0, -1].double().numpy()  # [V]
            output = tokens[len(prompt):]
            logits[[7, 11]] += [3.0, -50.0]
            for t in set(tokens):
                logits[t] = logits[t] / 1.4 if logits[t] > 0 else logits[t] * 1.4
            for t in set(output):
                logits[t] -= 0.6 * output.count(t) + 0.4
            tokens.append(int(np.argmax(logits)))
        assert out.token_ids == tokens[len(prompt):]


@pytest.fixture(scope="module")
def models(checkpoint_factory, tmp_path_factory):
    return make_mode_models(checkpoint_factory, tmp_path_factory.mktemp("penalties"))


@pytest.mark.parametrize("mode", list(SPEC_MODES))
def test_greedy_with_penalties_equals_plain_decoding_in_every_mode(models, mode):
    target, draft, head = models
    params = [_greedy(**PENALISED), _greedy(repetition_penalty=0.7), _greedy(presence_penalty=-1.0, min_p=0.5)]
    with LLM(target, **ENGINE) as ar:
        expected = [o.token_ids for o in ar.generate(PROMPTS, params)]
        plain = [o.token_ids for o in ar.generate(PROMPTS, [_greedy()] * len(PROMPTS))]
    assert expected != plain  # the penalties change the tokens
    spec = {**SPEC_MODES[mode](draft, head), "num_speculative_tokens": 3, "adaptive_lookahead": False}
    with LLM(target, **ENGINE, max_num_seqs=4, speculative_config=spec) as llm:
        assert [o.token_ids for o in llm.generate(PROMPTS, params)] == expected
        assert llm.stats.num_draft_tokens > 0


def test_verified_positions_count_the_drafts_before_them(models):
    """Two tokens biased far above the rest and a frequency penalty make the target trade them back and forth in
    runs set by their counts; prompt lookup drafts the runs it has seen, and a verified position must count the
    drafts before it (one that did not would see its counts as before the round and choose otherwise: this test
    fails then)."""
    target, _, _ = models
    params = _greedy(logit_bias={7: 40.0, 9: 40.0}, frequency_penalty=1.0)
    with LLM(target, **ENGINE) as ar:
        expected = ar.generate(PROMPTS, params)
    assert all(set(o.token_ids) == {7, 9} for o in expected)
    spec = {"method": "ngram", "num_speculative_tokens": 4, "adaptive_lookahead": False}
    with LLM(target, **ENGINE, speculative_config=spec) as llm:
        assert [o.token_ids for o in llm.generate(PROMPTS, params)] == [o.token_ids for o in expected]
        stats = llm.stats
    assert stats.num_accepted_tokens > 0.2 * stats.num_draft_tokens > 0


def test_drafts_are_penalised_like_the_target(models):
    """With the target as its own draft, a draft penalised as the target is proposes what the target emits (measured:
    90 of 102 drafts accepted; drawn without penalties, 74 of 162)."""
    target, _, _ = models
    stats = self_draft_stats(target, PROMPTS, _greedy(**PENALISED), "draft_model", ENGINE)
    assert stats.num_accepted_tokens >= 0.8 * stats.num_draft_tokens > 0


# ------------------------------------------------------------------------------------------------ sampled
@pytest.mark.parametrize("method", ["draft_model", "ssd"])
def test_sampled_penalised_outputs_follow_the_target(models, method):
    """Five tokens of 1,500 seeded requests (top-k 2, so 32 paths) against the penalised joint distribution
    enumerated exactly; the first rounds' verified positions are penalised by the drafts before them."""
    target, draft, _ = models
    params = SamplingParams(temperature=1.0, top_k=2, max_tokens=5, ignore_eos=True, frequency_penalty=1.5,
                            presence_penalty=0.5, repetition_penalty=1.2, logit_bias={17: 2.0})
    prompt = [17, 244, 90, 3, 411, 58]
    exact = exact_joint(target, prompt, 5, params)
    unpenalised = exact_joint(target, prompt, 5, dataclasses.replace(params, frequency_penalty=0.0,
                                                                      presence_penalty=0.0, repetition_penalty=1.0,
                                                                      logit_bias=None))
    spec = {"method": method, "model": draft, "num_speculative_tokens": 2, "adaptive_lookahead": False,
            "prompt_lookup": False}
    with LLM(target, **ENGINE, max_num_seqs=128, speculative_config=spec) as llm:
        outputs = llm.generate([prompt] * 1500, [dataclasses.replace(params, seed=s) for s in range(1500)])
        assert llm.stats.num_accepted_tokens > 0
    samples = [tuple(o.token_ids) for o in outputs]
    result = chi_square_gof(samples, exact)
    assert result.df >= 10 and result.p_value > 1e-4, result
    assert chi_square_gof(samples, unpenalised).p_value < 1e-4  # the test tells the two apart
