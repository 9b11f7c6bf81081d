"""The OpenAI-compatible server, end to end over loopback HTTP.

Servers are real: uvicorn on a free loopback port (port 0), in a background thread for AR and SD, and as an
``ssd serve`` subprocess for SSD (its draft worker is a spawned process). Clients are the official ``openai``
package (completions, chat, streaming, usage) and raw HTTP for what a well-behaved client never sends
(malformed JSON, wrong types, unknown fields, oversized bodies and prompts, disconnects).

Exactness: greedy text through the server equals ``LLM.generate``/``LLM.chat`` of plain AR decoding, in AR,
SD and SSD modes, with many concurrent streams. Resource safety: a client that disconnects mid-stream has its
request aborted and every target and draft KV block freed, read back from ``/metrics``.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import selectors
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import torch
from safetensors.torch import load_file, save_file

from ssd import LLM, SamplingParams
from ssd.config import EngineConfig
from ssd.engine import LLMEngine
from ssd.server.app import BackgroundServer, create_app
from ssd.server.metrics import parse_samples

MODEL_NAME = "tiny"
MAX_LEN = 256
MAX_TOKENS = 12
ENGINE_OPTIONS = dict(dtype="float32", kv_cache_memory="16MiB", max_model_len=MAX_LEN, block_size=16, seed=0)
PROMPTS = [
    "The quick brown fox",
    "Once upon a time there was",
    "Speculative decoding lets a small draft model",
    "Hello! How are you today?",
    "def add(a, b):",
    "Numbers: one, two, three,",
    "The weather was cold and windy, so she",
    "Question: What is the capital of France?",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
GREEDY_BODY = {"temperature": 0.0, "max_tokens": MAX_TOKENS, "extra_body": {"ignore_eos": True}}
REPO = Path(__file__).resolve().parents[1]
WAIT_S = 60.0  # upper bound for the server to reach a state (never a timing assertion)


# --------------------------------------------------------------------------------------------- fixtures
def perturbed_copy(src: Path, dst: Path, sigma: float = 0.05, seed: int = 3) -> Path:
    """The target's checkpoint with relative Gaussian noise on every weight: a draft that is often right."""
    shutil.copytree(src, dst)
    weights = load_file(src / "model.safetensors")
    gen = torch.Generator().manual_seed(seed)
    noisy = {n: (w + sigma * w.std() * torch.randn(w.shape, generator=gen)).contiguous() for n, w in
             sorted(weights.items())}
    save_file(noisy, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@dataclass
class Reference:
    completions: list[str]
    completion_prompt_tokens: list[int]
    chats: list[str]
    chat_prompt_tokens: list[int]


@pytest.fixture(scope="module")
def target(checkpoint_factory) -> Path:
    return checkpoint_factory(arch="llama")


@pytest.fixture(scope="module")
def draft(target, tmp_path_factory) -> Path:
    return perturbed_copy(target, tmp_path_factory.mktemp("server_draft") / "draft")


@pytest.fixture(scope="module")
def reference(target) -> Reference:
    with LLM(str(target), **ENGINE_OPTIONS) as llm:
        outs = llm.generate(PROMPTS, GREEDY)
        chats = llm.chat([[{"role": "user", "content": p}] for p in PROMPTS], GREEDY)
    assert all(len(o.token_ids) == MAX_TOKENS for o in outs + chats)
    return Reference(
        [o.text for o in outs], [len(o.prompt_token_ids) for o in outs],
        [o.text for o in chats], [len(o.prompt_token_ids) for o in chats],
    )


def _thread_server(target: Path, spec: dict | None = None, max_waiting_requests: int = 64,
                   max_num_seqs: int = 8, **app_options) -> BackgroundServer:
    engine = LLMEngine(EngineConfig(model=str(target), max_num_seqs=max_num_seqs, speculative_config=spec,
                                    **ENGINE_OPTIONS))
    app = create_app(engine, MODEL_NAME, max_waiting_requests=max_waiting_requests, **app_options)
    return BackgroundServer(app).start()


@pytest.fixture(scope="module")
def ar_server(target) -> Iterator[BackgroundServer]:
    server = _thread_server(target, max_body_bytes=64 * 1024)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def sd_server(target, draft) -> Iterator[BackgroundServer]:
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
    server = _thread_server(target, spec)
    yield server
    server.stop()


@dataclass
class ProcessServer:
    url: str
    proc: subprocess.Popen


@pytest.fixture(scope="module")
def ssd_server(target, draft, tmp_path_factory) -> Iterator[ProcessServer]:
    """``ssd serve`` with SSD in a subprocess; the first stdout line tells the bound port."""
    log = tmp_path_factory.mktemp("ssd_serve") / "stderr.log"
    cmd = [
        sys.executable, "-m", "ssd.cli.main", "serve", "--model", str(target), "--draft", str(draft),
        "--method", "ssd", "--k", "3", "--fan-out", "2", "--dtype", "float32", "--max-model-len", str(MAX_LEN),
        "--kv-cache-memory", "16MiB", "--max-num-seqs", "8", "--threads", "1", "--draft-threads", "1",
        "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", "0",
    ]
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with open(log, "w") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env, cwd=REPO)
    try:
        line = _read_line(proc, WAIT_S * 3)
        assert line.startswith("ssd: serving tiny at http://127.0.0.1:"), (line, log.read_text()[-3000:])
        url = line.split(" at ", 1)[1].strip().removesuffix("/v1")
        _wait_healthy(url)
        yield ProcessServer(url, proc)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _read_line(proc: subprocess.Popen, timeout: float) -> str:
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            raise AssertionError("ssd serve printed nothing in time")
    return proc.stdout.readline()


