"""SSD: LLM inference with speculative speculative decoding.

Public API: :class:`LLM` (offline generation), :class:`SamplingParams`, the configuration dataclasses and the
output types. Importing the package has no side effects (no threads, seeds or devices are touched).
"""

from ssd.config import EngineConfig, SpeculativeConfig
from ssd.llm import LLM
from ssd.outputs import RequestMetrics, RequestOutput, SpecStats, TokenLogprob
from ssd.sampling_params import SamplingParams

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
