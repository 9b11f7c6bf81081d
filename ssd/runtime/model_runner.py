"""Owns one model and its paged KV cache; turns per-sequence work items into one forward pass.

Target and draft each have a runner (with their own block pools). The runner knows nothing about
scheduling or sampling: it receives :class:`ForwardItem`s (which tokens, at which positions, into which
blocks, with which mask) and returns logits for the rows the caller asked for.

Under tensor parallelism every rank has a runner over its shard. The driver's runner broadcasts each
step's items before running its own shard, so the whole group runs the same pass; worker ranks call the
same :meth:`ModelRunner.forward` from their loop and get ``None`` back (the driver alone gets logits).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ssd.distributed.commands import ForwardCommand
from ssd.dtypes import resolve_dtype, torch_dtype
from ssd.models.arch import ModelArchConfig
from ssd.models.attention import KVCache
from ssd.models.attention_layout import build_step_tensors
from ssd.models.decoder import fused_kernels_for
from ssd.models.draft_vocab import DraftVocab
from ssd.models.loader import load_model
from ssd.models.row_attention import available as row_attention_available
from ssd.models.weight_formats import pack_weights
from ssd.options import ACTIVATION_QUANTIZED_FORMATS, PACKED_WEIGHT_FORMATS, WeightFormat
from ssd.runtime.cuda_graphs import GraphRunner, GraphRunnerConfig
from ssd.runtime.forward_items import FlatStep, ForwardItem, flatten_items
from ssd.runtime.memory import available_memory_bytes

if TYPE_CHECKING:
    from ssd.distributed.comm import TensorParallelGroup

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GraphOptions:
    """CUDA-graph settings of a runner (ignored off CUDA). ``max_query_len`` is the largest number of new
    tokens per sequence a captured step takes: 1 for plain decoding, K + 1 for verification, the branch count
    for SSD tree steps. ``max_kv_len`` bounds the slots a sequence reads (default: ``max_model_len``)."""

    max_query_len: int = 1
    max_kv_len: int | None = None
    compile: bool = False
    capture: bool = True  # False: run the same padded static forward eagerly, on any device (tests use it on CPU)


class ModelRunner:
    def __init__(
        self,
        model_path: str,
        dtype: str,
        device: str | torch.device,
        block_size: int,
        max_model_len: int | None,
        kv_cache_memory: int | None,
        kv_cache_fraction: float,
        num_blocks: int | None = None,
        max_num_seqs: int = 16,
        tp: "TensorParallelGroup | None" = None,
        graphs: GraphOptions | None = None,
        weight_format: WeightFormat = WeightFormat.DENSE,
        row_invariant_attention: bool | None = None,
        fused_kernels: bool = True,
    ) -> None:
        if row_invariant_attention is None:
            # a model with per-row quantized activations must see a token the same in every kind of step (a
            # target's exactness; a draft takes it too: the row-invariant kernel is its fastest attention, and
            # what lets its layers run as one C++ call, ssd/models/layer_stack.py)
            row_invariant_attention = weight_format in ACTIVATION_QUANTIZED_FORMATS
        if row_invariant_attention and not row_attention_available():  # before paying for the weights
            raise ValueError(f"{model_path}: row-invariant attention (which a target with quantized activations "
                             "needs) requires its kernel, which could not be compiled here (see the warning above: "
                             "a C++ compiler and ninja are needed)")
        self.device = torch.device(device)
        self.dtype = torch_dtype(resolve_dtype(dtype, str(self.device)))
        self.block_size = block_size
        self.tp = tp
        start = time.perf_counter()
        self.model, self.arch = load_model(model_path, dtype=self.dtype, device=self.device, tp=tp)
        self.model.eval()
        self.weight_format = weight_format
        self.row_invariant_attention = row_invariant_attention
        if weight_format in PACKED_WEIGHT_FORMATS:
            count = pack_weights(self.model, weight_format)
            logger.info("packed %d weight matrices (%s)", count, weight_format)
        elif weight_format != WeightFormat.DENSE:
            raise ValueError(f"weight_format must be 'dense' or one of {[f.value for f in PACKED_WEIGHT_FORMATS]} "
                             f"here, got {weight_format!r}")
        compiled = graphs is not None and graphs.compile  # torch.compile fuses the PyTorch ops by itself
        use_kernels = fused_kernels and not compiled
        kernels = fused_kernels_for(self.device, self.dtype, self.model.head_dim) if use_kernels else None
        if kernels is not None:  # after packing: a CPU model's layer stack holds the packed products
            self.model.enable_fused_kernels(kernels=kernels)
            stack = " (all layers in one call)" if self.model.layer_stack is not None else ""
            logger.info("fused kernels (%s) on for %s%s", kernels.__name__, model_path, stack)
        self.draft_vocab = DraftVocab.load(model_path)
        self._input_map = None  # target id -> model id, for drafts with a reduced vocabulary
        if self.draft_vocab is not None:
            if self.draft_vocab.size != self.arch.vocab_size:
                raise ValueError(
                    f"{model_path}: draft_vocab.json lists {self.draft_vocab.size} ids but the model has "
                    f"vocab_size={self.arch.vocab_size}"
                )
            self._input_map = torch.from_numpy(self.draft_vocab.target_to_draft()).to(self.device)
        logger.info("loaded %s (%s) in %.2f s", model_path, self.arch.architecture, time.perf_counter() - start)
        limit = self.arch.max_position_embeddings or 4096
        self.max_model_len = min(limit, 4096) if max_model_len is None else max_model_len
        if self.max_model_len > limit:
            raise ValueError(
                f"max_model_len={self.max_model_len} exceeds the model's max_position_embeddings={limit}"
            )
        if num_blocks is None and (tp is None or tp.is_driver):
            num_blocks = self._plan_num_blocks(kv_cache_memory, kv_cache_fraction, max_num_seqs)
        if tp is not None:
            num_blocks = tp.broadcast_object(num_blocks)  # every rank's cache mirrors the driver's block pool
        self.num_blocks = num_blocks
        use_graphs = graphs is not None and (self.device.type == "cuda" or not graphs.capture)
        if use_graphs and tp is not None:
            logger.warning("CUDA graphs are not used with tensor parallelism yet; running eagerly")
            use_graphs = False
        # With graphs, one extra block beyond the block pool takes the K/V writes of padding rows.
        self.kv_caches = self._allocate_kv_cache(self.num_blocks + (1 if use_graphs else 0))
        self.graph_runner = self._graph_runner(graphs, max_num_seqs) if use_graphs else None

    @property
    def vocab_size(self) -> int:
        """Token ids this model accepts as input (the target's vocabulary for a reduced-vocabulary draft)."""
        return self.draft_vocab.target_vocab_size if self.draft_vocab is not None else self.arch.vocab_size

    def bytes_per_block(self) -> int:
        """KV bytes of one block on this rank (its KV heads only)."""
        arch: ModelArchConfig = self.arch
        element = torch.empty((), dtype=self.dtype).element_size()
        return 2 * arch.num_hidden_layers * self.block_size * self.model.num_kv_heads * arch.head_dim * element

    def _plan_num_blocks(self, kv_cache_memory: int | None, fraction: float, max_num_seqs: int) -> int:
        needed = -(-self.max_model_len // self.block_size)
        if kv_cache_memory is None:
            # A share of free memory, but never more than max_num_seqs full-length sequences can use.
            budget = int(available_memory_bytes(self.device) * fraction)
            budget = min(budget, max_num_seqs * needed * self.bytes_per_block())
        else:
            budget = kv_cache_memory
        num_blocks = budget // self.bytes_per_block()
        if num_blocks < needed:
            raise ValueError(
                f"KV cache budget of {budget / 2**20:.1f} MiB holds {num_blocks} blocks of {self.block_size} tokens, "
                f"but one sequence of max_model_len={self.max_model_len} tokens needs {needed}; raise kv_cache_memory "
                f"(about {needed * self.bytes_per_block() / 2**20:.1f} MiB needed) or lower max_model_len"
            )
        return int(num_blocks)

    def _allocate_kv_cache(self, num_blocks: int) -> list[KVCache]:
        return self.model.allocate_kv_caches(num_blocks, self.block_size, self.dtype, self.device)

    def _graph_runner(self, graphs: GraphOptions, max_num_seqs: int) -> GraphRunner:
        config = GraphRunnerConfig(
            max_batch_size=max_num_seqs,
            max_query_len=graphs.max_query_len,
            max_kv_len=graphs.max_kv_len or self.max_model_len,
            compile=graphs.compile,
            capture=graphs.capture,
        )
        input_map = None if self.draft_vocab is None else self.draft_vocab.target_to_draft()
        return GraphRunner(self.model, self.kv_caches, self.num_blocks * self.block_size, config, input_map)

    @torch.inference_mode()
    def forward(self, items: list[ForwardItem], eager: bool = False) -> torch.Tensor | None:
        """Run one forward pass; returns float32 logits ``[sum(num_logits), V]`` in item order (``None`` on
        tensor-parallel worker ranks). ``eager``: never through a captured graph."""
        return self._on_every_rank(items, lambda: self._forward(items, eager), eager)

    def _on_every_rank(self, items: list[ForwardItem], run: Callable[[], Any], eager: bool = False) -> Any:
        """``run()`` here, the tensor-parallel driver first telling the other ranks to run the same pass."""
        if self.tp is None or not self.tp.is_driver:
            return run()
        self.tp.check_health()
        try:
            self.tp.broadcast_object(ForwardCommand(items, eager))
            return run()
        except RuntimeError as err:  # gloo/NCCL errors are RuntimeErrors; name the dead rank if there is one
            raise self.tp.failure_error(err) from err

    def _forward(self, items: list[ForwardItem], eager: bool = False) -> torch.Tensor | None:
        flat = flatten_items(items, self.block_size)
        if self.graph_runner is not None and not eager:
            logits = self.graph_runner.run(flat.token_ids, flat.positions, flat.layouts, flat.logit_rows)
            if logits is not None:  # None: no bucket fits
                return logits  # [N, V] float32
        return self._eager(flat, ())[0]

    @torch.inference_mode()
    def forward_with_features(
        self, items: list[ForwardItem], layers: Sequence[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`forward`, plus the hidden states entering the target's ``layers`` for every token of the step,
        items in order: ``(logits [N, V], features [T, len(layers) * hidden])``, from the same pass (what an
        EAGLE-3 head reads; :meth:`ssd.models.decoder.DecoderLM.forward_features`). Eager; under tensor
        parallelism the driver's (the residual stream is whole on every rank) while the others run the same
        pass."""
        if self.tp is not None and not self.tp.is_driver:
            raise ValueError("the target's features are taken on the tensor-parallel driver")
        flat = flatten_items(items, self.block_size)
        return self._on_every_rank(items, lambda: self._eager(flat, layers), eager=True)

    def _eager(self, flat: FlatStep, layers: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
        step = build_step_tensors(flat.token_ids, flat.positions, flat.layouts, flat.logit_rows, self.device)
        step.meta.row_invariant = self.row_invariant_attention
        input_ids = step.input_ids if self._input_map is None else self._input_map[step.input_ids]  # [T] model ids
        hidden, features = self.model.forward_features(input_ids, step.positions, step.meta, self.kv_caches, layers)
        selected = hidden if flat.all_rows else hidden[step.logit_rows]  # [N, H]
        return self.model.compute_logits(selected), features  # [N, V] float32, [T, n * H] or None
