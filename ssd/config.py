"""Typed engine configuration, validated at construction time.

Every option is declared once, as a field with its help text, the processes that read it and its command line
spelling (``ssd/options.py: option``); the ``ssd`` command's flags, the tensor-parallel ranks' runner arguments
and the SSD draft worker's settings are generated from these declarations. This module imports only the
option vocabulary and the standard library: what ``"auto"`` means on the machine (dtypes, weight formats,
filler padding) is decided when the engine starts (``ssd/resolve.py``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from ssd.options import (
    TARGET_WEIGHT_FORMATS,
    AdaptiveMode,
    Dtype,
    Fallback,
    FanOutChoice,
    FanOutKind,
    FillerPadding,
    LookupConfig,
    Process,
    SpecMethod,
    WeightFormat,
    is_int,
    option,
    parse_draft_url,
)

DRAFT, RANK = Process.DRAFT_WORKER, Process.TARGET_RANK

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



@dataclass
class SpeculativeConfig:
    """Speculative decoding options, named as in vLLM where a counterpart exists."""

    method: SpecMethod = option(
        SpecMethod.DRAFT_MODEL, "draft_model (ordinary SD), ssd (the draft in its own process), ngram (prompt "
        "lookup alone, no draft model), or eagle3 (SD with an EAGLE-3 head: ssd/models/eagle3.py)",
        cli_default=SpecMethod.SSD)
    model: str | None = option(None, "draft checkpoint folder (an EAGLE-3 head's for eagle3, a draft model's or a "
                               "head's for ssd); enables speculation",
                               processes=(DRAFT,),
                               flags=("--draft",))
    num_speculative_tokens: int = option(4, "K: the most draft tokens a round verifies per sequence",
                                         processes=(DRAFT,), flags=("--k", "--num-speculative-tokens"))
    adaptive_lookahead: AdaptiveMode = option(
        AdaptiveMode.AUTO, "choose each round's drafts in 0..K from measured acceptance and step times (SSD still "
        "builds its cache K deep): on, off (always K), or auto (on; for SSD from two decoding sequences, see "
        "ssd/speculative/lookahead.py: auto_min_batch_size)", const=AdaptiveMode.ON.value)
    prompt_step_speculation: bool = option(
        False, "the step that finishes a prompt also verifies drafts (up to K + 1 first tokens at once); default: "
        "it emits its one token without waiting for the draft, a lower time to first token (SSD's worker "
        "prefills while the target does), and speculation starts with the next step")
    draft_dtype: Dtype | None = option(None, "the draft's dtype (default: the target's; auto resolves for the "
                                             "draft's device)", processes=(DRAFT,))
    draft_weight_format: WeightFormat = option(
        WeightFormat.AUTO, "the draft's weights: auto (where it runs on CPU in float32: q8_0 where its kernel has "
        "the AVX-512 VNNI path, else w8a8 with VNNI, else fp16-packed), dense, "
        "fp16-packed, int8-packed (int8 attention and gate/up projections: faster many-branch tree steps), w8a8 "
        "(int8 weights and per-row int8 activations everywhere), q8_0, q4_0 or q4_1 (as for the target)",
        processes=(DRAFT,))
    prompt_lookup: bool = option(
        True, "drafts copy the token that followed the longest earlier match of the context's suffix, where "
        "there is one (ssd/speculative/lookup.py; SD and SSD)", processes=(DRAFT,))
    prompt_lookup_min: int = option(2, "shortest context match prompt lookup copies after", processes=(DRAFT,))
    prompt_lookup_max: int = option(8, "longest match prompt lookup compares", processes=(DRAFT,))
    fan_out: FanOutChoice = option(
        FanOutChoice(FanOutKind.DYNAMIC), "SSD fan-out: dynamic (each sequence's likeliest outcomes), auto "
        "(geometric), an int, or a comma list F_0..F_K (ssd/speculative/async_draft/planning/fanout.py)",
        processes=(DRAFT,), parse=FanOutChoice.parse)
    fan_out_miss: FanOutChoice | None = option(None, "SSD fan-out for rounds after a miss (default: fan_out)",
                                             processes=(DRAFT,), parse=FanOutChoice.parse)
    fan_out_budget: int | None = option(None, "branches per sequence of auto and dynamic fan-outs (default: "
                                              "adapted so the draft keeps up)", processes=(DRAFT,))
    fallback: Fallback = option(Fallback.AUTO, "SSD, on a cache miss: jit, random, or auto (the faster one as "
                                               "measured: ssd/speculative/async_draft/planning/fallback_policy.py)")
    filler_padding: FillerPadding = option(
        FillerPadding.AUTO, "SSD random fillers past prompt lookup's copies: none, repeat (the pending token up "
        "to K), or auto (none on CPU, repeat on CUDA)", processes=(DRAFT,))
    saguaro_c: float = option(1.0, "Saguaro sampling constant in (0, 1] (C < 1 favours cached candidates)",
                              processes=(DRAFT,))
    interruptible_build: bool = option(
        True, "SSD: the draft stops building its speculation cache when the target's next request arrives or "
        "is due, each branch keeping the tokens drafted so far "
        "(ssd/speculative/async_draft/planning/build_clock.py); off: builds always reach K", processes=(DRAFT,),
        off_flags=("--full-builds",))
    draft_device: str | None = option(None, "the draft's device (default: the target's)", processes=(DRAFT,))
    draft_threads: int | None = option(None, "torch threads of the draft (default: its cores)", processes=(DRAFT,))
    draft_timeout_s: float = option(60.0, "SSD: a draft worker silent this long is given up (decoding goes "
                                          "on without speculation)")
    draft_url: str | None = option(
        None, "SSD: tcp://HOST:PORT of a draft server (`ssd draft-serve`) instead of a local draft process, or a "
        "comma list of several (sequences are spread over them); the servers choose the draft model and its device, "
        "so leave model, draft_device, draft_threads, draft_dtype and draft_weight_format unset "
        "(ssd/speculative/async_draft/remote/, draft_pool.py)")
    draft_rejoin_s: float = option(10.0, "SSD with draft_url: seconds before a draft server that failed is tried "
                                         "again, in the background (0: never)")
    draft_token: str | None = option(
        None, "SSD with draft_url: the token shared with the draft server (default: the SSD_DRAFT_TOKEN "
        "environment variable, which keeps it off the command line)")

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
        self.method = SpecMethod.parse(self.method, "speculative method")
        if self.method is SpecMethod.NGRAM:
            if self.model:
                raise ValueError("method 'ngram' drafts with prompt lookup alone; leave 'model' unset")
            if not self.prompt_lookup:
                raise ValueError("method 'ngram' drafts with prompt lookup only; it needs prompt_lookup=True")
        elif self.draft_url is not None:
            self._check_remote()
        elif not self.model:
            raise ValueError("speculative_config needs 'model': the path of the draft checkpoint")
        if self.method is SpecMethod.EAGLE3:
            self.draft_weight_format = WeightFormat.parse(self.draft_weight_format, "draft_weight_format")
            if self.draft_weight_format is WeightFormat.GGUF:
                raise ValueError("an EAGLE-3 head has no GGUF blocks; draft_weight_format 'gguf' does not apply")
        K = self.num_speculative_tokens
        if not is_int(K) or K < 1:
            raise ValueError(f"num_speculative_tokens must be an integer >= 1, got {K!r}")
        self.adaptive_lookahead = AdaptiveMode.parse(self.adaptive_lookahead)
        _check_bool(self, "prompt_step_speculation", "prompt_lookup", "interruptible_build")
        self.fan_out = FanOutChoice.parse(self.fan_out)
        if self.fan_out_miss is not None:
            self.fan_out_miss = FanOutChoice.parse(self.fan_out_miss)
        for fan_out in self.fan_outs:
            if not fan_out.adjustable:
                fan_out.per_k(K)  # a list's length must be K + 1
        if self.fan_out_budget is not None:
            if not is_int(self.fan_out_budget) or self.fan_out_budget < 1:
                raise ValueError(f"fan_out_budget must be an integer >= 1 (branches per sequence), got "
                                 f"{self.fan_out_budget!r}")
            if not any(f.adjustable for f in self.fan_outs):
                raise ValueError("fan_out_budget only applies to a fan_out or fan_out_miss of 'auto' or 'dynamic'")
        _ = self.lookup  # validates prompt_lookup_min / prompt_lookup_max
        self.fallback = Fallback.parse(self.fallback, "fallback")
        self.filler_padding = FillerPadding.parse(self.filler_padding, "filler_padding")
        if isinstance(self.saguaro_c, bool) or not isinstance(self.saguaro_c, (int, float)) \
                or not 0.0 < self.saguaro_c <= 1.0:
            raise ValueError(f"saguaro_c must be in (0, 1], got {self.saguaro_c!r}")
        if not self.draft_timeout_s > 0:
            raise ValueError(f"draft_timeout_s must be positive, got {self.draft_timeout_s!r}")
        if self.draft_threads is not None and (not is_int(self.draft_threads) or self.draft_threads < 1):
            raise ValueError(f"draft_threads must be a positive integer, got {self.draft_threads!r}")
        if self.draft_dtype is not None:
            self.draft_dtype = Dtype.parse(self.draft_dtype, "draft_dtype")
        self.draft_weight_format = WeightFormat.parse(self.draft_weight_format, "draft_weight_format")

    def _check_remote(self) -> None:
        if self.method is not SpecMethod.SSD:
            raise ValueError(f"draft_url is a remote SSD draft; it needs method 'ssd', not {self.method.value!r}")
        for url in self.draft_urls:
            parse_draft_url(url)
        if isinstance(self.draft_rejoin_s, bool) or not isinstance(self.draft_rejoin_s, (int, float)) \
                or self.draft_rejoin_s < 0:
            raise ValueError(f"draft_rejoin_s must be a number >= 0, got {self.draft_rejoin_s!r}")
        owned = [name for name in ("model", "draft_device", "draft_threads", "draft_dtype")
                 if getattr(self, name) is not None]
        if WeightFormat.parse(self.draft_weight_format, "draft_weight_format") is not WeightFormat.AUTO:
            owned.append("draft_weight_format")
        if owned:
            raise ValueError(f"with draft_url the draft server chooses {', '.join(owned)} (ssd draft-serve's "
                             "flags); leave them unset here")

    @property
    def draft_urls(self) -> list[str]:
        """The draft servers of ``draft_url`` (none: a local draft)."""
        return [] if self.draft_url is None else [u.strip() for u in str(self.draft_url).split(",") if u.strip()]

    @property
    def remote(self) -> bool:
        """The draft runs on a draft server, not in a local process."""
        return self.draft_url is not None

    @property
    def lookup(self) -> LookupConfig:
        return LookupConfig(bool(self.prompt_lookup), self.prompt_lookup_min, self.prompt_lookup_max)

    @property
    def fan_outs(self) -> tuple[FanOutChoice, FanOutChoice]:
        """The fan-outs of cache builds after a hit and after a miss."""
        return self.fan_out, self.fan_out_miss or self.fan_out


@dataclass
class EngineConfig:
    """Everything the engine needs to start; validated eagerly so mistakes surface before any model loads."""

    model: str = option(help="target checkpoint folder (command line default: the fetched SmolLM2-135M)",
                        processes=(RANK, DRAFT))  # an SSD draft worker's EAGLE-3 head reads its embedding
    tokenizer: str | None = option(None, "tokenizer folder (default: the model's)",
                                   processes=(DRAFT,))  # an SSD worker compiles output constraints against it
    dtype: Dtype = option(Dtype.AUTO, "auto: float32 with packed float16 weights on CPUs with FBGEMM (else "
                                      "bfloat16 where the CPU computes it natively, else float32); bfloat16 on "
                                      "CUDA GPUs that support it, else float16 (ssd/dtypes.py)", processes=(RANK,))
    weight_format: WeightFormat = option(
        WeightFormat.AUTO, "fp16-packed: float16 weights in FBGEMM's packed GEMM (CPU, float32); w8a8: int8 "
        "weights times per-row int8 activations with row-invariant attention (CPU, float32; a quantized model, "
        "exact in every mode); q8_0 / q4_0 / q4_1: GGUF's blocks of 32 int8 / 4-bit weights (q4_1: with a minimum) "
        "times int8 activations in blocks of 32 (C++ kernel, compiled on first use; CPU, float32; quantized like "
        "w8a8); gguf: the blocks a GGUF import kept (convert_gguf keep_blocks), the only format of such a "
        "checkpoint; auto: gguf for such a checkpoint, else fp16-packed where dtype auto chose float32 (an "
        "explicit float32 keeps float32 weights), else dense "
        "(ssd/models/weight_formats.py)", processes=(RANK,), choices=[f.value for f in TARGET_WEIGHT_FORMATS])
    device: str = option("cpu", "the target's device (cpu, cuda, cuda:1, ...)")
    max_model_len: int | None = option(None, "longest sequence (default: the model's max_position_embeddings, "
                                             "capped at 4096)", processes=(RANK,))
    block_size: int = option(16, "KV cache block size in tokens", processes=(RANK, DRAFT))
    kv_cache_memory: int | str | None = option(None, "KV cache bytes per target rank, e.g. 1GiB (default: "
                                                     "kv_cache_fraction of free memory)", processes=(RANK,), parse=str)
    kv_cache_fraction: float = option(0.25, "share of available device memory for the KV cache when "
                                            "kv_cache_memory is unset", processes=(RANK,))
    max_num_seqs: int = option(16, "most sequences in one step", processes=(RANK,))
    max_num_batched_tokens: int = option(2048, "most tokens in one step")
    enable_prefix_caching: bool = option(True, "reuse cached KV blocks of identical prompt prefixes",
                                         processes=(DRAFT,), flags=("--prefix-caching",))
    enable_chunked_prefill: bool = option(True, "split long prompts across steps", flags=("--chunked-prefill",))
    seed: int = option(0, "seed of the engine's default generator (and the draft worker's)", processes=(DRAFT,))
    num_threads: int | None = option(None, "torch intra-op threads per target rank (CPU)", flags=("--threads",))
    tensor_parallel_size: int = option(1, "target ranks; ranks 1.. are spawned on this host, or started by "
                                          "torchrun (see README)", flags=("--tensor-parallel-size", "-tp"))
    distributed_timeout_s: float = option(300.0, "a collective stuck this long means a rank is gone")
    enforce_eager: bool = option(False, "CUDA: never capture CUDA graphs (no effect on CPU)")
    compile_model: bool = option(False, "CUDA: torch.compile the forward of graph-captured steps")
    fused_kernels: bool = option(True, "fused norm, RoPE + K/V write and SiLU kernels (and attention on CUDA): "
                                 "Triton on CUDA, C++ for float32 on CPU", processes=(RANK, DRAFT))
    speculative_config: SpeculativeConfig | dict[str, Any] | None = field(default=None)

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be the path of a checkpoint folder, got {self.model!r}")
        self.dtype = Dtype.parse(self.dtype, "dtype")
        if self.weight_format not in TARGET_WEIGHT_FORMATS:
            raise ValueError(f"weight format {self.weight_format!r} is not supported for a target; choose one of "
                             f"{[f.value for f in TARGET_WEIGHT_FORMATS]}")
        self.weight_format = WeightFormat(self.weight_format)
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_model_len is not None and (not is_int(self.max_model_len) or self.max_model_len < 2):
            raise ValueError(f"max_model_len must be an integer >= 2, got {self.max_model_len!r}")
        if not 0.0 < self.kv_cache_fraction <= 0.95:
            raise ValueError(f"kv_cache_fraction must be in (0, 0.95], got {self.kv_cache_fraction!r}")
        if self.kv_cache_memory is not None:
            self.kv_cache_memory = parse_bytes(self.kv_cache_memory)
        if self.num_threads is not None and (not is_int(self.num_threads) or self.num_threads < 1):
            raise ValueError(f"num_threads must be a positive integer, got {self.num_threads!r}")
        if not is_int(self.tensor_parallel_size) or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be a positive integer, got {self.tensor_parallel_size!r}")
        if not self.distributed_timeout_s > 0:
            raise ValueError(f"distributed_timeout_s must be positive, got {self.distributed_timeout_s!r}")
        _check_bool(self, "enable_prefix_caching", "enable_chunked_prefill", "enforce_eager", "compile_model",
                    "fused_kernels")
        self.speculative_config = SpeculativeConfig.from_any(self.speculative_config)

    @property
    def spec(self) -> SpeculativeConfig | None:
        """The speculative options (None: plain autoregressive decoding)."""
        return self.speculative_config  # type: ignore[return-value]  # made a SpeculativeConfig by __post_init__


def _check_bool(config: object, *names: str) -> None:
    for name in names:
        value = getattr(config, name)
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be True or False, got {value!r}")