def _wait_healthy(url: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health").status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{url} never became healthy")


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=WAIT_S)


def metrics(url: str) -> dict[str, float]:
    response = httpx.get(url + "/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")
    return parse_samples(response.text)


def metric(samples: dict[str, float], name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels``."""
    total = 0.0
    for key, value in samples.items():
        base, _, rest = key.partition("{")
        if base == name and all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total += value
    return total


def wait_idle(url: str) -> dict[str, float]:
    """Metrics once no request is pending (bounded wait: the engine frees aborted requests at its next step)."""
    deadline = time.monotonic() + WAIT_S
    while True:
        samples = metrics(url)
        if metric(samples, "ssd:num_requests_pending") == 0 and metric(samples, "ssd:num_requests_running") == 0:
            return samples
        assert time.monotonic() < deadline, "server did not become idle"
        time.sleep(0.05)


def assert_all_blocks_free(samples: dict[str, float], draft: str | None) -> None:
    assert metric(samples, "ssd:kv_cache_num_free_blocks") == metric(samples, "ssd:kv_cache_num_total_blocks") > 0
    assert metric(samples, "ssd:kv_cache_usage_perc") == 0
    if draft == "draft_model":
        free = metric(samples, "ssd:draft_kv_cache_num_free_blocks")
        assert free == metric(samples, "ssd:draft_kv_cache_num_total_blocks") > 0
    if draft is not None:
        assert "ssd:draft_num_sequences{model_name=\"tiny\"}" in samples
        assert metric(samples, "ssd:draft_num_sequences") == 0


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


# --------------------------------------------------------------------------------------------- AR basics
def test_models_health_and_unknown_paths(ar_server):
    url = ar_server.url
    assert httpx.get(url + "/health").json() == {"status": "ok"}
    models = client(url).models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    assert httpx.get(url + f"/v1/models/{MODEL_NAME}").json()["max_model_len"] == MAX_LEN
    assert_error(httpx.get(url + "/v1/models/other"), 404, "model")
    assert_error(httpx.get(url + "/v1/nothing"), 404)
    assert_error(httpx.get(url + "/v1/completions"), 405)


def test_completions_match_llm_generate(ar_server, reference):
    c = client(ar_server.url)
    for i, prompt in enumerate(PROMPTS[:4]):
        r = c.completions.create(model=MODEL_NAME, prompt=prompt, **GREEDY_BODY)
        assert r.object == "text_completion" and r.model == MODEL_NAME
        assert r.choices[0].text == reference.completions[i]
        assert r.choices[0].finish_reason == "length"
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (reference.completion_prompt_tokens[i], MAX_TOKENS)
        assert r.usage.total_tokens == r.usage.prompt_tokens + MAX_TOKENS
        assert "speculative" not in (r.usage.model_extra or {})  # AR: no speculative extension
    # a list of prompts gives one choice per prompt, in order
    r = c.completions.create(model=MODEL_NAME, prompt=PROMPTS, **GREEDY_BODY)
    assert [ch.index for ch in r.choices] == list(range(len(PROMPTS)))
    assert [ch.text for ch in r.choices] == reference.completions
    assert r.usage.completion_tokens == MAX_TOKENS * len(PROMPTS)


def test_streaming_completion_and_usage(ar_server, reference):
    c = client(ar_server.url)
    chunks = list(c.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], stream=True,
                                       stream_options={"include_usage": True}, **GREEDY_BODY))
    text_chunks, usage_chunk = chunks[:-1], chunks[-1]
    assert "".join(ch.choices[0].text for ch in text_chunks) == reference.completions[1]
    assert [ch.choices[0].finish_reason for ch in text_chunks][-1] == "length"
    assert all(ch.choices[0].finish_reason is None for ch in text_chunks[:-1])
    assert all(ch.usage is None for ch in text_chunks)
    assert usage_chunk.choices == []
    assert usage_chunk.usage.completion_tokens == MAX_TOKENS
    assert usage_chunk.usage.prompt_tokens == reference.completion_prompt_tokens[1]
    # without include_usage there is no usage chunk
    chunks = list(c.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], stream=True, **GREEDY_BODY))
    assert all(ch.choices and ch.usage is None for ch in chunks)


def test_chat_matches_llm_chat(ar_server, reference):
    c = client(ar_server.url)
    messages = [{"role": "user", "content": PROMPTS[2]}]
    r = c.chat.completions.create(model=MODEL_NAME, messages=messages, **GREEDY_BODY)
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == reference.chats[2]
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (reference.chat_prompt_tokens[2], MAX_TOKENS)
    # content given as text parts is the same conversation
    parts = [{"role": "user", "content": [{"type": "text", "text": PROMPTS[2][:5]},
                                          {"type": "text", "text": PROMPTS[2][5:]}]}]
    r = c.chat.completions.create(model=MODEL_NAME, messages=parts, **GREEDY_BODY)
    assert r.choices[0].message.content == reference.chats[2]

    stream = c.chat.completions.create(model=MODEL_NAME, messages=messages, stream=True,
                                       stream_options={"include_usage": True}, **GREEDY_BODY)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(ch.object == "chat.completion.chunk" and ch.id == chunks[0].id for ch in chunks)
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == reference.chats[2]
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == MAX_TOKENS


def test_logprobs_match_engine(ar_server, target):
    with LLM(str(target), **ENGINE_OPTIONS) as llm:
        expected = llm.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True,
                                                             logprobs=2))[0].logprobs
        token_text = [llm.tokenizer.decode([lp.token_id], skip_special_tokens=False) for lp in expected]
    c = client(ar_server.url)
    r = c.completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=2,
                             extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert lp.tokens == token_text
    assert lp.token_logprobs == pytest.approx([e.logprob for e in expected], abs=1e-5)
    assert [len(t) for t in lp.top_logprobs] == [2] * 6
    assert lp.text_offset == [sum(len(t) for t in token_text[:i]) for i in range(6)]
    r = c.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                  temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == 4 and all(len(e.top_logprobs) == 3 for e in content)
    assert all(e.top_logprobs[0].logprob >= e.top_logprobs[-1].logprob for e in content)


@pytest.mark.parametrize("server", ["ar_server", "ssd_server"])
def test_penalties_and_logit_bias_match_the_engine(request, server, target):
    """The server passes the penalties, logit_bias (string keys, as JSON has them) and min_p through unchanged:
    the official client's greedy completion equals the engine's AR with the same options, under SSD too."""
    url = request.getfixturevalue(server).url
    options = dict(presence_penalty=0.5, frequency_penalty=0.8, logit_bias={"42": 4.0})
    extra = dict(repetition_penalty=1.3, min_p=0.1)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, presence_penalty=0.5, frequency_penalty=0.8,
                            logit_bias={42: 4.0}, repetition_penalty=1.3, min_p=0.1)
    with LLM(str(target), **ENGINE_OPTIONS) as llm:
        expected = llm.generate([PROMPTS[0]], params)[0].text
        plain = llm.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS))[0].text
    assert expected != plain
    r = client(url).completions.create(model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0,
                                       extra_body=extra, **options)
    assert r.choices[0].text == expected


STRUCTURED_SCHEMA = {"type": "object", "properties": {"colour": {"enum": ["red", "green"]}, "ok": {"type": "boolean"}},
                     "required": ["colour", "ok"], "additionalProperties": False}


@pytest.mark.parametrize("server", ["ar_server", "sd_server", "ssd_server"])
def test_structured_outputs_through_the_official_client(request, server, target):
    """response_format (json_schema on chat, json_object on completions), guided_regex / guided_choice and
    structured_outputs (a Lark grammar) through the official client equal the engine's constrained AR, under SD and
    SSD too; the outputs that finish conform."""
    url = request.getfixturevalue(server).url
    c = client(url)
    greedy = dict(temperature=0.0, max_tokens=24)
    lark = 'start: "<" WORD ">"\nWORD: /[a-z]{1,5}/'
    cases = [  # (constraint for the engine, completion call keyword arguments)
        (dict(json_object=True), dict(extra_body={"response_format": {"type": "json_object"}})),
        (dict(regex="[0-9]{2}-[a-z]{3}"), dict(extra_body={"guided_regex": "[0-9]{2}-[a-z]{3}"})),
        (dict(choice=["yes", "no", "maybe"]), dict(extra_body={"guided_choice": ["yes", "no", "maybe"]})),
        (dict(grammar=lark), dict(extra_body={"structured_outputs": {"grammar": lark}})),
    ]
    with LLM(str(target), **ENGINE_OPTIONS) as llm:
        expected = [llm.generate([PROMPTS[1]], SamplingParams(**greedy, structured_outputs=so))[0] for so, _ in cases]
        chat = llm.chat([[{"role": "user", "content": PROMPTS[7]}]],
                        SamplingParams(**greedy, structured_outputs=dict(json=STRUCTURED_SCHEMA)))[0]
    for (_, kwargs), out in zip(cases, expected):
        r = c.completions.create(model=MODEL_NAME, prompt=PROMPTS[1], **greedy, **kwargs)
        assert r.choices[0].text == out.text and r.choices[0].finish_reason == out.finish_reason
    assert expected[1].finish_reason == "stop" and re.fullmatch("[0-9]{2}-[a-z]{3}", expected[1].text)
    assert expected[2].text in ("yes", "no", "maybe") and re.fullmatch("<[a-z]{1,5}>", expected[3].text)
    r = c.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": PROMPTS[7]}], **greedy,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": STRUCTURED_SCHEMA}},
    )
    assert r.choices[0].message.content == chat.text
    if chat.finish_reason == "stop":
        assert json.loads(chat.text)["colour"] in ("red", "green")


STRUCTURED_BAD_REQUESTS = [
    (b'{"prompt": "hi", "response_format": {"type": "xml"}}', "response_format.type"),
    (b'{"prompt": "hi", "response_format": {"type": "json_schema"}}', "response_format.json_schema"),
    (b'{"prompt": "hi", "guided_regex": "[a-"}', "guided_regex"),
    (b'{"prompt": "hi", "guided_json": {"type": "objekt"}}', "guided_json"),
    (b'{"prompt": "hi", "structured_outputs": {"grammar": "start: foo"}}', "structured_outputs"),
    (b'{"prompt": "hi", "structured_outputs": {"regex": "a", "choice": ["b"]}}', "structured_outputs"),
    (b'{"prompt": "hi", "structured_outputs": {"pattern": "a"}}', "structured_outputs"),
    (b'{"prompt": "hi", "guided_choice": []}', "guided_choice"),
    (b'{"prompt": "hi", "guided_regex": "a", "guided_choice": ["b"]}', "guided_choice"),
    (b'{"prompt": "hi", "response_format": {"type": "json_object"}, "guided_regex": "a"}', "guided_regex"),
]


@pytest.mark.parametrize("body,param", STRUCTURED_BAD_REQUESTS)
def test_bad_output_constraints_get_openai_errors_naming_the_field(ar_server, body, param):
    response = httpx.post(f"{ar_server.url}/v1/completions", content=body, headers={"Content-Type": "application/json"})
    assert_error(response, 400, param)
    r = client(ar_server.url).completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2)
    assert r.choices[0].text is not None  # still serving


def test_n_choices_with_independent_seeds(ar_server, target):
    """n choices per prompt, indexed prompt by prompt; a seeded request's choice j samples with seed + j (each
    reproducible, the choices independent); greedy choices are all the greedy text; chat streams every choice.
    (Seeded sampling reproduces within a mode; under speculation the same seed draws differently.)"""
    sampled = SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, seed=7)
    with LLM(str(target), **ENGINE_OPTIONS) as llm:
        expected = [llm.generate([p], SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, seed=7 + j))[0].text
                    for p in PROMPTS[:2] for j in range(3)]
        chat = llm.chat([[{"role": "user", "content": PROMPTS[0]}]], sampled)[0].text
    assert len(set(expected[:3])) > 1  # the choices differ
    c = client(ar_server.url)
    r = c.completions.create(model=MODEL_NAME, prompt=PROMPTS[:2], n=3, max_tokens=MAX_TOKENS, temperature=1.0,
                             seed=7)
    assert [ch.index for ch in r.choices] == list(range(6)) and [ch.text for ch in r.choices] == expected
    assert r.usage.completion_tokens == 6 * MAX_TOKENS
    r = c.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": PROMPTS[0]}], n=2,
                                  max_tokens=MAX_TOKENS, temperature=0)
    assert len(r.choices) == 2 and r.choices[0].message.content == r.choices[1].message.content
    texts = ["", ""]
    for event in c.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": PROMPTS[0]}],
                                           n=2, max_tokens=MAX_TOKENS, temperature=1.0, seed=7, stream=True):
        for ch in event.choices:
            texts[ch.index] += ch.delta.content or ""
    assert texts[0] == chat and texts[1] != texts[0]


def test_best_of_returns_the_candidates_with_the_highest_cumulative_logprob(ar_server, target):
    with LLM(str(target), **ENGINE_OPTIONS) as llm:
        candidates = [llm.generate([PROMPTS[1]], SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, seed=7 + j,
                                                                logprobs=0))[0] for j in range(4)]
    score = [sum(e.logprob for e in c.logprobs) for c in candidates]
    order = sorted(range(4), key=lambda j: -score[j])
    r = client(ar_server.url).completions.create(model=MODEL_NAME, prompt=PROMPTS[1], n=2, best_of=4,
                                                 max_tokens=MAX_TOKENS, temperature=1.0, seed=7)
    assert [ch.text for ch in r.choices] == [candidates[j].text for j in sorted(order[:2])]
    assert all(ch.logprobs is None for ch in r.choices)  # ranked by logprobs the request did not ask for
    assert r.usage.completion_tokens == 4 * MAX_TOKENS  # every candidate counts


def test_stop_string_and_seed(ar_server, reference):
    c = client(ar_server.url)
    text = reference.completions[3]
    start = next(i for i in range(2, len(text) - 1) if text[i : i + 2].isalnum())
    stop = text[start : start + 2]
    r = c.completions.create(model=MODEL_NAME, prompt=PROMPTS[3], stop=[stop], **GREEDY_BODY)
    assert r.choices[0].text == text[: text.find(stop)]
    assert r.choices[0].finish_reason == "stop"
    # a seeded sampled request repeats itself
    kwargs = dict(model=MODEL_NAME, prompt=PROMPTS[3], max_tokens=8, temperature=1.0, seed=1234)
    assert c.completions.create(**kwargs).choices[0].text == c.completions.create(**kwargs).choices[0].text


BAD_REQUESTS = [
    # (endpoint, raw body, status, param)
    ("completions", b'{"prompt": "hi", "max_tokens": ', 400, None),
    ("completions", b"", 400, None),
    ("completions", b"[1, 2]", 400, None),
    ("completions", b"\xff\xfe", 400, None),
    ("completions", b'{"prompt": 3}', 400, "prompt"),
    ("completions", b'{"prompt": []}', 400, "prompt"),
    ("completions", b'{"prompt": [1, "a"]}', 400, "prompt"),
    ("completions", b'{"max_tokens": 3}', 400, "prompt"),
    ("completions", b'{"prompt": "hi", "temperature": "hot"}', 400, "temperature"),
    ("completions", b'{"prompt": "hi", "max_tokens": 2.5}', 400, "max_tokens"),
    ("completions", b'{"prompt": "hi", "max_tokens": true}', 400, "max_tokens"),
    ("completions", b'{"prompt": "hi", "stream": "yes"}', 400, "stream"),
    ("completions", b'{"prompt": "hi", "frobnicate": 1}', 400, "frobnicate"),
    ("completions", b'{"prompt": "hi", "max_tokens": 1000000000000}', 400, "max_tokens"),
    ("completions", b'{"prompt": "hi", "max_tokens": 0}', 400, "max_tokens"),
    ("completions", b'{"prompt": "hi", "temperature": -1}', 400, "temperature"),
    ("completions", b'{"prompt": "hi", "top_p": 1.5}', 400, "top_p"),
    ("completions", b'{"prompt": "hi", "top_k": -5}', 400, "top_k"),
    ("completions", b'{"prompt": "hi", "seed": -1}', 400, "seed"),
    ("completions", b'{"prompt": "hi", "logprobs": 99}', 400, "logprobs"),
    ("completions", b'{"prompt": "hi", "stop": [""]}', 400, "stop"),
    ("completions", b'{"prompt": "hi", "n": 17}', 400, "n"),
    ("completions", b'{"prompt": "hi", "n": 0}', 400, "n"),
    ("completions", b'{"prompt": "hi", "n": 3, "best_of": 2}', 400, "best_of"),
    ("completions", b'{"prompt": "hi", "best_of": 17}', 400, "best_of"),
    ("completions", b'{"prompt": "hi", "best_of": 2, "stream": true}', 400, "best_of"),
    ("completions", b'{"prompt": "hi", "presence_penalty": 3}', 400, "presence_penalty"),
    ("completions", b'{"prompt": "hi", "frequency_penalty": -2.5}', 400, "frequency_penalty"),
    ("completions", b'{"prompt": "hi", "repetition_penalty": 0}', 400, "repetition_penalty"),
    ("completions", b'{"prompt": "hi", "min_p": 2}', 400, "min_p"),
    ("completions", b'{"prompt": "hi", "logit_bias": {"x": 1}}', 400, "logit_bias"),
    ("completions", b'{"prompt": "hi", "logit_bias": {"5": 500}}', 400, "logit_bias"),
    ("completions", b'{"prompt": "hi", "logit_bias": {"600000": 5}}', 400, "logit_bias"),
    ("completions", b'{"prompt": "hi", "echo": true}', 400, "echo"),
    ("completions", b'{"prompt": "hi", "stream_options": {"include_usage": true}}', 400, "stream_options"),
    ("completions", b'{"prompt": [600000]}', 400, "prompt"),
    ("completions", b'{"prompt": "hi", "model": "gpt-9"}', 404, "model"),
    ("chat/completions", b'{"messages": "hi"}', 400, "messages"),
    ("chat/completions", b"{}", 400, "messages"),
    ("chat/completions", b'{"messages": []}', 400, "messages"),
    ("chat/completions", b'{"messages": [{"role": "wizard", "content": "hi"}]}', 400, "messages[0].role"),
    ("chat/completions", b'{"messages": [{"role": "user"}]}', 400, "messages[0].content"),
    ("chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}', 400,
     "messages[0].content[0]"),
    ("chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}',
     400, "tools"),
    ("chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}', 400,
     "top_logprobs"),
    ("chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 999999}',
     400, "max_completion_tokens"),
    ("chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "min_tokens": 5, "max_tokens": 2}',
     400, "min_tokens"),
]


@pytest.mark.parametrize("endpoint,body,status,param", BAD_REQUESTS,
                         ids=[f"{i}-{e}" for i, (e, *_rest) in enumerate(BAD_REQUESTS)])
def test_bad_requests_get_openai_errors(ar_server, endpoint, body, status, param):
    response = httpx.post(f"{ar_server.url}/v1/{endpoint}", content=body,
                          headers={"Content-Type": "application/json"})
    error = assert_error(response, status, param)
    assert error["type"] == "invalid_request_error"


def test_oversized_prompt_and_body(ar_server):
    url = ar_server.url
    too_long = " ".join(["fox"] * (MAX_LEN + 10))
    error = assert_error(httpx.post(url + "/v1/completions", json={"prompt": too_long}), 400, "prompt")
    assert error["code"] == "context_length_exceeded" and str(MAX_LEN) in error["message"]
    error = assert_error(httpx.post(url + "/v1/chat/completions",
                                    json={"messages": [{"role": "user", "content": too_long}]}), 400, "messages")
    assert error["code"] == "context_length_exceeded"
    error = assert_error(httpx.post(url + "/v1/completions", json={"prompt": [5] * MAX_LEN}), 400, "prompt")
    assert error["code"] == "context_length_exceeded"
    # the body limit of this server is 64 KiB: 413 before anything is parsed
    error = assert_error(httpx.post(url + "/v1/completions", json={"prompt": "x" * 100_000}), 413)
    assert error["code"] == "request_too_large"
    # a prompt that fits exactly: prompt + max_tokens == max_model_len is allowed
    r = client(url).completions.create(model=MODEL_NAME, prompt=[5] * (MAX_LEN - 2), max_tokens=2, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 2
    # nothing above broke the server or leaked blocks
    assert_all_blocks_free(wait_idle(url), None)
    assert metric(metrics(url), "ssd:http_requests_total", path="/v1/completions", status="413") >= 1


def test_disconnect_mid_stream_aborts_and_frees_blocks_ar(ar_server):
    _disconnect_mid_stream(ar_server.url, None)


def _disconnect_mid_stream(url: str, draft: str | None) -> None:
    before = wait_idle(url)
    aborted_before = metric(before, "ssd:request_success_total", finished_reason="abort")
    body = {"prompt": PROMPTS[0], "max_tokens": MAX_LEN - 16, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=WAIT_S) as http:
        with http.stream("POST", url + "/v1/completions", json=body) as response:
            assert response.status_code == 200
            lines = response.iter_lines()
            events = [next(lines) for _ in range(4)]  # two data events and their blank separators
            assert events[0].startswith("data: {")
            during = metrics(url)
            assert metric(during, "ssd:num_requests_running") == 1
            assert metric(during, "ssd:kv_cache_num_free_blocks") < metric(during, "ssd:kv_cache_num_total_blocks")
        # leaving the block closes the connection without reading the rest
    after = wait_idle(url)
    assert metric(after, "ssd:request_success_total", finished_reason="abort") == aborted_before + 1
    assert_all_blocks_free(after, draft)


def test_overloaded_queue_gets_503_and_queued_disconnect_is_aborted(target):
    """One running slot plus one waiting slot: a third request is refused; a queued request whose client
    leaves is aborted before it ever runs."""
    server = _thread_server(target, max_num_seqs=1, max_waiting_requests=1)
    url = server.url
    try:
        body = {"prompt": PROMPTS[0], "max_tokens": MAX_LEN - 16, "temperature": 0, "ignore_eos": True,
                "stream": True}
        with httpx.Client(timeout=WAIT_S) as http, http.stream("POST", url + "/v1/completions", json=body) as first:
            lines = first.iter_lines()  # kept: a dropped iterator closes the response (a disconnect)
            assert next(lines).startswith("data: ")
            # a non-streaming request on a raw socket: admitted, waits for the busy slot
            payload = json.dumps({"prompt": PROMPTS[1], "max_tokens": 4}).encode()
            raw = socket.create_connection(("127.0.0.1", server.port))
            raw.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                        + f"Content-Length: {len(payload)}\r\n\r\n".encode() + payload)
            _wait_for(url, lambda s: metric(s, "ssd:num_requests_pending") == 2)
            refused = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            error = assert_error(refused, 503)
            assert error["type"] == "server_overloaded" and refused.headers["retry-after"] == "1"
            raw.close()  # the waiting client leaves
            samples = _wait_for(url, lambda s: metric(s, "ssd:num_requests_pending") == 1)
            assert metric(samples, "ssd:request_success_total", finished_reason="abort") == 1
            assert metric(samples, "ssd:num_requests_running") == 1  # the first stream is still going
            assert metric(samples, "ssd:request_rejected_overloaded_total") == 1
        samples = wait_idle(url)
        assert metric(samples, "ssd:request_success_total", finished_reason="abort") == 2
        assert metric(samples, "ssd:request_success_total", finished_reason="length") == 0
        assert_all_blocks_free(samples, None)
        # the server serves again once the queue drained
        r = client(url).completions.create(model=MODEL_NAME, prompt="hi", max_tokens=3, temperature=0,
                                           extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 3
    finally:
        server.stop()


def _wait_for(url: str, condition) -> dict[str, float]:
    deadline = time.monotonic() + WAIT_S
    while True:
        samples = metrics(url)
        if condition(samples):
            return samples
        assert time.monotonic() < deadline, "the server never reached the expected state"
        time.sleep(0.02)


def test_metrics_exposition(ar_server):
    client(ar_server.url).completions.create(model=MODEL_NAME, prompt="hi", max_tokens=2)
    text = httpx.get(ar_server.url + "/metrics").text
    for name in ("ssd:e2e_request_latency_seconds", "ssd:time_to_first_token_seconds",
                 "ssd:request_success_total", "ssd:kv_cache_usage_perc", "ssd:num_requests_running"):
        assert f"# TYPE {name} " in text
    samples = parse_samples(text)
    count = metric(samples, "ssd:e2e_request_latency_seconds_count")
    assert metric(samples, "ssd:e2e_request_latency_seconds_bucket", le="+Inf") == count >= 1
    assert count == sum(v for k, v in samples.items() if k.startswith("ssd:request_success_total"))
    assert "ssd:spec_decode_num_drafts_total" not in text  # no speculation in AR


# --------------------------------------------------------------------------------------------- SD / SSD
async def _concurrent_streams(url: str, prompts: list[str], chat: bool) -> list[tuple[str, dict]]:
    """All prompts at once, each as its own streaming client; returns (text, usage) per prompt."""
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=WAIT_S) as c:

        async def one(prompt: str) -> tuple[str, dict]:
            common = dict(model=MODEL_NAME, stream=True, stream_options={"include_usage": True}, **GREEDY_BODY)
            if chat:
                stream = await c.chat.completions.create(messages=[{"role": "user", "content": prompt}], **common)
            else:
                stream = await c.completions.create(prompt=prompt, **common)
            parts, usage, metrics = [], None, None
            async for chunk in stream:
                for choice in chunk.choices:
                    parts.append((choice.delta.content or "") if chat else choice.text)
                usage = chunk.usage or usage
                metrics = (chunk.model_extra or {}).get("metrics") or metrics
            return "".join(parts), {**usage.model_dump(), "metrics": metrics}

        return await asyncio.gather(*(one(p) for p in prompts))


def _check_speculative_server(url: str, reference: Reference, method: str) -> None:
    before = wait_idle(url)
    results = asyncio.run(_concurrent_streams(url, PROMPTS, chat=False))
    assert [text for text, _ in results] == reference.completions
    chat_results = asyncio.run(_concurrent_streams(url, PROMPTS[:4], chat=True))
    assert [text for text, _ in chat_results] == reference.chats[:4]
    usages = [u for _, u in results + chat_results]
    for usage in usages:
        assert usage["completion_tokens"] == MAX_TOKENS
        spec = usage["speculative"]
        assert spec["method"] == method
        assert spec["num_drafts"] >= 1 and spec["num_emitted_tokens"] <= MAX_TOKENS
        assert spec["num_emitted_tokens"] == spec["num_accepted_tokens"] + spec["num_drafts"]
        assert sum(spec["num_accepted_tokens_per_pos"]) == spec["num_accepted_tokens"]
        assert spec["num_accepted_copied_tokens"] <= spec["num_copied_tokens"] <= spec["num_draft_tokens"]
        assert 1 <= spec["num_first_step_tokens"] <= MAX_TOKENS
    # a non-streaming request agrees too
    r = client(url).completions.create(model=MODEL_NAME, prompt=PROMPTS[5], **GREEDY_BODY)
    assert r.choices[0].text == reference.completions[5]
    usages.append({**r.usage.model_dump(), "metrics": r.model_extra["metrics"]})
    for usage in usages:  # vLLM's per-request metrics: this request's counters again
        spec, metrics = usage["speculative"], usage["metrics"]["speculative_decoding"]
        assert metrics["num_spec_steps"] == spec["num_drafts"]
        for key in ("num_draft_tokens", "num_accepted_tokens", "mean_acceptance_length", "cache_lookups",
                    "cache_hits", "fallbacks"):
            assert metrics[key] == spec[key], key
        assert metrics["draft_acceptance_rate"] == spec["acceptance_rate"]
        assert sum(metrics["acceptance_histogram"].values()) == spec["num_drafts"]
        assert sum(int(k) * n for k, n in metrics["acceptance_histogram"].items()) == spec["num_accepted_tokens"]
    # engine-wide counters grew by exactly the per-request ones
    after = wait_idle(url)
    for usage_key, name in [("num_drafts", "ssd:spec_decode_num_drafts_total"),
                            ("num_draft_tokens", "ssd:spec_decode_num_draft_tokens_total"),
                            ("num_accepted_tokens", "ssd:spec_decode_num_accepted_tokens_total"),
                            ("num_copied_tokens", "ssd:spec_decode_num_copied_tokens_total"),
                            ("num_accepted_copied_tokens", "ssd:spec_decode_num_accepted_copied_tokens_total"),
                            ("cache_lookups", "ssd:spec_decode_cache_lookups_total"),
                            ("cache_hits", "ssd:spec_decode_cache_hits_total")]:
        grown = metric(after, name) - metric(before, name)
        assert grown == sum(u["speculative"][usage_key] for u in usages), name
    assert metric(after, "ssd:generation_tokens_total") - metric(before, "ssd:generation_tokens_total") == (
        MAX_TOKENS * len(usages))
    if method == "ssd":
        assert sum(u["speculative"]["cache_lookups"] for u in usages) > 0
        assert metric(after, "ssd:spec_decode_cache_hits_total") > 0
        assert metric(after, "ssd:spec_decode_draft_rounds_total") > 0
        assert 0 < metric(after, "ssd:spec_decode_draft_serve_seconds_total") < metric(
            after, "ssd:spec_decode_draft_reply_wait_seconds_total")
        assert metric(after, "ssd:spec_decode_draft_bytes_total", direction="received") > 0
        assert not any(name.startswith("ssd:spec_decode_draft_link_rtt") for name in after)  # a local draft
    assert_all_blocks_free(after, method)


def test_sd_server_greedy_equals_llm_with_concurrent_streams(sd_server, reference):
    _check_speculative_server(sd_server.url, reference, "draft_model")


def test_sd_disconnect_frees_target_and_draft_blocks(sd_server):
    _disconnect_mid_stream(sd_server.url, "draft_model")


def test_ssd_server_greedy_equals_llm_with_concurrent_streams(ssd_server, reference):
    _check_speculative_server(ssd_server.url, reference, "ssd")


def test_ssd_disconnect_frees_target_and_draft(ssd_server):
    _disconnect_mid_stream(ssd_server.url, "ssd")
    assert ssd_server.proc.poll() is None  # still serving


def test_engine_fault_fails_only_its_requests(target):
    """A step that raises fails the requests in it (500 / an error event), frees them, and serving goes on."""
    engine = LLMEngine(EngineConfig(model=str(target), **ENGINE_OPTIONS))
    real_step, faults = engine.step, {"left": 0}

    def flaky_step():
        if faults["left"]:
            faults["left"] -= 1
            raise RuntimeError("injected fault")
        return real_step()

    engine.step = flaky_step
    with BackgroundServer(create_app(engine, MODEL_NAME)) as server:
        url = server.url
        faults["left"] = 1
        error = assert_error(httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4}), 500)
        assert error["type"] == "server_error" and "injected fault" in error["message"]
        faults["left"] = 1
        response = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4, "stream": True})
        events = [line for line in response.text.splitlines() if line.startswith("data: ")]
        assert response.status_code == 200 and events[-1] == "data: [DONE]"
        assert "injected fault" in json.loads(events[-2][len("data: "):])["error"]["message"]
        samples = wait_idle(url)
        assert metric(samples, "ssd:request_success_total", finished_reason="error") == 2
        assert_all_blocks_free(samples, None)
        assert httpx.get(url + "/health").status_code == 200
        r = client(url).completions.create(model=MODEL_NAME, prompt="hi", max_tokens=3, temperature=0,
                                           extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 3
