"""Assemble the SSD proposer: size the draft's KV cache, start the worker on the cores the engine's process
layout reserved for it."""

from __future__ import annotations

import logging

from ssd.config import EngineConfig
from ssd.models.eagle3 import is_eagle3_head
from ssd.models.loader import load_arch_config
from ssd.runtime.model_runner import GraphOptions
from ssd.speculative.async_draft.client import SSDProposer
from ssd.speculative.async_draft.draft_pool import DraftServerPool
from ssd.speculative.async_draft.link import RemoteDraftLink
from ssd.speculative.async_draft.remote.channel import token_bytes
from ssd.speculative.async_draft.remote.session import SessionSettings
from ssd.speculative.async_draft.planning.fanout import max_fan_out_budget
from ssd.speculative.async_draft.worker import WorkerConfig
from ssd.speculative.draft_fit import check_draft_vocabulary, draft_num_blocks, vocabulary_digest
from ssd.speculative.head_runner import head_feature_layers
from ssd.speculative.proposal import TargetFacts
from ssd.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


def build_ssd_proposer(
    config: EngineConfig, target: TargetFacts, tokenizer: Tokenizer, draft_cpus: list[int] | None
) -> SSDProposer | DraftServerPool:
    spec = config.spec
    if spec.remote:
        return _remote_proposer(config, target, tokenizer)
    K = spec.num_speculative_tokens
    feature_layers = None
    if is_eagle3_head(spec.model):  # the draft is an EAGLE-3 head: the target sends it its features
        feature_layers = head_feature_layers(spec, load_arch_config(config.model))
        usable = target.vocab_size  # the head's draft vocabulary (d2t) says which ids it proposes
    else:
        usable = check_draft_vocabulary(tokenizer, target, spec.model)
    device = spec.draft_device or config.device
    worker = _worker_config(config, target, device, usable, draft_cpus)  # validates before the process starts
    logger.info("starting SSD draft worker (device %s, cpus %s, K=%d)", device, draft_cpus, K)
    # The prompt's step runs without drafts: build during it (not with a head, which needs the prompt's features).
    first_round = not spec.prompt_step_speculation and feature_layers is None
    return SSDProposer(worker, spec.fallback, spec.draft_timeout_s, build_first_round=first_round,
                       feature_layers=feature_layers)


def _worker_config(config: EngineConfig, target: TargetFacts, device: str, usable: int,
                   draft_cpus: list[int] | None) -> WorkerConfig:
    spec = config.spec
    K = spec.num_speculative_tokens
    budget = max(max_fan_out_budget(f, K, spec.fan_out_budget) for f in spec.fan_outs)
    # A tree step decodes `budget` branch tokens per sequence and reads up to K + 1 + K * budget scratch slots
    # beyond the sequence's own.
    scratch = K + 1 + K * budget
    return WorkerConfig(
        engine_config=config,
        device=device,
        max_model_len=target.max_model_len,
        num_blocks=draft_num_blocks(config, target, scratch),
        target_vocab_size=target.vocab_size,
        num_usable_tokens=usable,
        cpu_affinity=draft_cpus,
        log_level=logging.getLogger().level,
        graphs=None if config.enforce_eager else GraphOptions(
            max_query_len=max(K + 1, budget), max_kv_len=target.max_model_len + scratch, compile=config.compile_model,
        ),
    )


def _remote_proposer(config: EngineConfig, target: TargetFacts, tokenizer: Tokenizer) -> DraftServerPool:
    """SSD with its draft on draft servers: each session asks for the worker a local draft would get (the server
    checks the vocabulary against its model and picks the draft's device, dtype and format)."""
    spec = config.spec
    token = token_bytes(spec.draft_token)  # refused here, before any connection, when there is none
    worker = _worker_config(config, target, "remote", target.vocab_size, None)
    settings = SessionSettings.for_worker(worker, len(tokenizer), vocabulary_digest(tokenizer))
    first_round = not spec.prompt_step_speculation

    def connect(url: str, retry: bool) -> SSDProposer:
        logger.info("connecting to the SSD draft server at %s (K=%d)", url, spec.num_speculative_tokens)
        return SSDProposer(worker, spec.fallback, spec.draft_timeout_s, build_first_round=first_round,
                           open_link=lambda: RemoteDraftLink(url, token, settings, spec.draft_timeout_s),
                           quiet_start=retry)

    return DraftServerPool(spec.draft_urls, connect, spec.draft_rejoin_s, target.vocab_size)
