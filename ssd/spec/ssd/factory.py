"""Assemble the SSD proposer: size the draft's KV cache, start the worker on the cores the engine's
process layout reserved for it."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ssd.executor.model_runner import GraphOptions
from ssd.spec.factory import check_draft_vocabulary, draft_num_blocks
from ssd.spec.ssd.client import SSDProposer
from ssd.spec.ssd.fallback_policy import resolve_filler_padding
from ssd.spec.ssd.fanout import max_fan_out_budget
from ssd.spec.ssd.worker import WorkerConfig

if TYPE_CHECKING:
    from ssd.engine import LLMEngine

logger = logging.getLogger(__name__)


def build_ssd_proposer(engine: "LLMEngine") -> SSDProposer:
    spec, cfg = engine.spec, engine.config
    K = spec.num_speculative_tokens
    # Validate everything the worker would reject before paying for a process start.
    budget = max(max_fan_out_budget(f, K, spec.fan_out_budget) for f in (spec.fan_out, spec.fan_out_miss or spec.fan_out))
    usable = check_draft_vocabulary(engine, spec.model)
    device = spec.draft_device or cfg.device
    draft_cpus = engine.layout.draft_cpus  # the engine placed its target ranks on the other cores
    config = WorkerConfig(
        model=spec.model,
        dtype=spec.draft_dtype,
        weight_format=spec.draft_weight_format,
        device=device,
        block_size=cfg.block_size,
        max_model_len=engine.max_model_len,
        num_blocks=draft_num_blocks(engine, K + 1 + K * budget),
        enable_prefix_caching=cfg.enable_prefix_caching,
        target_vocab_size=engine.runner.vocab_size,
        num_usable_tokens=usable,
        num_speculative_tokens=K,
        fan_out=spec.fan_out,
        fan_out_miss=spec.fan_out_miss,
        fan_out_budget=spec.fan_out_budget,
        saguaro_c=spec.saguaro_c,
        interruptible_build=spec.interruptible_build,
        lookup=spec.lookup,
        pad_filler=resolve_filler_padding(spec.filler_padding, cfg.device),
        seed=cfg.seed,
        num_threads=spec.draft_threads,
        cpu_affinity=draft_cpus,
        log_level=logging.getLogger().level,
        fused_kernels=cfg.fused_kernels,
        # A tree step decodes `budget` branch tokens per sequence and reads up to K + 1 + K * budget
        # scratch slots beyond the sequence's own.
        graphs=None if cfg.enforce_eager else GraphOptions(
            max_query_len=max(K + 1, budget), max_kv_len=engine.max_model_len + K + 1 + K * budget,
            compile=cfg.compile_model,
        ),
    )
    logger.info("starting SSD draft worker (device %s, cpus %s, K=%d)", device, draft_cpus, K)
    first_round = not spec.prompt_step_speculation  # the prompt's step runs without drafts: build during it
    return SSDProposer(config, spec.fallback, spec.draft_timeout_s, build_first_round=first_round)
