"""The CPU kernels: the C++ sources of ``csrc/`` built into one extension for the CPU at hand on first use
(``torch.utils.cpp_extension``; a C++ compiler and ninja are needed) and cached by PyTorch between processes.
One extension, so that the layer stack (``csrc/layer_stack.cpp``) calls the other kernels directly.

Each kernel is built with ``-march=native`` so that its fixed-order loops become the vector instructions of
this CPU, and with ``-ffp-contract=off`` so that the compiler never fuses a multiply and an add the source
wrote apart (a fused and an unfused path would round differently). The module name carries a hash of the
CPU's flags, so a cache shared between machines never loads a binary built for another CPU; every mode of an
engine on one machine runs the same binary, which is what batch invariance needs. Kernels are built with
OpenMP so that ``at::parallel_for`` uses torch's threads (each output is still computed by one thread, in one
fixed order, so results do not depend on the thread count).
"""

from __future__ import annotations

import functools
import hashlib
import logging
from collections.abc import Callable
from pathlib import Path

from ssd.cpu_features import cpu_flags

logger = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).resolve().parent / "csrc"
CFLAGS = ("-O3", "-march=native", "-ffp-contract=off")
# at::parallel_for is OpenMP inline in ATen's headers: without -fopenmp its pragma is ignored and a kernel runs
# on one thread whatever torch.set_num_threads says. Linking libgomp.so.1 binds to the copy torch has loaded.
# A compiler without OpenMP still builds the kernels, single-threaded.
OPENMP = ("-fopenmp",)


def native_name(stem: str) -> str:
    """``stem`` plus a short hash of this CPU's feature flags."""
    return f"{stem}_{hashlib.sha1(' '.join(sorted(cpu_flags())).encode()).hexdigest()[:10]}"


def _with_openmp(build: Callable[[list[str], list[str]], object], stem: str):
    """``build(cflags, ldflags)`` with OpenMP, or without it where that fails. Each call gets lists of its own:
    ``torch.utils.cpp_extension`` appends its libraries to the ldflags it is given, and flags carried over into
    the next kernel's build would change its command, so every process that loads the kernels in another order
    would rebuild them (~30 s each)."""
    try:
        return build([*CFLAGS, *OPENMP], [*OPENMP])
    except Exception as exc:  # e.g. a compiler without OpenMP: one thread is still correct
        logger.warning("%s: building with OpenMP failed (%s); building it single-threaded", stem, exc)
        return build([*CFLAGS], [])


SOURCES = ("block_quant.cpp", "cpu_fused.cpp", "row_attention.cpp", "layer_stack.cpp", "bindings.cpp")
"""The sources of :func:`cpu_kernels`, all in ``csrc/`` (with its headers)."""


def _headers_digest() -> str:
    """A hash of ``csrc/``'s headers: PyTorch rebuilds an extension when its sources or flags change, not its
    headers, so the build's flags carry this."""
    digest = hashlib.sha1()
    for header in sorted(SOURCE_DIR.glob("*.h")):
        digest.update(header.read_bytes())
    return digest.hexdigest()[:12]


@functools.cache
def cpu_kernels():
    """The extension of every CPU kernel (:data:`SOURCES`), compiled on first use; raises where no compiler or
    ninja is available."""
    from torch.utils.cpp_extension import load

    stem = "ssd_cpu_kernels"
    return _with_openmp(lambda cflags, ldflags: load(
        name=native_name(stem), sources=[str(SOURCE_DIR / source) for source in SOURCES],
        extra_cflags=[*cflags, f"-DSSD_HEADERS={_headers_digest()}"], extra_ldflags=ldflags,
        extra_include_paths=[str(SOURCE_DIR)], verbose=False), stem)


@functools.cache
def cpu_kernels_available() -> bool:
    """Whether :func:`cpu_kernels` compiled (or was found compiled) here; logs once why not."""
    return compiles(cpu_kernels, "the CPU kernels (block-quantized products, fused glue, row attention)")


def compiles(load: Callable[[], object], what: str) -> bool:
    """Whether ``load`` (a cached loader) compiles or finds its extension here; logs why not."""
    try:
        load()
        return True
    except Exception as exc:  # no compiler, no ninja, headers missing: say so
        logger.warning("%s unavailable: %s", what, exc)
        return False
