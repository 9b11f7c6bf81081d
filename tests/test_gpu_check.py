"""Smoke test of bench/gpu_check.py on CPU with tiny shapes: every part runs, checks pass, the JSON is complete.

The GPU run itself (graph capture, 8B-shaped timing) cannot happen here; this keeps its logic from rotting.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.fixture(scope="module")
def gpu_check():
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location("gpu_check", BENCH / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def test_tiny_cpu_run(gpu_check, checkpoint_factory, tmp_path: Path, capsys) -> None:
    out = tmp_path / "gpu_check.json"
    code = gpu_check.main(["--device", "cpu", "--tiny", "--skip", "spec", "--iters", "1", "--threads", "1",
                           "--checkpoint", str(checkpoint_factory()), "--json", str(out)])
    printed = capsys.readouterr().out
    data = json.loads(out.read_text())
    assert code == 0 and data["passed"], printed
    names = [c["name"] for c in data["checks"]]
    assert any("graph runner" in n for n in names) and any("transformers" in n for n in names)
    assert all(c["passed"] for c in data["checks"])
    rows = {(t["model"], t["step"], t["mode"]) for t in data["timings"]}
    for mode in ("eager", "static eager"):
        assert ("target", "AR decode", mode) in rows and ("target", "verify K+1=8", mode) in rows
        assert ("draft", "tree M=16", mode) in rows
    assert not any(t["mode"] == "cuda graphs" for t in data["timings"])  # no capture without CUDA
    assert data["bandwidth_gbps"] > 0 and all(t["floor_ms"] > 0 and t["x_floor"] > 0 for t in data["timings"])
    assert data["targets"]["ar_met"] is None  # targets are judged only on graph rows, i.e. on a GPU
    assert "x floor" in printed
    assert data["engine_overhead"]["engine_over_bare"] > 0 and data["engine_overhead"]["bare_step_ms"] > 0


def test_weight_bytes_read_counts_embedding_only_when_tied(gpu_check) -> None:
    untied = gpu_check.random_model(gpu_check.TINY_TARGET, torch.float32, torch.device("cpu"))
    tied = gpu_check.random_model(gpu_check.TINY_DRAFT, torch.float32, torch.device("cpu"))
    all_bytes = lambda m: sum(p.numel() * 4 for p in m.parameters())  # noqa: E731
    assert gpu_check.weight_bytes_read(untied) == all_bytes(untied) - 512 * 64 * 4
    assert gpu_check.weight_bytes_read(tied) == all_bytes(tied)
    assert all(torch.isfinite(p).all() for p in untied.parameters())


def test_failed_check_fails_the_run(gpu_check) -> None:
    report = gpu_check.Report("cpu", True, checks=[gpu_check.Check("a", True), gpu_check.Check("b", False)])
    assert not report.passed


def test_parse_args_rejects_unknown_part(gpu_check) -> None:
    with pytest.raises(SystemExit):
        gpu_check.parse_args(["--skip", "everything"])


def test_no_host_sync_check_runs(gpu_check, checkpoint_factory) -> None:
    """The GPU-only sync check's plumbing, with a recording switch instead of CUDA's sync debug mode."""
    from ssd.models.loader import load_model

    model = load_model(checkpoint_factory(), dtype=torch.float32, device="cpu")[0].eval()
    modes: list[str] = []
    check = gpu_check.check_no_host_sync("llama", model, torch.device("cpu"), modes.append)
    assert check.passed, check.detail
    assert modes == ["error", "default", "error", "default"]

    def strict(mode: str) -> None:
        if mode == "error":
            raise_next.append(True)

    raise_next: list[bool] = []
    original = model.forward

    def syncing_forward(*args, **kwargs):
        if raise_next:
            raise_next.clear()
            raise RuntimeError("called a synchronizing CUDA operation")
        return original(*args, **kwargs)

    model.forward = syncing_forward
    try:
        failed = gpu_check.check_no_host_sync("llama", model, torch.device("cpu"), strict)
    finally:
        del model.forward
    assert not failed.passed and "reference" in failed.detail and "static" in failed.detail


def test_a_part_that_raises_is_a_failed_check_and_the_rest_still_runs(gpu_check, tmp_path: Path, monkeypatch) -> None:
    def broken(*args, **kwargs):
        raise RuntimeError("capture failed")

    monkeypatch.setattr(gpu_check, "part_exactness", broken)
    out = tmp_path / "gpu_check.json"
    code = gpu_check.main(["--device", "cpu", "--tiny", "--skip", "spec", "--iters", "1", "--threads", "1",
                           "--json", str(out)])
    data = json.loads(out.read_text())
    assert code == 1 and not data["passed"]
    [failed] = data["checks"]
    assert failed["name"] == "part exactness ran to the end" and "capture failed" in failed["detail"]
    assert data["timings"]  # the timing part ran after the failure
