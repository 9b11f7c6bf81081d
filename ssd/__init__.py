"""SSD: LLM inference with speculative speculative decoding.

Public API: :class:`LLM` (offline generation), :class:`SamplingParams`, the configuration dataclasses and the
output types. Importing the package has no side effects (no threads, seeds or devices are touched).
"""

from importlib import import_module
from typing import Any

_EXPORTS = {
    "LLM": "ssd.llm",
    "EngineConfig": "ssd.config",
    "SpeculativeConfig": "ssd.config",
    "SamplingParams": "ssd.sampling_params",
    "RequestOutput": "ssd.outputs",
    "RequestMetrics": "ssd.outputs",
    "SpecStats": "ssd.outputs",
    "TokenLogprob": "ssd.outputs",
}


def __getattr__(name: str) -> Any:
    """Lazy exports: ``import ssd.core`` must not pull in torch."""
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'ssd' has no attribute {name!r}")


__all__ = [
    "LLM",
    "EngineConfig",
    "SpeculativeConfig",
    "SamplingParams",
    "RequestOutput",
    "RequestMetrics",
    "SpecStats",
    "TokenLogprob",
]
__version__ = "0.1.0"
