"""``ssd chat`` driven in-process with stdin piped: streamed replies, multi-turn history, /reset, --metrics,
against the in-process engine and against a running server (``--url``).

Replies are greedy, so each one must equal ``LLM.chat`` of the same conversation (the history includes the
earlier replies as assistant turns). With piped stdin the command prints no prompts: stdout is exactly the
replies, one per line, and ``--metrics`` lines go to stderr.
"""

from __future__ import annotations

import io
import json
import re
import shutil
import socket
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ssd import LLM, SamplingParams
from ssd.cli.chat import ReplyStats
from ssd.cli.main import main
from ssd.config import EngineConfig
from ssd.engine import LLMEngine
from ssd.server.app import BackgroundServer, create_app

MAX_TOKENS = 8
ENGINE_FLAGS = ["--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory", "16MiB", "--seed", "0"]
SAMPLING_FLAGS = ["--max-tokens", str(MAX_TOKENS), "--temperature", "0", "--ignore-eos"]
SYSTEM = "You are brief."
TURNS = ["Hello! How are you today?", "Tell me about the village by the river."]
METRICS_LINE = re.compile(r"^\[8 tokens, (\d+\.\d|-) tok/s, TTFT \d+ ms(, acceptance [\d.]+% \(mean length [\d.]+\))?")


@pytest.fixture(scope="module")
def target(checkpoint_factory) -> Path:
    return checkpoint_factory(arch="llama")


@pytest.fixture(scope="module")
def draft(target, tmp_path_factory) -> Path:
    """The target with small relative noise on its weights: a draft that agrees often but not always."""
    dst = tmp_path_factory.mktemp("chat_draft") / "draft"
    shutil.copytree(target, dst)
    weights = load_file(target / "model.safetensors")
    gen = torch.Generator().manual_seed(7)
    noisy = {n: (w + 0.05 * w.std() * torch.randn(w.shape, generator=gen)).contiguous() for n, w in
             sorted(weights.items())}
    save_file(noisy, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def expected(target) -> list[str]:
    """Greedy replies to TURNS as one conversation (with the system message)."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    replies: list[str] = []
    history = [{"role": "system", "content": SYSTEM}]
    with LLM(str(target), dtype="float32", max_model_len=256, kv_cache_memory="16MiB", seed=0) as llm:
        for turn in TURNS:
            history.append({"role": "user", "content": turn})
            reply = llm.chat(history, params)[0].text
            history.append({"role": "assistant", "content": reply})
            replies.append(reply)
    return replies


def run_cli(monkeypatch, capsys, args: list[str], stdin: str) -> tuple[int, str, str]:
    monkeypatch.setattr("sys.stdin", io.StringIO(stdin))
    code = main(["chat", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_local_multi_turn_history_and_reset(monkeypatch, capsys, target, expected):
    stdin = f"{TURNS[0]}\n\n{TURNS[1]}\n/reset\n{TURNS[0]}\n/exit\n{TURNS[1]}\n"
    code, out, err = run_cli(monkeypatch, capsys,
                             ["--model", str(target), "--system", SYSTEM, *ENGINE_FLAGS, *SAMPLING_FLAGS], stdin)
    assert code == 0, err
    # turn 1, turn 2 (sees turn 1), after /reset turn 1 again; /exit stops before the last line
    assert out == f"{expected[0]}\n{expected[1]}\n{expected[0]}\n"
    assert "[conversation cleared]" in err
    assert not METRICS_LINE.search(err)


def test_local_speculative_with_metrics(monkeypatch, capsys, target, draft, expected):
    args = ["--model", str(target), "--draft", str(draft), "--method", "draft_model", "--k", "3",
            "--system", SYSTEM, "--metrics", *ENGINE_FLAGS, *SAMPLING_FLAGS]
    code, out, err = run_cli(monkeypatch, capsys, args, "\n".join(TURNS) + "\n")  # ends by end of input
    assert code == 0, err
    assert out == f"{expected[0]}\n{expected[1]}\n"
    lines = [line for line in err.splitlines() if line.startswith("[8 tokens")]
    assert len(lines) == 2
    assert all(METRICS_LINE.match(line) and "acceptance" in line for line in lines), lines


def test_remote_server_with_metrics(monkeypatch, capsys, target, draft, expected):
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
    engine = LLMEngine(EngineConfig(model=str(target), dtype="float32", max_model_len=256, kv_cache_memory="16MiB",
                                    seed=0, speculative_config=spec))
    with BackgroundServer(create_app(engine, "tiny")) as server:
        args = ["--url", server.url + "/v1", "--system", SYSTEM, "--metrics", *SAMPLING_FLAGS]
        code, out, err = run_cli(monkeypatch, capsys, args, "\n".join(TURNS) + "\n/quit\n")
    assert code == 0, err
    assert out == f"{expected[0]}\n{expected[1]}\n"
    lines = [line for line in err.splitlines() if line.startswith("[8 tokens")]
    assert len(lines) == 2 and all(METRICS_LINE.match(line) and "acceptance" in line for line in lines), err


def test_unreachable_server_is_a_clear_error(monkeypatch, capsys):
    with socket.socket() as sock:  # a port nobody listens on once closed
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    code, out, err = run_cli(monkeypatch, capsys, ["--url", f"http://127.0.0.1:{port}"], "hi\n")
    assert code == 1
    assert out == ""
    assert f"cannot reach an OpenAI-compatible server at http://127.0.0.1:{port}" in err


def test_decode_rate_leaves_out_the_first_chunk() -> None:
    """A speculative first chunk can carry K + 1 tokens; they belong to the TTFT, not to the decode rate."""
    assert ReplyStats(10, elapsed_s=2.0, ttft_s=1.0, num_first_tokens=5).decode_tokens_per_s == 5.0
    assert ReplyStats(10, elapsed_s=2.0, ttft_s=1.0).decode_tokens_per_s == 9.0
    assert ReplyStats(5, elapsed_s=2.0, ttft_s=1.0, num_first_tokens=5).decode_tokens_per_s is None


def test_structured_outputs_flag_locally_and_through_a_server(monkeypatch, capsys, target):
    """``--structured-outputs`` constrains the local engine's replies and is sent to a server as the request's
    ``structured_outputs`` field: both reply with the constrained AR's text; a malformed constraint is a usage error."""
    choices = ["red", "green", "blue"]
    flags = ["--structured-outputs", json.dumps({"choice": choices}), "--temperature", "0", "--max-tokens", "8"]
    params = SamplingParams(temperature=0.0, max_tokens=8, structured_outputs={"choice": choices})
    with LLM(str(target), dtype="float32", max_model_len=256, kv_cache_memory="16MiB", seed=0) as llm:
        expected = llm.chat([{"role": "user", "content": TURNS[0]}], params)[0].text
    assert expected in choices
    code, out, err = run_cli(monkeypatch, capsys, ["--model", str(target), *ENGINE_FLAGS, *flags], TURNS[0] + "\n")
    assert code == 0 and out == f"{expected}\n", err
    engine = LLMEngine(EngineConfig(model=str(target), dtype="float32", max_model_len=256, kv_cache_memory="16MiB",
                                    seed=0))
    with BackgroundServer(create_app(engine, "tiny")) as server:
        code, out, err = run_cli(monkeypatch, capsys, ["--url", server.url + "/v1", *flags], TURNS[0] + "\n")
    assert code == 0 and out == f"{expected}\n", err
    with pytest.raises(SystemExit):
        run_cli(monkeypatch, capsys, ["--structured-outputs", '{"choice": []}'], "hi\n")
    assert "choice must be a non-empty list" in capsys.readouterr().err
