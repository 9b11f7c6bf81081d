"""Bad input fails early with a clear error that says what was wrong, and the engine keeps serving.

Each test checks the exception type and message, then that the same :class:`LLM` (plain and speculative)
still answers a valid request with exactly the tokens it gave before any error, holding no requests or KV
blocks afterwards.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest

from ssd import LLM, SamplingParams

MAX_LEN = 64
VOCAB = 512
VALID_PROMPT = "Hello! How are you today?"
VALID_PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def target(checkpoint_factory) -> Path:
    return checkpoint_factory(arch="llama")


def _make_llm(model, draft=None) -> LLM:
    spec = None if draft is None else {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
    return LLM(str(model), dtype="float32", kv_cache_memory="4MiB", max_model_len=MAX_LEN, speculative_config=spec)


@pytest.fixture(scope="module", params=["ar", "sd"])
def served(request, target, checkpoint_factory):
    """(llm, expected tokens of the valid request) for a plain and a speculative engine."""
    draft = checkpoint_factory(arch="llama", seed=1, num_layers=1) if request.param == "sd" else None
    llm = _make_llm(target, draft)
    (out,) = llm.generate(VALID_PROMPT, VALID_PARAMS)
    assert len(out.token_ids) == 8
    return llm, out.token_ids


def assert_still_serves(served) -> None:
    llm, expected = served
    engine = llm.engine
    assert not engine.has_unfinished() and not engine.requests
    (out,) = llm.generate(VALID_PROMPT, VALID_PARAMS)
    assert out.token_ids == expected and out.finish_reason == "length"
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_total_blocks
    if engine.proposer is not None:
        assert engine.proposer.mirrors == {}


# --------------------------------------------------------------------------------------------- prompts
@pytest.mark.parametrize(
    ("prompt", "message"),
    [("", "prompt is empty"), ([], "prompt token id list is empty")],
    ids=["empty_text", "empty_ids"],
)
def test_empty_prompt(served, prompt, message):
    with pytest.raises(ValueError, match=message):
        served[0].generate([prompt], VALID_PARAMS)
    assert_still_serves(served)


def test_prompt_longer_than_max_model_len(served):
    llm = served[0]
    with pytest.raises(ValueError, match=r"prompt has 64 tokens but max_model_len is 64.*at most 63 prompt tokens"):
        llm.generate([[5] * MAX_LEN], VALID_PARAMS)
    long_text = "The quick brown fox jumps over the lazy dog. " * 10
    with pytest.raises(ValueError, match=r"max_model_len is 64"):
        llm.generate(long_text, VALID_PARAMS)
    assert_still_serves(served)
    # The longest allowed prompt gets exactly one token, then stops at max_model_len.
    (out,) = llm.generate([[5] * (MAX_LEN - 1)], VALID_PARAMS)
    assert len(out.token_ids) == 1 and out.finish_reason == "length"
    assert_still_serves(served)


@pytest.mark.parametrize("bad", [[5, VOCAB], [-1], [5, 10**9], [3, True]], ids=["vocab", "negative", "huge", "bool"])
def test_token_ids_out_of_vocabulary(served, bad):
    with pytest.raises(ValueError, match=r"prompt token ids must be integers in \[0, 512\)"):
        served[0].generate([bad], VALID_PARAMS)
    assert_still_serves(served)


@pytest.mark.parametrize("bad", [3.5, None, [1.0, 2.0]], ids=["float", "none", "float_ids"])
def test_prompt_of_wrong_type(served, bad):
    with pytest.raises(ValueError, match=r"prompt (must be a string or a list of token ids|token ids must be)"):
        served[0].generate([bad], VALID_PARAMS)
    assert_still_serves(served)


def test_one_bad_prompt_rejects_the_whole_call(served):
    """Validation happens before anything is queued: the good prompts of a rejected call never run."""
    llm = served[0]
    with pytest.raises(ValueError, match=r"prompt token ids must be integers in \[0, 512\); got \[519\]"):
        llm.generate([VALID_PROMPT, [1, 2, 3], [VOCAB + 7]], VALID_PARAMS)
    assert not llm.engine.has_unfinished()
    assert_still_serves(served)


# --------------------------------------------------------------------------------------------- sampling
@pytest.mark.parametrize("temperature", [-0.5, -1, math.nan, math.inf])
def test_invalid_temperature(served, temperature):
    with pytest.raises(ValueError, match=r"temperature must be a finite number >= 0"):
        served[0].generate(VALID_PROMPT, SamplingParams(temperature=temperature))
    assert_still_serves(served)


@pytest.mark.parametrize("top_p", [0.0, -0.1, 1.5, math.nan])
def test_top_p_outside_unit_interval(served, top_p):
    with pytest.raises(ValueError, match=r"top_p must be a number in \(0, 1\]"):
        served[0].generate(VALID_PROMPT, SamplingParams(top_p=top_p))
    assert_still_serves(served)


def test_wrong_number_of_sampling_params(served):
    with pytest.raises(ValueError, match="got 3 SamplingParams for 2 prompts"):
        served[0].generate(["a", "b"], [VALID_PARAMS] * 3)
    with pytest.raises(ValueError, match="sampling params must be a SamplingParams"):
        served[0].generate(["a"], [{"temperature": 0.0}])
    assert_still_serves(served)


# --------------------------------------------------------------------------------------------- engine
def test_failure_inside_a_step_releases_everything(served, monkeypatch):
    """An exception in the middle of generation (here: the model's forward) reaches the caller, and the
    requests of that call are aborted so they hold no KV blocks and never run again."""
    llm = served[0]
    runner = llm.engine.runner
    real_forward = runner.forward
    calls = {"n": 0}

    def failing_forward(items):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("simulated device failure")
        return real_forward(items)

    monkeypatch.setattr(runner, "forward", failing_forward)
    with pytest.raises(RuntimeError, match="simulated device failure"):
        llm.generate([VALID_PROMPT, [7] * 20], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    monkeypatch.setattr(runner, "forward", real_forward)
    assert calls["n"] == 3
    assert_still_serves(served)


# --------------------------------------------------------------------------------------------- checkpoints
def test_unknown_model_path(served, tmp_path):
    missing = tmp_path / "no_such_model"
    with pytest.raises(FileNotFoundError, match=r"model folder .*no_such_model does not exist"):
        _make_llm(missing)
    assert_still_serves(served)


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


@pytest.mark.parametrize(
    ("corruption", "message"),
    [
        ("truncated", r"config\.json is not valid JSON"),
        ("not_an_object", r"config\.json must hold a JSON object"),
        ("missing_field", r"config\.json: config is missing required field 'hidden_size'"),
        ("unknown_architecture", r"unsupported architecture 'FooForCausalLM'; supported: .*LlamaForCausalLM"),
    ],
)
def test_corrupt_config_json(served, target, tmp_path, corruption, message):
    folder = _copy(target, tmp_path / "model")
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    if corruption == "truncated":
        config_path.write_text(config_path.read_text()[:40])
    elif corruption == "not_an_object":
        config_path.write_text("[1, 2, 3]")
    elif corruption == "missing_field":
        del config["hidden_size"]
        config_path.write_text(json.dumps(config))
    else:
        config["architectures"] = ["FooForCausalLM"]
        config_path.write_text(json.dumps(config))
    with pytest.raises(ValueError, match=message):
        _make_llm(folder)
    assert_still_serves(served)


def test_missing_config_json(served, target, tmp_path):
    folder = _copy(target, tmp_path / "model")
    (folder / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        _make_llm(folder)
    assert_still_serves(served)


def test_kv_cache_too_small_for_max_model_len(served, target):
    with pytest.raises(ValueError, match=r"one sequence of max_model_len=64 tokens needs 4.*raise kv_cache_memory"):
        LLM(str(target), dtype="float32", kv_cache_memory="16KiB", max_model_len=MAX_LEN)
    assert_still_serves(served)


def _swapped_tokenizer_copy(src: Path, dst: Path) -> Path:
    """Same vocabulary size, but two ordinary tokens trade ids (so ids mean different text)."""
    folder = _copy(src, dst)
    data = json.loads((folder / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    a, b = "a", "b"
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (folder / "tokenizer.json").write_text(json.dumps(data))
    return folder


def test_draft_with_different_vocabulary(served, target, checkpoint_factory, tmp_path):
    smaller = checkpoint_factory(arch="llama", vocab_size=300, seed=1, num_layers=1)
    with pytest.raises(ValueError, match=r"draft and target tokenizers differ \(target has 512 tokens, draft 300\)"):
        _make_llm(target, smaller)
    swapped = _swapped_tokenizer_copy(target, tmp_path / "swapped")
    with pytest.raises(ValueError, match=r"tokenizers differ \(target has 512 tokens, draft 512\)"):
        _make_llm(target, swapped)
    assert_still_serves(served)


def test_missing_draft(served, target, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no_draft does not exist"):
        _make_llm(target, tmp_path / "no_draft")
    with pytest.raises(ValueError, match="speculative_config needs 'model'"):
        LLM(str(target), dtype="float32", kv_cache_memory="4MiB", speculative_config={"method": "draft_model"})
    assert_still_serves(served)


@pytest.mark.parametrize(
    "options, message",
    [
        ({"fan_out": "auto", "fan_out_budget": 0}, "fan_out_budget must be an integer >= 1"),
        ({"fan_out": "auto", "fan_out_budget": 2.5}, "fan_out_budget must be an integer >= 1"),
        ({"fan_out": 3, "fan_out_budget": 12}, "only applies to a fan_out or fan_out_miss of 'auto' or 'dynamic'"),
        ({"fan_out": "auto", "fallback": "neural"}, "fallback must be one of"),
        ({"filler_padding": "zeros"}, "filler_padding must be one of"),
        ({"fan_out": "auto", "saguaro_c": 0.0}, r"saguaro_c must be in \(0, 1\]"),
    ],
    ids=["budget_zero", "budget_float", "budget_without_auto", "fallback", "filler_padding", "saguaro_c"],
)
def test_invalid_ssd_options(served, target, options, message):
    with pytest.raises(ValueError, match=message):
        LLM(str(target), dtype="float32", kv_cache_memory="4MiB",
            speculative_config={"method": "ssd", "model": str(target), **options})
    assert_still_serves(served)
