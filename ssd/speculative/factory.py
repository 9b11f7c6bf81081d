"""Build the proposer a configuration names, from the configuration and the facts of the loaded target."""

from __future__ import annotations

import torch

from ssd.config import EngineConfig
from ssd.core.block_pool import BlockPool
from ssd.core.kv_cache_manager import KVCacheManager
from ssd.options import SpecMethod
from ssd.runtime.model_runner import GraphOptions, ModelRunner
from ssd.speculative.draft_fit import check_draft_vocabulary, draft_num_blocks
from ssd.speculative.drafting import DraftDistribution
from ssd.speculative.proposal import Proposer, TargetFacts
from ssd.tokenizer import Tokenizer


def build_proposer(
    config: EngineConfig,
    target: TargetFacts,
    tokenizer: Tokenizer,
    default_generator: torch.Generator,
    draft_cpus: list[int] | None = None,
    target_runner: ModelRunner | None = None,
) -> Proposer:
    """The proposer of ``config.spec`` (a resolved config: ``ssd/resolve.py``) for ``target``, whose tokenizer
    a draft's must equal; ``default_generator`` draws for requests without a seed of their own; ``draft_cpus``:
    the cores the engine's process layout reserved for an SSD draft worker; ``target_runner``: the target's
    runner, whose configuration and input embedding an EAGLE-3 head reads."""
    spec = config.spec
    if spec is None:
        raise ValueError("the configuration asks for no speculation")
    if spec.method is SpecMethod.DRAFT_MODEL:
        from ssd.speculative.draft_proposer import DraftModelProposer

        usable = check_draft_vocabulary(tokenizer, target, spec.model)  # before paying for loading the weights
        runner = _draft_runner(config, target, spec.num_speculative_tokens)
        manager = KVCacheManager(BlockPool(runner.num_blocks, config.block_size, config.enable_prefix_caching))
        distribution = DraftDistribution.for_runner(runner, target.vocab_size, usable)
        return DraftModelProposer(runner, manager, distribution, default_generator, spec.lookup)
    if spec.method is SpecMethod.NGRAM:
        from ssd.speculative.ngram_proposer import NgramProposer

        return NgramProposer(target.vocab_size, spec.lookup)
    if spec.method is SpecMethod.EAGLE3:
        return _eagle3_proposer(config, target, default_generator, target_runner)
    if spec.method is SpecMethod.SSD:
        from ssd.speculative.async_draft.factory import build_ssd_proposer

        return build_ssd_proposer(config, target, tokenizer, draft_cpus)
    raise ValueError(f"unknown speculative method {spec.method!r}")


def _draft_runner(config: EngineConfig, target: TargetFacts, extra_tokens_per_seq: int) -> ModelRunner:
    spec = config.spec
    return ModelRunner(
        spec.model,
        spec.draft_dtype,
        spec.draft_device or config.device,
        config.block_size,
        target.max_model_len,
        kv_cache_memory=None,
        kv_cache_fraction=config.kv_cache_fraction,
        num_blocks=draft_num_blocks(config, target, extra_tokens_per_seq),
        max_num_seqs=config.max_num_seqs,
        graphs=None if config.enforce_eager else GraphOptions(max_query_len=extra_tokens_per_seq + 1,
                                                              compile=config.compile_model),
        weight_format=spec.draft_weight_format,
        fused_kernels=config.fused_kernels,
    )


def _eagle3_proposer(
    config: EngineConfig, target: TargetFacts, default_generator: torch.Generator, runner: ModelRunner | None
) -> Proposer:
    from ssd.dtypes import torch_dtype
    from ssd.models.loader import load_input_embedding
    from ssd.speculative.eagle3_proposer import Eagle3Proposer
    from ssd.speculative.head_runner import load_head

    spec = config.spec
    if runner is None:
        raise ValueError("method 'eagle3' runs the head beside the target's driver rank")
    device = torch.device(spec.draft_device or config.device)
    # Under tensor parallelism the driver holds a shard of the vocabulary: a head without its own embedding then
    # reads the target's whole embedding from the checkpoint.
    embedding = runner.model.embed_tokens.weight if runner.tp is None else load_input_embedding(
        config.model, torch_dtype(spec.draft_dtype))
    head, layers = load_head(spec, runner.arch, embedding, device)
    K = spec.num_speculative_tokens
    distribution = DraftDistribution(target.vocab_size, target.vocab_size, head.draft_to_target.to(device))
    return Eagle3Proposer(head, layers, draft_num_blocks(config, target, K), config.block_size, distribution,
                          default_generator, device, spec.lookup)
