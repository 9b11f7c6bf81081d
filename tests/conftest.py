"""Shared fixtures.

``checkpoint_factory(arch="llama", **options) -> Path`` builds (once per session and distinct option set) a
tiny random HF checkpoint with tokenizer; see :func:`checkpoints.make_checkpoint` for the options.
Treat the returned folders as read-only: other tests share them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from checkpoints import make_checkpoint

if not torch.cuda.is_available():
    # Without a GPU, Triton kernels (tests/test_fused_kernels.py) run in Triton's interpreter on CPU tensors.
    # Triton reads this when it is first imported, and it must stay set while kernels run.
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def checkpoint_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    root = tmp_path_factory.mktemp("checkpoints")
    cache: dict[str, Path] = {}

    def factory(arch: str = "llama", **options: Any) -> Path:
        key = json.dumps({"arch": arch, **options}, sort_keys=True, default=repr)
        if key not in cache:
            cache[key] = make_checkpoint(root / f"ckpt{len(cache)}_{arch}", arch, **options)
        return cache[key]

    return factory


@pytest.fixture(scope="session")
def default_target() -> str:
    """The project's default target (SmolLM2-135M-Instruct), fetched once; the test skips where it cannot be."""
    from ssd.models.fetch import FetchError, fetch_default_target

    try:
        return str(fetch_default_target())
    except FetchError as exc:
        pytest.skip(f"the default target SmolLM2-135M-Instruct cannot be fetched here: {exc}")

