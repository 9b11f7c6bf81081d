"""The vLLM peer of the benchmark suite (bench/vllm_peer.py, bench/vllm_worker.py), without vLLM: the draft's
full-vocabulary export, the worker protocol against a stand-in ``vllm`` package, the summary's ratios."""

from __future__ import annotations

import importlib.util
import shutil
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

BENCH = Path(__file__).resolve().parent.parent / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import vllm_peer  # noqa: E402
from workers import WorkerError  # noqa: E402
from vllm_worker import full_vocabulary_draft  # noqa: E402


def test_full_vocabulary_draft_predicts_like_the_reduced_draft(checkpoint_factory, tmp_path: Path) -> None:
    """The export reads target ids and gives the draft's own logits at its kept ids and 0 everywhere else."""
    from transformers import AutoModelForCausalLM

    from ssd.models.draft_vocab import DraftVocab

    draft = tmp_path / "draft"
    shutil.copytree(checkpoint_factory("llama", vocab_size=512, seed=5), draft)
    assert full_vocabulary_draft(str(draft), tmp_path / "unused") == str(draft)  # no draft_vocab.json: as it is
    target_vocab, kept = 1024, 511
    rng = np.random.default_rng(1)
    d2t = np.concatenate([np.sort(rng.choice(target_vocab, kept, replace=False)), [-1]])  # [512]
    vocab = DraftVocab(target_vocab, d2t, unknown_id=kept)
    vocab.save(draft)

    full_path = full_vocabulary_draft(str(draft), tmp_path / "full")
    assert not (Path(full_path) / "draft_vocab.json").exists()
    full = AutoModelForCausalLM.from_pretrained(full_path, dtype=torch.float32).eval()
    small = AutoModelForCausalLM.from_pretrained(str(draft), dtype=torch.float32).eval()
    assert full.config.vocab_size == target_vocab
    outside_id = int(np.setdiff1d(np.arange(target_vocab), d2t)[0])
    target_ids = torch.tensor([[int(d2t[3]), outside_id, int(d2t[9])]])
    draft_ids = torch.from_numpy(vocab.target_to_draft())[target_ids]  # [1, 3]; the outside id -> unknown
    with torch.inference_mode():
        got = full(target_ids).logits  # [1, 3, 1024]
        want = small(draft_ids).logits  # [1, 3, 512]
    kept_ids = torch.from_numpy(d2t[:kept])
    torch.testing.assert_close(got[..., kept_ids], want[..., :kept])
    outside = torch.ones(target_vocab, dtype=torch.bool)
    outside[kept_ids] = False
    assert torch.all(got[..., outside] == 0)


FAKE_VLLM = '''
"""A stand-in for vLLM's offline API: each output token is the prompt's length plus its index."""
import os

__version__ = "0.0-test"


class SamplingParams:
    def __init__(self, max_tokens, temperature=1.0, ignore_eos=False):
        self.max_tokens = max_tokens


class _Completion:
    def __init__(self, token_ids):
        self.token_ids = token_ids


class _Output:
    def __init__(self, token_ids):
        self.outputs = [_Completion(token_ids)]


class _Counter:
    def __init__(self, name, value):
        self.name, self.value = name, value


class LLM:
    def __init__(self, model, dtype, max_model_len, speculative_config, enable_prefix_caching, disable_log_stats):
        self.spec = speculative_config
        self.rounds = 0
        spec = speculative_config or {}
        seen = ":".join(str(spec[k]) for k in ("method", "num_speculative_tokens", "prompt_lookup_min",
                                               "prompt_lookup_max") if k in spec) or "None"
        with open(os.environ["FAKE_VLLM_SEEN"], "a") as f:
            f.write(seen + "\\n")

    def generate(self, prompts, params, use_tqdm=True):
        self.rounds += params.max_tokens
        return [_Output([len(p["prompt_token_ids"]) + i for i in range(params.max_tokens)]) for p in prompts]

    def get_metrics(self):
        drafts = float(self.rounds) if self.spec else 0.0
        return [_Counter("vllm:spec_decode_num_drafts", drafts),
                _Counter("vllm:spec_decode_num_draft_tokens", 4 * drafts),
                _Counter("vllm:spec_decode_num_accepted_tokens", 2 * drafts),
                _Counter("vllm:generation_tokens", 1.0)]
'''


SEEN_SPECS: Path


def fake_vllm_env(tmp_path: Path, monkeypatch) -> None:
    """Workers import the stand-in package; each engine appends its speculative config to ``SEEN_SPECS``."""
    global SEEN_SPECS
    package = tmp_path / "fake" / "vllm"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text(textwrap.dedent(FAKE_VLLM))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "fake"))
    SEEN_SPECS = tmp_path / "specs.txt"
    monkeypatch.setenv("FAKE_VLLM_SEEN", str(SEEN_SPECS))


def config(python: str = sys.executable) -> vllm_peer.VllmConfig:
    return vllm_peer.VllmConfig(python, "bfloat16", 0.5, [0], 256)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="a real vLLM is installed here")
