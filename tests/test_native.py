"""How the CPU kernels are built (ssd/models/native.py)."""

from __future__ import annotations

from ssd.models import native


def test_every_build_gets_the_same_fresh_flags():
    """torch.utils.cpp_extension appends its libraries to the ldflags it is given: flags shared between builds
    would grow, change the next kernel's build command and make every process that loads the kernels in another
    order rebuild them."""
    seen = []

    def build(cflags: list[str], ldflags: list[str]) -> None:
        seen.append((list(cflags), list(ldflags)))
        cflags.append("-lc10")
        ldflags.append("-ltorch")

    native._with_openmp(build, "first")
    native._with_openmp(build, "second")
    assert seen[0] == seen[1] == ([*native.CFLAGS, *native.OPENMP], [*native.OPENMP])


def test_a_failed_openmp_build_falls_back_to_one_thread(caplog):
    calls = []

    def build(cflags: list[str], ldflags: list[str]) -> str:
        calls.append(list(cflags))
        if "-fopenmp" in cflags:
            raise RuntimeError("no OpenMP here")
        return "built"

    assert native._with_openmp(build, "kernel") == "built"
    assert calls == [[*native.CFLAGS, "-fopenmp"], [*native.CFLAGS]]
    assert "building it single-threaded" in caplog.text
