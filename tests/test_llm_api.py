"""The user-facing API of :class:`LLM`: streaming, stop conditions, logprobs, chat, context manager, CLI.

Every behaviour is checked for plain decoding and for speculative decoding (several tokens per step), and
against a plain greedy run of the same prompt: stopping must cut at the same token whichever mode produced it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
import torch
import transformers

from ssd import LLM, SamplingParams
from ssd.cli.main import main as cli_main

MAX_LEN = 128
PROMPTS = ["Once upon a time", "Question: What is the capital of France?", "def add(a, b):"]
LONG = 40  # tokens of the greedy reference runs


def greedy(max_tokens: int = LONG, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kwargs)


@pytest.fixture(scope="module")
def paths(checkpoint_factory) -> dict[str, str]:
    return {"target": str(checkpoint_factory(arch="llama")), "draft": str(checkpoint_factory(arch="llama", seed=3))}


def _make_llm(paths, mode: str, **kwargs) -> LLM:
    options = dict(dtype="float32", kv_cache_memory="8MiB", max_model_len=MAX_LEN, seed=0)
    options.update(kwargs)
    if mode == "sd":  # draft == target: every draft accepted, so many tokens arrive per step
        options["speculative_config"] = {"method": "draft_model", "model": paths["target"], "num_speculative_tokens": 4}
    elif mode == "sd_random":  # an unrelated draft: nearly every draft is rejected, one token per round
        options["speculative_config"] = {"method": "draft_model", "model": paths["draft"], "num_speculative_tokens": 3}
    return LLM(paths["target"], **options)


@pytest.fixture(scope="module")
def engines(paths):
    cache: dict[str, LLM] = {}

    def get(mode: str) -> LLM:
        if mode not in cache:
            cache[mode] = _make_llm(paths, mode)
        return cache[mode]

    return get


@pytest.fixture(scope="module")
def reference(engines) -> list[list[int]]:
    """Plain greedy output tokens of each prompt (validated against transformers in test_engine_exactness)."""
    return [o.token_ids for o in engines("ar").generate(PROMPTS, greedy())]


MODES = ["ar", "sd", "sd_random"]


def _assert_clean(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.has_unfinished() and not engine.requests
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.num_total_blocks


# --------------------------------------------------------------------------------------------- streaming
def _stream(llm: LLM, prompts, params):
    """Run a stream; returns (concatenated deltas, final outputs) per request id, and checks the deltas."""
    text, ids, final, order = defaultdict(str), defaultdict(list), {}, []
    for out in llm.stream(prompts, params):
        assert out.request_id not in final, "no output after a request finished"
        if out.request_id not in order:
            order.append(out.request_id)
        assert out.new_token_ids == out.token_ids[len(ids[out.request_id]) :]
        text[out.request_id] += out.new_text
        ids[out.request_id] += out.new_token_ids
        assert out.text == text[out.request_id]  # the cumulative text is what was released so far
        if out.finished:
            final[out.request_id] = out
    return [(text[r], ids[r], final[r]) for r in order]


@pytest.mark.parametrize("mode", MODES)
def test_stream_deltas_add_up_to_the_final_output(engines, reference, mode):
    llm = engines(mode)
    results = _stream(llm, PROMPTS, greedy())
    assert len(results) == len(PROMPTS)
    by_prompt = {tuple(final.prompt_token_ids): (text, ids, final) for text, ids, final in results}
    for prompt, expected in zip(PROMPTS, reference):
        text, ids, final = by_prompt[tuple(llm.tokenizer.encode(prompt))]
        assert ids == final.token_ids == expected
        assert text == final.text == llm.tokenizer.decode(expected)
        assert final.finish_reason == "length"
    _assert_clean(llm)


def _boundary_stop(llm: LLM, tokens: list[int], start: int) -> str:
    """A two-character stop string straddling a token boundary at or after ``start``: the last character of
    the text so far and the first character the next token adds. Replacement characters (bytes of an
    incomplete UTF-8 sequence, frequent with random models) are avoided: the engine only sees them once the
    next token shows the sequence stays invalid."""
    for index in range(start, len(tokens)):
        before = llm.tokenizer.decode(tokens[:index])
        after = llm.tokenizer.decode(tokens[: index + 1])
        if before and after.startswith(before) and len(after) > len(before):
            stop = before[-1] + after[len(before)]
            if "\ufffd" not in stop:
                return stop
    raise AssertionError("no usable token boundary")


@pytest.mark.parametrize("mode", MODES)
def test_stream_with_stop_string_across_tokens(engines, reference, mode):
    """Text that may start a stop string is held back while streaming, so the deltas never have to be
    taken back when the stop string completes."""
    llm = engines(mode)
    tokens = reference[0]
    stop = _boundary_stop(llm, tokens, 12)
    full_text = llm.tokenizer.decode(tokens)
    cut = full_text.find(stop)
    assert 0 < cut
    ((text, ids, final),) = _stream(llm, [PROMPTS[0]], greedy(stop=[stop]))
    assert final.finish_reason == "stop"
    assert text == final.text == full_text[:cut]
    assert ids == final.token_ids
    _assert_clean(llm)


@pytest.mark.parametrize("mode", ["ar", "sd"])
def test_held_back_text_is_released_when_the_request_ends(engines, reference, mode):
    """The output ends (max_tokens) with the first character of a stop string that never completes: that
    character was held back while streaming and must still be in the final text and the deltas."""
    llm = engines(mode)
    tokens = reference[0][:10]
    full_text = llm.tokenizer.decode(tokens)
    assert full_text and not full_text.endswith("\ufffd")
    stop = full_text[-1] + "\x00never"
    ((text, ids, final),) = _stream(llm, [PROMPTS[0]], greedy(10, stop=[stop]))
    assert final.finish_reason == "length"
    assert ids == tokens and text == final.text == full_text
    _assert_clean(llm)


def test_abandoned_stream_releases_its_requests(engines):
    llm = engines("sd")
    stream = llm.stream(PROMPTS, greedy())
    first = next(stream)
    assert not first.finished
    stream.close()  # the consumer stops early
    _assert_clean(llm)
    assert llm.engine.proposer.mirrors == {}


# --------------------------------------------------------------------------------------------- stopping
def _first_stop_token(llm: LLM, tokens: list[int], stop: str) -> int:
    """Number of tokens plain decoding keeps when ``stop`` ends the output: up to the token completing it."""
    for n in range(1, len(tokens) + 1):
        if stop in llm.tokenizer.decode(tokens[:n]):
            return n
    raise AssertionError("stop string not in the output")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("include", [False, True], ids=["exclude", "include"])
def test_stop_strings(engines, reference, mode, include):
    llm = engines(mode)
    tokens = reference[1]
    full_text = llm.tokenizer.decode(tokens)
    stop = _boundary_stop(llm, tokens, 20)
    cut = full_text.find(stop)
    n = _first_stop_token(llm, tokens, stop)
    other = "\x00never\x00"  # a second stop string that never matches
    (out,) = llm.generate(PROMPTS[1], greedy(stop=[other, stop], include_stop_str_in_output=include))
    assert out.finish_reason == "stop"
    assert out.text == (full_text[: cut + len(stop)] if include else full_text[:cut])
    assert out.token_ids == tokens[:n]  # also under speculation: tokens after the stop are dropped
    _assert_clean(llm)


@pytest.mark.parametrize("mode", MODES)
def test_stop_token_ids(engines, reference, mode):
    """The stop token ends the output: it is in token_ids (like vLLM) but not in the text."""
    llm = engines(mode)
    tokens = reference[2]
    index = 17
    stop_id = tokens[index]
    first = tokens.index(stop_id)
    (out,) = llm.generate(PROMPTS[2], greedy(stop_token_ids=[stop_id]))
    assert out.finish_reason == "stop"
    assert out.token_ids == tokens[: first + 1]
    assert out.text == llm.tokenizer.decode(tokens[:first])
    _assert_clean(llm)


@pytest.mark.parametrize("mode", MODES)
def test_min_tokens_bans_stop_tokens_until_reached(engines, reference, mode):
    llm = engines(mode)
    tokens = reference[2]
    stop_id = tokens[3]
    first = tokens.index(stop_id)
    min_tokens = first + 5
    (out,) = llm.generate(PROMPTS[2], greedy(stop_token_ids=[stop_id], min_tokens=min_tokens))
    assert stop_id not in out.token_ids[:min_tokens]
    assert out.token_ids[:first] == tokens[:first]  # identical until the banned token would have come
    assert out.token_ids[first] != stop_id
    assert len(out.token_ids) >= min_tokens
    assert out.finish_reason == ("stop" if out.token_ids[-1] == stop_id else "length")
    _assert_clean(llm)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("max_tokens", [1, 2, 7, 16])
def test_max_tokens(engines, reference, mode, max_tokens):
    llm = engines(mode)
    outputs = llm.generate(PROMPTS, greedy(max_tokens))
    for out, expected in zip(outputs, reference):
        assert out.finish_reason == "length"
        assert out.token_ids == expected[:max_tokens]
        assert out.text == llm.tokenizer.decode(expected[:max_tokens])
    _assert_clean(llm)


# --------------------------------------------------------------------------------------------- logprobs
@pytest.fixture(scope="module")
def hf_model(paths):
    return transformers.AutoModelForCausalLM.from_pretrained(paths["target"], dtype=torch.float32).eval()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_logprobs_match_transformers(engines, hf_model, mode, sampled):
    """Chosen-token logprobs and the top-3 are log_softmax of the raw transformers logits (temperature and
    top-k do not change them), whether the token came from a decode step or a verification pass."""
    llm = engines(mode)
    if sampled:
        params = SamplingParams(temperature=0.8, top_k=20, seed=5, max_tokens=24, ignore_eos=True, logprobs=3)
    else:
        params = greedy(24, logprobs=3)
    outputs = llm.generate(PROMPTS[:2], params)
    for out in outputs:
        ids = out.prompt_token_ids + out.token_ids
        with torch.no_grad():
            logits = hf_model(torch.tensor([ids])).logits[0, len(out.prompt_token_ids) - 1 : -1]  # [N, V]
        expected = torch.log_softmax(logits.float(), dim=-1)  # [N, V]
        assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids) == 24
        for j, (entry, token) in enumerate(zip(out.logprobs, out.token_ids)):
            assert entry.token_id == token
            assert entry.logprob == pytest.approx(float(expected[j, token]), abs=1e-4)
            top = torch.topk(expected[j], 3)
            assert list(entry.top) == top.indices.tolist()
            assert list(entry.top.values()) == pytest.approx(top.values.tolist(), abs=1e-4)
        if not sampled:  # greedy tokens are the most likely ones
            assert all(entry.token_id == next(iter(entry.top)) for entry in out.logprobs)
    _assert_clean(llm)


def test_no_logprobs_unless_asked(engines):
    (out,) = engines("sd").generate(PROMPTS[0], greedy(4))
    assert out.logprobs is None
    (out,) = engines("ar").generate(PROMPTS[0], greedy(4, logprobs=0))
    assert len(out.logprobs) == 4 and all(entry.top is None for entry in out.logprobs)


# --------------------------------------------------------------------------------------------- chat
@pytest.mark.parametrize("mode", ["ar", "sd"])
def test_chat_uses_the_chat_template(engines, paths, mode):
    llm = engines(mode)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(paths["target"])
    conversations = [
        [{"role": "user", "content": "Hello! How are you today?"}],
        [
            {"role": "system", "content": "You answer briefly."},
            {"role": "user", "content": "What is two plus two?"},
            {"role": "assistant", "content": "Four."},
            {"role": "user", "content": "And three plus three?"},
        ],
    ]
    outputs = llm.chat(conversations, greedy(12))
    plain = llm.chat(conversations[0], greedy(12))  # one conversation on its own
    assert len(outputs) == 2 and len(plain) == 1
    for conversation, out in zip(conversations, outputs):
        expected_prompt = hf_tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
        assert expected_prompt.endswith("<|im_start|>assistant\n")
        assert llm.tokenizer.decode(out.prompt_token_ids, skip_special_tokens=False) == expected_prompt
        assert out.prompt_token_ids == hf_tokenizer.encode(expected_prompt, add_special_tokens=False)
        (direct,) = llm.generate([out.prompt_token_ids], greedy(12))
        assert out.token_ids == direct.token_ids
    assert plain[0].token_ids == outputs[0].token_ids
    _assert_clean(llm)


# --------------------------------------------------------------------------------------------- lifecycle
def test_generate_accepts_one_prompt_or_one_token_list(engines, reference):
    llm = engines("ar")
    (from_text,) = llm.generate(PROMPTS[0], greedy(5))
    (from_ids,) = llm.generate(llm.tokenizer.encode(PROMPTS[0]), greedy(5))
    assert from_text.token_ids == from_ids.token_ids == reference[0][:5]
    assert from_text.prompt == PROMPTS[0] and from_ids.prompt is None
    assert llm.generate([], greedy(5)) == []


def test_context_manager_shuts_down(paths, reference):
    with _make_llm(paths, "sd") as llm:
        (out,) = llm.generate(PROMPTS[0], greedy(10))
        assert out.token_ids == reference[0][:10]
        assert llm.engine.proposer is not None
    assert llm.engine.proposer is None  # the draft and its KV cache are released


def test_cli_generate_exits_0(paths):
    command = [sys.executable, "-m", "ssd.cli.main", "generate", "--model", paths["target"], "--prompt", "hi"]
    command += ["--max-tokens", "5", "--dtype", "float32"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[1])
    assert result.returncode == 0, result.stderr
    assert "=== 'hi'" in result.stdout and "finish=" in result.stdout


def test_cli_generate_json_with_draft(paths, capsys):
    argv = ["generate", "--model", paths["target"], "--prompt", "hi", "--prompt", "def add(a, b):"]
    argv += ["--max-tokens", "6", "--dtype", "float32", "--kv-cache-memory", "4MiB", "--ignore-eos", "--json"]
    argv += ["--draft", paths["draft"], "--method", "draft_model", "--k", "2"]
    assert cli_main(argv) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["prompt"] for line in lines] == ["hi", "def add(a, b):"]
    assert all(line["num_tokens"] == 6 and line["finish_reason"] == "length" for line in lines)


def test_cli_generate_with_ngram_needs_no_draft(paths, capsys):
    """``--method ngram`` speculates without ``--draft`` and prints what plain decoding prints."""
    argv = ["generate", "--model", paths["target"], "--prompt", PROMPTS[0], "--max-tokens", "12", "--dtype", "float32",
            "--kv-cache-memory", "4MiB", "--ignore-eos", "--json", "--k", "3"]
    lines = []
    for extra in ([], ["--method", "ngram"]):
        assert cli_main(argv + extra) == 0
        (line,) = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
        lines.append(line)
    assert lines[0] == lines[1] and lines[1]["num_tokens"] == 12


def test_cli_reports_bad_model_path(tmp_path, capsys):
    assert cli_main(["generate", "--model", str(tmp_path / "missing"), "--prompt", "hi", "--dtype", "float32"]) == 1
    assert "does not exist" in capsys.readouterr().err
