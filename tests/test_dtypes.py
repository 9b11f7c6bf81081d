"""``dtype="auto"``: float32 with packed float16 weights on a CPU with FBGEMM, else bfloat16 only where the
hardware computes it natively; explicit dtypes pass through."""

from __future__ import annotations

from pathlib import Path

import pytest

from ssd import dtypes
from ssd.config import EngineConfig
from ssd.models import weight_formats
from ssd.resolve import resolve_config


@pytest.fixture
def cpu_flags(monkeypatch):
    def use(*flags: str, fbgemm: bool = False) -> None:
        monkeypatch.setattr(dtypes, "cpu_flags", lambda: frozenset(flags))
        monkeypatch.setattr(weight_formats, "fbgemm_available", lambda: fbgemm)

    return use


@pytest.mark.parametrize(
    ("flags", "expected"),
    [(("avx2", "fma"), "float32"), (("avx512f", "avx512_bf16"), "bfloat16"), (("amx_bf16", "amx_tile"), "bfloat16")],
)
def test_auto_on_cpu_without_fbgemm_follows_native_bf16(cpu_flags, flags, expected) -> None:
    cpu_flags(*flags)
    assert dtypes.resolve_dtype("auto", "cpu") == expected


@pytest.mark.parametrize("flags", [("avx2", "fma"), ("avx512f", "avx512_bf16"), ("amx_bf16", "amx_tile")])
def test_auto_on_cpu_with_fbgemm_is_float32_with_packed_weights(cpu_flags, flags) -> None:
    cpu_flags(*flags, fbgemm=True)
    assert dtypes.resolve_dtype("auto", "cpu") == "float32"
    assert resolve_config(EngineConfig(model="m")).weight_format == "fp16-packed"


def test_explicit_dtypes_pass_through_and_unknown_ones_are_refused(cpu_flags) -> None:
    cpu_flags("avx2")
    for name in ("bfloat16", "float32", "float16"):
        assert dtypes.resolve_dtype(name, "cpu") == name
    with pytest.raises(ValueError, match="dtype 'fp8' is not supported"):
        dtypes.resolve_dtype("fp8", "cpu")
    with pytest.raises(ValueError, match="dtype 'fp8' is not supported"):
        EngineConfig(model="m", dtype="fp8")


def test_engine_config_resolves_target_and_draft_dtypes(cpu_flags) -> None:
    cpu_flags("avx2")
    requested = EngineConfig(model="m", speculative_config={"method": "ssd", "model": "d"})
    config = resolve_config(requested)
    assert config.dtype == "float32" and config.speculative_config.draft_dtype == "float32"
    assert requested.dtype == "auto" and requested.spec.draft_dtype is None  # what the user asked for is kept
    config = resolve_config(EngineConfig(model="m", dtype="bfloat16", speculative_config={"model": "d"}))
    assert config.speculative_config.draft_dtype == "bfloat16"  # the draft follows an explicit target dtype
    spec = {"model": "d", "draft_dtype": "auto"}
    config = resolve_config(EngineConfig(model="m", dtype="bfloat16", speculative_config=spec))
    assert config.speculative_config.draft_dtype == "float32"
    with pytest.raises(ValueError, match="draft_dtype 'int4' is not supported"):
        EngineConfig(model="m", speculative_config={"model": "d", "draft_dtype": "int4"})


@pytest.mark.skipif(not Path("/proc/cpuinfo").exists(), reason="no /proc/cpuinfo on this system")
def test_cpu_flags_are_read_from_the_kernel() -> None:
    flags = dtypes.cpu_flags()
    assert flags and all(" " not in f and ":" not in f for f in flags)