def test_worker_without_vllm_fails_with_its_traceback(checkpoint_factory) -> None:
    worker = vllm_peer.VllmWorker("vllm", config(), dict(model=str(checkpoint_factory("llama")), method=None,
                                                         draft=None, k=4, dtype="bfloat16", max_model_len=256,
                                                         warmup_prompt=[1, 2]))
    with pytest.raises(WorkerError, match="No module named 'vllm'"):
        try:
            worker.wait_ready(timeout_s=120)
        finally:
            worker.close()


def test_measure_and_summarise_with_a_stand_in_vllm(checkpoint_factory, tmp_path: Path, monkeypatch) -> None:
    """Every mode's worker starts, connects back, generates (two calls per prompt), reports counters and closes;
    the summary turns the runs into medians, acceptance lengths and the ratios of our numbers to vLLM's."""
    fake_vllm_env(tmp_path, monkeypatch)
    model = str(checkpoint_factory("llama"))
    sets = {"code": [[1, 2, 3], [4, 5]], "chat": [[7, 8, 9, 10]]}
    measured = vllm_peer.measure_vllm(config(), model, model, k=4, sets=sets, output_len=6, repeats=2)
    runs = measured["runs"]
    assert set(runs) == {"code", "chat"} and set(runs["code"]) == set(vllm_peer.MODES)
    first = runs["code"][vllm_peer.VLLM_AR][0]
    assert first["tokens"] == [[3, 4, 5, 6, 7, 8], [2, 3, 4, 5, 6, 7]]
    assert first["decode_tokens"] == 2 * 5 and first["spec"] == {}
    sd = runs["chat"][vllm_peer.VLLM_SD][1]
    # the stand-in counts one draft round per requested token: 1 + 6 per prompt, 2 accepted per round
    assert sd["spec"] == {"num_drafts": 7.0, "num_draft_tokens": 28.0, "num_accepted_tokens": 14.0}
    described = measured["describe"]
    assert [described[name]["method"] for name in vllm_peer.MODES] == [None, "draft_model", "ngram"]
    assert described[vllm_peer.VLLM_AR]["vllm_version"] == "0.0-test"
    assert SEEN_SPECS.read_text().split() == ["None", "draft_model:4", "ngram:4:2:8"]

    for ds in runs:  # fixed speeds, so the ratios are exact
        for mode, rate in ((vllm_peer.VLLM_AR, 40.0), (vllm_peer.VLLM_SD, 50.0), (vllm_peer.VLLM_NGRAM, 45.0)):
            for run in runs[ds][mode]:
                run["decode_tok_s"] = rate
    ours = {"code": {"ar": 60.0, "sd": 55.0, "ssd": 100.0}, "chat": {"ar": 40.0, "sd": 50.0, "ssd": 25.0}}
    our_ar = {"code": [[3, 4, 9, 9, 9, 9], [2, 3, 4, 5, 6, 7]], "chat": None}
    summary = vllm_peer.summarise_vllm(measured, ours, our_ar)
    code, chat = summary["per_dataset"]["code"], summary["per_dataset"]["chat"]
    assert code["ar_over_vllm_ar"] == pytest.approx(1.5) and code["sd_over_vllm_sd"] == pytest.approx(1.1)
    assert code["ssd_over_vllm_sd"] == pytest.approx(2.0) and code["ssd_over_vllm_best"] == pytest.approx(2.0)
    assert chat["ssd_over_vllm_best"] == pytest.approx(0.5)
    assert code["sd_mean_acceptance_length"] == pytest.approx(3.0)
    assert code["ngram_mean_acceptance_length"] == pytest.approx(3.0) and code["ngram_decode_tok_s"] == 45.0
    assert "ar_mean_acceptance_length" not in code and code["sd_equals_vllm_ar"] is True
    assert code["ar_agreeing_prefix_vs_our_ar"] == [2, 6] and chat["ar_agreeing_prefix_vs_our_ar"] == []
    assert summary["ssd_over_vllm_sd"] == pytest.approx(1.0)  # geometric mean of 2.0 and 0.5
    assert summary["ar_over_vllm_ar"] == pytest.approx((1.5 * 1.0) ** 0.5)


def test_suite_without_a_vllm_interpreter_says_why(monkeypatch) -> None:
    import suite

    monkeypatch.delenv(vllm_peer.PYTHON_ENV, raising=False)
    args = suite.parse_args(["--num-prompts", "1"])
    assert args.vllm_python is None and args.vllm_dtype == "bfloat16"
    out = vllm_peer.suite_vllm(args, {}, {}, "target", "draft", {"per_dataset": {}})
    assert out["status"].startswith("skipped: no --vllm-python")
    args = suite.parse_args(["--batch-sizes", "4", "--vllm-python", "/opt/vllm/bin/python"])
    assert "lacks" in vllm_peer.suite_vllm(args, {}, {}, "target", "draft", {"per_dataset": {}})["status"]
    monkeypatch.setenv(vllm_peer.PYTHON_ENV, "/opt/vllm/bin/python")
    assert suite.parse_args([]).vllm_python == "/opt/vllm/bin/python"
