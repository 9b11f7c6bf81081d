"""Typed engine configuration with validation at construction time."""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any

from ssd.dtypes import DTYPE_NAMES, resolve_dtype
from ssd.models.weight_formats import AUTO, DRAFT_WEIGHT_FORMATS, resolve_weight_format
from ssd.spec.lookahead import ADAPTIVE_AUTO
from ssd.spec.lookup import LookupConfig
from ssd.spec.ssd.fallback_policy import FALLBACKS, FILLER_PADDINGS
from ssd.spec.ssd.fanout import check_budget, has_adjustable_budget

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)
_UNIT_POWER = {"B": 0, "K": 1, "M": 2, "G": 3, "T": 4}


def parse_bytes(value: int | float | str) -> int:
    """'512MiB', '2GB', '1.5G' or a plain number of bytes -> bytes."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value <= 0:
            raise ValueError(f"memory size must be positive, got {value!r}")
        return int(value)
    match = _SIZE_RE.match(str(value))
    if not match:
        raise ValueError(f"cannot parse memory size {value!r}; use e.g. '512MiB', '2GB' or a number of bytes")
    number, unit = float(match.group(1)), (match.group(2) or "B").upper()
    base = 1024 if "I" in unit else 1000
    result = int(number * base ** _UNIT_POWER[unit[0]])
    if result <= 0:
        raise ValueError(f"memory size must be positive, got {value!r}")
    return result


SPEC_METHODS = ("draft_model", "ssd", "ngram")  # ngram: prompt lookup alone, no draft model


@dataclass
class SpeculativeConfig:
    """Speculative decoding options, named as in vLLM where a counterpart exists."""

    method: str = "draft_model"
    model: str | None = None
    num_speculative_tokens: int = 4
    # choose each step's K in 0..num_speculative_tokens from the measured acceptance per depth and the
    # measured step time per batch size (ssd/spec/lookahead.py); SSD still builds its cache for the full K.
    # "auto": adaptive for SD and prompt lookup; for SSD while two or more sequences decode together, the full K
    # for one (ssd/spec/lookahead.py: auto_min_batch_size; measurements in the README, Adaptive lookahead).
    adaptive_lookahead: bool | str = "auto"
    # False: the step that finishes a prompt emits its one token without waiting for the draft's prefill and
    # drafts (a shorter time to first token; SSD's worker prefills while the target does), and speculation
    # starts with the next step. True: that step also verifies a speculation (up to K + 1 first tokens at once).
    prompt_step_speculation: bool = False
    draft_dtype: str | None = None  # default: the target's dtype; "auto" resolves for the draft's device
    # "auto": float16 weights packed for FBGEMM where the draft runs on CPU in float32 (ssd/models/weight_formats.py)
    draft_weight_format: str = AUTO
    # Drafts copy the token that followed the longest earlier match (>= min, counted to max tokens) of the
    # context's suffix, when there is one (ssd/spec/lookup.py); both SD and SSD.
    prompt_lookup: bool = True
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 8
    # SSD only
    # "auto": geometric allocation; "dynamic": each sequence's likeliest outcomes; both with the budget steered
    # by BudgetController (ssd/spec/ssd/fanout.py, dynamic_fanout.py)
    fan_out: int | list[int] | str = "dynamic"
    fan_out_miss: int | list[int] | str | None = None
    fan_out_budget: int | None = None  # branches per sequence of "auto"/"dynamic" fan-outs; None: adapted online
    fallback: str = "auto"  # on a cache miss: jit or random, chosen from measured rates (FallbackPolicy)
    # random fillers past prompt lookup's copies: "none", "repeat" the pending token up to K, or "auto"
    # (none on CPU, repeat on CUDA), see ssd/spec/ssd/fallback_policy.py
    filler_padding: str = "auto"
    saguaro_c: float = 1.0
    # The draft stops building its speculation cache when the target's next request arrives, or before a tree
    # step that would still run when the request is due; every branch keeps the tokens drafted so far
    # (ssd/spec/ssd/build_clock.py, draft_engine.py). False: builds always reach K.
    interruptible_build: bool = True
    draft_device: str | None = None
    draft_threads: int | None = None
    draft_timeout_s: float = 60.0

    @classmethod
    def from_any(cls, value: "SpeculativeConfig | dict[str, Any] | None") -> "SpeculativeConfig | None":
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict or SpeculativeConfig, got {type(value).__name__}")
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"unknown speculative_config keys {unknown}; allowed: {sorted(known)}")
        return cls(**value)

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative method {self.method!r} is not supported; choose one of {SPEC_METHODS}")
        if self.method == "ngram":
            if self.model:
                raise ValueError("method 'ngram' drafts with prompt lookup alone; leave 'model' unset")
            if not self.prompt_lookup:
                raise ValueError("method 'ngram' drafts with prompt lookup only; it needs prompt_lookup=True")
        elif not self.model:
            raise ValueError("speculative_config needs 'model': the path of the draft checkpoint")
        if not isinstance(self.num_speculative_tokens, int) or self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be an integer >= 1, got {self.num_speculative_tokens!r}")
        if not (isinstance(self.adaptive_lookahead, bool) or self.adaptive_lookahead == ADAPTIVE_AUTO):
            raise ValueError(f"adaptive_lookahead must be True, False or 'auto', got {self.adaptive_lookahead!r}")
        if not isinstance(self.prompt_step_speculation, bool):
            raise ValueError(f"prompt_step_speculation must be True or False, got {self.prompt_step_speculation!r}")
        if self.fan_out_budget is not None:
            check_budget(self.fan_out_budget, "fan_out_budget")
            if not any(has_adjustable_budget(f) for f in (self.fan_out, self.fan_out_miss)):
                raise ValueError("fan_out_budget only applies to a fan_out or fan_out_miss of 'auto' or 'dynamic'")
        _ = self.lookup  # validates prompt_lookup_min / prompt_lookup_max
        if self.fallback not in FALLBACKS:
            raise ValueError(f"fallback must be one of {FALLBACKS}, got {self.fallback!r}")
        if self.filler_padding not in FILLER_PADDINGS:
            raise ValueError(f"filler_padding must be one of {FILLER_PADDINGS}, got {self.filler_padding!r}")
        if not isinstance(self.interruptible_build, bool):
            raise ValueError(f"interruptible_build must be True or False, got {self.interruptible_build!r}")
        if not (0.0 < float(self.saguaro_c) <= 1.0):
            raise ValueError(f"saguaro_c must be in (0, 1], got {self.saguaro_c!r}")
        if self.draft_timeout_s <= 0:
            raise ValueError(f"draft_timeout_s must be positive, got {self.draft_timeout_s!r}")
        if self.draft_dtype is not None and self.draft_dtype not in DTYPE_NAMES:
            raise ValueError(f"draft_dtype {self.draft_dtype!r} is not supported; choose one of {list(DTYPE_NAMES)}")
        if self.draft_weight_format not in DRAFT_WEIGHT_FORMATS:
            raise ValueError(f"draft_weight_format {self.draft_weight_format!r} is not supported; choose one of "
                             f"{list(DRAFT_WEIGHT_FORMATS)}")

    @property
    def lookup(self) -> LookupConfig:
        return LookupConfig(bool(self.prompt_lookup), self.prompt_lookup_min, self.prompt_lookup_max)


@dataclass
class EngineConfig:
    """Everything the engine needs to start; validated eagerly so mistakes surface before any model loads."""

    model: str
    tokenizer: str | None = None
    dtype: str = "auto"  # see ssd.dtypes.resolve_dtype: float32 (+ packed fp16 weights) on CPU, bf16 on CUDA
    # "auto": float16 weights packed for FBGEMM where dtype "auto" resolved to float32 on CPU (an explicit
    # dtype="float32" keeps float32 weights); "dense" or "fp16-packed" to choose (ssd/models/weight_formats.py)
    weight_format: str = AUTO
    device: str = "cpu"
    max_model_len: int | None = None  # default: the model's max_position_embeddings, capped at 4096
    block_size: int = 16
    kv_cache_memory: int | str | None = None  # KV cache bytes per target rank; default from kv_cache_fraction
    kv_cache_fraction: float = 0.25  # of currently available device memory, when kv_cache_memory is unset
    max_num_seqs: int = 16
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    seed: int = 0
    num_threads: int | None = None  # torch intra-op threads per target rank (CPU)
    tensor_parallel_size: int = 1  # target ranks; rank 0 is this process, the others are spawned (or torchrun)
    distributed_timeout_s: float = 300.0  # a collective stuck this long means a rank is gone
    enforce_eager: bool = False  # CUDA: never capture CUDA graphs (no effect on CPU)
    compile_model: bool = False  # CUDA: torch.compile the forward of graph-captured steps
    fused_kernels: bool = True  # CUDA with Triton: fused norm, RoPE + K/V write, SiLU and attention kernels
    speculative_config: SpeculativeConfig | dict[str, Any] | None = field(default=None)

    def __post_init__(self) -> None:
        requested_dtype, self.dtype = self.dtype, resolve_dtype(self.dtype, self.device)
        self.weight_format = resolve_weight_format(
            self.weight_format, self.device, self.dtype, explicit_dtype=requested_dtype != AUTO
        )
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_model_len is not None and (not isinstance(self.max_model_len, int) or self.max_model_len < 2):
            raise ValueError(f"max_model_len must be an integer >= 2, got {self.max_model_len!r}")
        if not 0.0 < self.kv_cache_fraction <= 0.95:
            raise ValueError(f"kv_cache_fraction must be in (0, 0.95], got {self.kv_cache_fraction!r}")
        if self.kv_cache_memory is not None:
            self.kv_cache_memory = parse_bytes(self.kv_cache_memory)
        if self.num_threads is not None and (not isinstance(self.num_threads, int) or self.num_threads < 1):
            raise ValueError(f"num_threads must be a positive integer, got {self.num_threads!r}")
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {self.tensor_parallel_size!r}")
        if not self.distributed_timeout_s > 0:
            raise ValueError(f"distributed_timeout_s must be positive, got {self.distributed_timeout_s!r}")
        self.speculative_config = SpeculativeConfig.from_any(self.speculative_config)
        spec = self.speculative_config
        if spec is not None:  # the draft's own device decides what "auto" means for it (a copy: no caller mutation)
            draft_device = spec.draft_device or self.device
            draft_dtype = resolve_dtype(spec.draft_dtype or requested_dtype, draft_device)
            weight_format = resolve_weight_format(spec.draft_weight_format, draft_device, draft_dtype, draft=True)
            self.speculative_config = replace(spec, draft_dtype=draft_dtype, draft_weight_format=weight_format)

