"""Build the proposer named by the speculative config, after checking the draft fits the target."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ssd.core.block_pool import BlockPool
from ssd.core.kv_cache_manager import KVCacheManager, cdiv
from ssd.executor.model_runner import GraphOptions, ModelRunner
from ssd.models.draft_vocab import DraftVocab
from ssd.models.loader import load_arch_config
from ssd.spec.drafting import DraftDistribution
from ssd.tokenizer import Tokenizer

if TYPE_CHECKING:
    from ssd.engine import LLMEngine

logger = logging.getLogger(__name__)


def check_vocabularies(target: Tokenizer, draft: Tokenizer, target_vocab: int, draft_vocab: int) -> int:
    """Return the number of token ids both sides can produce; raise if the vocabularies differ.

    Model vocabularies may be padded past the tokenizer (rows no token id reaches); any other difference
    would make draft token ids mean different text to the target.
    """
    if target.get_vocab() != draft.get_vocab():
        raise ValueError(
            f"draft and target tokenizers differ (target has {len(target)} tokens, draft {len(draft)}); "
            "speculative decoding needs the same vocabulary"
        )
    usable = len(target)
    if usable > target_vocab or usable > draft_vocab:
        raise ValueError(
            f"tokenizer has {usable} tokens but the target's embedding has {target_vocab} rows and the draft's "
            f"{draft_vocab}; both must cover every token id"
        )
    if target_vocab != draft_vocab:
        logger.info("target vocab %d and draft vocab %d differ only by padding rows", target_vocab, draft_vocab)
    return usable


def check_draft_vocabulary(engine: "LLMEngine", draft_path: str) -> int:
    """Token ids both models can produce, read from the draft folder's tokenizer and config only."""
    draft_vocab = DraftVocab.load(draft_path)
    size = draft_vocab.target_vocab_size if draft_vocab is not None else load_arch_config(draft_path).vocab_size
    return check_vocabularies(engine.tokenizer, Tokenizer(draft_path), engine.runner.vocab_size, size)


def draft_num_blocks(engine: "LLMEngine", extra_tokens_per_seq: int) -> int:
    """Enough draft blocks to never run out before the target does (own scratch per running sequence)."""
    cfg = engine.config
    return engine.runner.num_blocks + cfg.max_num_seqs * (cdiv(extra_tokens_per_seq, cfg.block_size) + 1)


def load_draft_runner(engine: "LLMEngine", extra_tokens_per_seq: int) -> tuple[ModelRunner, KVCacheManager, int]:
    spec = engine.spec
    cfg = engine.config
    usable = check_draft_vocabulary(engine, spec.model)  # before paying for loading the weights
    runner = ModelRunner(
        spec.model,
        spec.draft_dtype,
        spec.draft_device or cfg.device,
        cfg.block_size,
        engine.max_model_len,
        kv_cache_memory=None,
        kv_cache_fraction=cfg.kv_cache_fraction,
        num_blocks=draft_num_blocks(engine, extra_tokens_per_seq),
        max_num_seqs=cfg.max_num_seqs,
        graphs=None if cfg.enforce_eager else GraphOptions(max_query_len=extra_tokens_per_seq + 1, compile=cfg.compile_model),
        weight_format=spec.draft_weight_format,
        fused_kernels=cfg.fused_kernels,
    )
    manager = KVCacheManager(BlockPool(runner.num_blocks, cfg.block_size, cfg.enable_prefix_caching))
    return runner, manager, usable


def build_proposer(engine: "LLMEngine"):
    spec = engine.spec
    if spec.method == "draft_model":
        from ssd.spec.draft_proposer import DraftModelProposer

        runner, manager, usable = load_draft_runner(engine, spec.num_speculative_tokens)
        distribution = DraftDistribution.for_runner(runner, engine.runner.vocab_size, usable)
        return DraftModelProposer(runner, manager, distribution, engine.default_generator, spec.lookup)
    if spec.method == "ngram":
        from ssd.spec.ngram_proposer import NgramProposer

        return NgramProposer(engine.runner.vocab_size, spec.lookup)
    if spec.method == "ssd":
        from ssd.spec.ssd.factory import build_ssd_proposer

        return build_ssd_proposer(engine)
    raise ValueError(f"unknown speculative method {spec.method!r}")
