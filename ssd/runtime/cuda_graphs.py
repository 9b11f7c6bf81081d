"""CUDA graphs for small steps (decode, K+1 verification, SSD tree decode) over bucketed shapes.

At batch 1 a decoder step launches hundreds of small kernels; on a GPU their launch cost, not memory
bandwidth, would set the step time. :class:`GraphRunner` pads each step to a bucket (see
:mod:`ssd.runtime.static_batch`), captures the model's forward for that bucket once, and replays it.

The same static-buffer forward runs eagerly when ``capture`` is off, on any device: that is how tests on CPU
check the padding and bucketing against the reference forward, and it is the fallback where graphs are not
available. Graph capture itself (warm-up on a side stream, one memory pool shared by all buckets) only runs
on CUDA. Buckets are captured on first use, up to ``max_graphs``; a step no bucket fits returns None and the
caller runs its ordinary eager forward.

Every replay writes its logits into one shared output buffer; :meth:`GraphRunner.run` gathers the requested
rows from it right away, in stream order, so a later replay cannot overwrite them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ssd.models.attention import KVCache
from ssd.models.attention_layout import SequenceLayout
from ssd.runtime.static_batch import BucketPolicy, BucketShape, StaticInputs, StaticViews, pack_step, pad_step

logger = logging.getLogger(__name__)


@dataclass
class GraphRunnerConfig:
    """Bucket limits and switches. A step larger than the largest bucket runs eagerly."""

    max_batch_size: int = 16
    max_query_len: int = 16  # >= K+1 for verification, >= branches per sequence for SSD tree steps
    max_kv_len: int = 4096  # slots a sequence reads: max_model_len, plus tree scratch slots for an SSD draft
    min_kv_len: int = 64
    capture: bool = True  # False: run the static forward eagerly (CPU, tests, debugging)
    compile: bool = False  # torch.compile the model forward (static shapes) before capturing
    max_graphs: int = 96  # captured buckets kept; beyond this, steps of new buckets run eagerly


class GraphRunner:
    """Runs steps of ``model`` over ``kv_caches`` through per-bucket static buffers (and CUDA graphs).

    ``pad_slot`` is a cache slot that no sequence ever reads, e.g. slot 0 of one extra block allocated beyond
    the block pool: padding rows write their K/V there. ``input_map`` maps target token ids to model ids for a
    reduced-vocabulary draft (applied on the host).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[KVCache],
        pad_slot: int,
        config: GraphRunnerConfig | None = None,
        input_map: np.ndarray | None = None,
        policy: BucketPolicy | None = None,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.pad_slot = int(pad_slot)
        self.config = config or GraphRunnerConfig()
        self.input_map = input_map
        cfg = self.config
        self.policy = policy or BucketPolicy.default(
            cfg.max_batch_size, cfg.max_query_len, cfg.max_kv_len, cfg.min_kv_len
        )
        first = kv_caches[0].key
        num_slots = first.shape[0] * first.shape[1]
        if not 0 <= self.pad_slot < num_slots:
            raise ValueError(f"pad_slot {pad_slot} outside the cache's {num_slots} slots")
        self.device = first.device
        if cfg.capture and self.device.type != "cuda":
            raise ValueError(
                f"CUDA graph capture needs a CUDA device, the cache is on {self.device}; set capture=False"
            )
        self.inputs = StaticInputs(self.policy, self.device)
        largest = self.policy.largest.num_tokens
        vocab = self._vocab_size()
        self._logits = torch.zeros(largest, vocab, dtype=torch.float32, device=self.device)  # [B*Q max, V]
        self._forward_fn: Callable = torch.compile(model, dynamic=False) if cfg.compile else model
        self._graphs: dict[BucketShape, torch.cuda.CUDAGraph] = {}
        self._pool = torch.cuda.graph_pool_handle() if cfg.capture else None
        self.last_shape: BucketShape | None = None  # bucket of the last step run here (for tests and stats)

    def _vocab_size(self) -> int:
        weight = self.model.embed_tokens.weight if self.model.lm_head is None else self.model.lm_head.weight
        return int(getattr(self.model.config, "vocab_size", weight.shape[0]))

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    # ------------------------------------------------------------------------------------------ stepping
    @torch.inference_mode()
    def run(
        self,
        token_ids: Sequence[int] | np.ndarray,  # [T] flat batch (target ids when input_map is set)
        positions: np.ndarray,  # [T]
        layouts: list[SequenceLayout],
        logit_rows: Sequence[int] | np.ndarray,  # [N] rows of the flat batch to return logits for
    ) -> torch.Tensor | None:
        """Float32 logits ``[N, V]`` of the requested rows, or None when no bucket fits (run eagerly)."""
        if not layouts:
            return None
        shape = self.policy.select(
            len(layouts), max(len(s.write_slots) for s in layouts), max(len(s.read_slots) for s in layouts)
        )
        if shape is None:
            return None
        if self.config.capture and shape not in self._graphs:
            if len(self._graphs) >= self.config.max_graphs:
                return None
            self._capture(shape)
        ids = np.asarray(token_ids, dtype=np.int64)
        if self.input_map is not None:
            ids = self.input_map[ids]
        views = self.inputs.load(pack_step(shape, ids, positions, layouts, logit_rows, self.pad_slot))
        if self.config.capture:
            self._graphs[shape].replay()
        else:
            self._forward(views)
        self.last_shape = shape
        index = views.logit_index[: len(logit_rows)]  # [N]
        return self._logits.index_select(0, index)  # [N, V]

    def _forward(self, views: StaticViews) -> None:
        """The static forward: fixed shapes in, logits of every padded row into the shared output buffer."""
        hidden = self._forward_fn(views.input_ids, views.positions, views.meta, self.kv_caches)  # [B*Q, hidden]
        logits = self.model.compute_logits(hidden)  # [B*Q, V]; None on non-driver tensor-parallel ranks
        if logits is not None:
            self._logits[: views.shape.num_tokens].copy_(logits)

    # ------------------------------------------------------------------------------------------ capture
    @torch.inference_mode()
    def capture(self, shapes: Iterable[BucketShape]) -> None:
        """Capture these buckets now (largest first, so smaller ones reuse the shared pool's memory)."""
        for shape in sorted(set(shapes), key=lambda s: (s.num_tokens, s.kv_len), reverse=True):
            if shape not in self._graphs:
                self._capture(shape)

    def _capture(self, shape: BucketShape) -> None:
        """Warm up on a side stream (allocator, cuBLAS workspaces, compile), then capture one replay.

        The inputs are pure padding, so warm-up and capture write K/V only to the pad slot.
        """
        views = self.inputs.load(pad_step(shape, self.pad_slot))
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._forward(views)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self._forward(views)
        self._graphs[shape] = graph
        logger.info("captured CUDA graph for %s (%d graphs)", shape, len(self._graphs))
