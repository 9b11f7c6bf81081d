"""A minimal paged-cache runner for model tests (the engine's real runner lives in ``ssd.runtime``).

It keeps a block table per sequence, hands out blocks in a shuffled (non-contiguous) order so that tests
exercise real slot mapping, and runs any mix of prefill chunks and decode tokens of several sequences as
one flat forward through ``build_attention_metadata`` + ``block_slots``.
"""

from __future__ import annotations

import random

import torch

from ssd.models.attention_layout import (
    SequenceLayout,
    block_slots,
    build_attention_metadata,
)
from ssd.models.decoder import DecoderLM

# One code stub and one chat request for the committed default models' checks (tests/test_default_*.py).
DEFAULT_MODEL_PROMPTS = (
    'def is_odd(n: int) -> bool:\n    """Return True if n is odd.\n    >>> is_odd(3)\n    True\n    """\n',
    "What is the largest planet in the solar system?",
)


class PagedSession:
    def __init__(self, model: DecoderLM, num_blocks: int = 64, block_size: int = 4, seed: int = 0,
                 row_invariant: bool = False) -> None:
        """``row_invariant``: steps ask for row-invariant attention (as a model with quantized activations runs)."""
        self.model = model
        self.row_invariant = row_invariant
        self.block_size = block_size
        self.caches = model.allocate_kv_caches(num_blocks, block_size)
        self.free_blocks = list(range(num_blocks))
        random.Random(seed).shuffle(self.free_blocks)
        self.block_tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}  # tokens already in the cache, per sequence

    def _reserve(self, seq_id: int, new_len: int) -> list[int]:
        table = self.block_tables.setdefault(seq_id, [])
        while len(table) * self.block_size < new_len:
            table.append(self.free_blocks.pop())
        return table

    @torch.no_grad()
    def step(self, batch: dict[int, list[int]], feature_layers: tuple[int, ...] = ()) -> dict[int, torch.Tensor]:
        """Append ``batch[seq_id]`` tokens to each sequence in one forward; returns float32 logits
        ``[len(tokens), V]`` per sequence (one row per new token). With ``feature_layers``, the step's features
        (``DecoderLM.forward_features``) are left in ``self.features``."""
        layouts, ids, positions, counts = [], [], [], []
        for seq_id, tokens in batch.items():
            start = self.lengths.get(seq_id, 0)
            end = start + len(tokens)
            table = self._reserve(seq_id, end)
            layouts.append(
                SequenceLayout(
                    write_slots=block_slots(table, self.block_size, start, end),
                    read_slots=block_slots(table, self.block_size, 0, end),
                )
            )
            ids.extend(tokens)
            positions.extend(range(start, end))
            counts.append(len(tokens))
            self.lengths[seq_id] = end
        device = self.model.device
        meta = build_attention_metadata(layouts, device=device)
        meta.row_invariant = self.row_invariant
        hidden, self.features = self.model.forward_features(
            torch.tensor(ids, dtype=torch.long, device=device),
            torch.tensor(positions, dtype=torch.long, device=device),
            meta,
            self.caches,
            feature_layers,
        )  # [T, hidden], [T, n * hidden] or None
        logits = self.model.compute_logits(hidden)  # [T, V]
        return dict(zip(batch, logits.split(counts)))


def greedy_generate(model: DecoderLM, prompt: list[int], max_new_tokens: int, block_size: int = 4) -> list[int]:
    """Plain autoregressive greedy decoding (no stop tokens); returns only the new tokens."""
    num_blocks = (len(prompt) + max_new_tokens) // block_size + 2
    session = PagedSession(model, num_blocks=num_blocks, block_size=block_size)
    logits = session.step({0: prompt})[0][-1]  # [V]
    out: list[int] = []
    for _ in range(max_new_tokens):
        token = int(logits.argmax())
        out.append(token)
        if len(out) < max_new_tokens:
            logits = session.step({0: [token]})[0][-1]  # [V]
    return out
