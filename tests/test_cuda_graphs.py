"""GraphRunner: the padded static-buffer forward equals the reference forward (CPU, capture off), buckets,
fallbacks; and on CUDA, graph replay equals the same forward run eagerly.

On CPU the runner executes exactly the code a CUDA graph would capture (same padding, same buffers, same
dense attention), so these tests verify the bucketing and padding logic without a GPU. Logits are compared
at 1e-5 of their magnitude (padding changes reduction lengths by masked zero-weight keys, about one ulp) and
greedy tokens must be identical.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from ssd.models.attention_layout import SequenceLayout, block_slots, build_attention_metadata
from ssd.runtime.cuda_graphs import GraphRunner, GraphRunnerConfig
from ssd.runtime.forward_items import FlatStep, ForwardItem, flatten_items
from ssd.runtime.static_batch import BucketPolicy, BucketShape, pack_step
from ssd.models.loader import load_model

BLOCK = 4
NUM_BLOCKS = 48  # usable blocks; one more is allocated as the pad block
PAD_SLOT = NUM_BLOCKS * BLOCK
RTOL = 1e-5


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape and a.dtype == torch.float32
    err = (a - b).abs().max().item()
    assert err <= RTOL * max(1.0, b.abs().max().item()), err


class TwinSessions:
    """The same model over two identical caches: one stepped by the reference forward, one by a GraphRunner
    (falling back to the reference forward when no bucket fits, as ModelRunner does)."""

    def __init__(self, model, config: GraphRunnerConfig, input_map: np.ndarray | None = None) -> None:
        self.model = model
        self.ref_caches = model.allocate_kv_caches(NUM_BLOCKS + 1, BLOCK)
        self.graph_caches = model.allocate_kv_caches(NUM_BLOCKS + 1, BLOCK)
        self.input_map = input_map
        self.runner = GraphRunner(model, self.graph_caches, PAD_SLOT, config, input_map=input_map)
        free = list(range(NUM_BLOCKS))
        random.Random(0).shuffle(free)
        self.free = free
        self.tables: dict[int, list[int]] = {}
        self.fallbacks = 0

    def table(self, seq: int, num_tokens: int) -> list[int]:
        table = self.tables.setdefault(seq, [])
        while len(table) * BLOCK < num_tokens:
            table.append(self.free.pop())
        return table

    def _reference(self, caches, flat: FlatStep) -> torch.Tensor:
        device = self.model.device
        ids = np.asarray(flat.token_ids)
        model_ids = ids if self.input_map is None else self.input_map[ids]
        meta = build_attention_metadata(flat.layouts, device)
        hidden = self.model(torch.tensor(model_ids, dtype=torch.long, device=device),
                            torch.tensor(flat.positions, dtype=torch.long, device=device),
                            meta, caches)  # [T, hidden]
        rows = torch.tensor(flat.logit_rows, dtype=torch.long, device=device)
        return self.model.compute_logits(hidden[rows])  # [N, V]

    @torch.inference_mode()
    def step(self, items: list[ForwardItem]) -> tuple[torch.Tensor, torch.Tensor]:
        flat = flatten_items(items, BLOCK)
        ref = self._reference(self.ref_caches, flat)
        out = self.runner.run(flat.token_ids, flat.positions, flat.layouts, flat.logit_rows)
        if out is None:
            self.fallbacks += 1
            out = self._reference(self.graph_caches, flat)
        return ref, out

    def caches_match(self) -> None:
        """Every real slot holds the same K/V on both sides (the pad block is the runner's scratch)."""
        for ref, graph in zip(self.ref_caches, self.graph_caches):
            _close(graph.key[:NUM_BLOCKS], ref.key[:NUM_BLOCKS])
            _close(graph.value[:NUM_BLOCKS], ref.value[:NUM_BLOCKS])


def _append_step(s: TwinSessions, lengths: dict[int, int], new: dict[int, list[int]], num_logits: dict[int, int]):
    """Causal step appending ``new[seq]`` to each sequence; returns (ref, graph) logits."""
    items = []
    for seq, tokens in new.items():
        start = lengths[seq]
        lengths[seq] += len(tokens)
        items.append(ForwardItem(tokens, start, s.table(seq, lengths[seq]), num_logits[seq]))
    return s.step(items)


@pytest.fixture(scope="module")
def model(checkpoint_factory):
    m, _ = load_model(checkpoint_factory(), dtype=torch.float32, device="cpu")
    return m.eval()


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(3, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


CONFIG = GraphRunnerConfig(max_batch_size=4, max_query_len=8, max_kv_len=160, min_kv_len=16, capture=False)


def test_decode_and_verify_steps_equal_reference(model) -> None:
    s = TwinSessions(model, CONFIG)
    prompts = {0: _prompt(5, 1), 1: _prompt(12, 2), 2: _prompt(30, 3)}
    lengths = {seq: 0 for seq in prompts}
    ref, out = _append_step(s, lengths, prompts, {seq: 1 for seq in prompts})
    assert s.fallbacks == 1  # a 30-token prefill fits no query bucket: eager
    _close(out, ref)
    tokens = {seq: int(t) for seq, t in zip(prompts, ref.argmax(-1))}
    for _ in range(6):  # batch-3 decode, padded to the 4-sequence bucket, ragged context lengths
        ref, out = _append_step(s, lengths, {seq: [t] for seq, t in tokens.items()}, {seq: 1 for seq in tokens})
        _close(out, ref)
        assert out.argmax(-1).tolist() == ref.argmax(-1).tolist()
        tokens = {seq: int(t) for seq, t in zip(tokens, ref.argmax(-1))}
    assert s.runner.last_shape == BucketShape(4, 1, 64)
    # K+1 verification with K=4 for two sequences and a clamped K=2 for the third (query bucket 8).
    drafts = {0: [tokens[0]] + _prompt(4, 5), 1: [tokens[1]] + _prompt(4, 6), 2: [tokens[2]] + _prompt(2, 7)}
    ref, out = _append_step(s, lengths, drafts, {seq: len(d) for seq, d in drafts.items()})
    assert s.runner.last_shape == BucketShape(4, 8, 64)
    assert out.shape == (13, ref.shape[1])
    _close(out, ref)
    assert out.argmax(-1).tolist() == ref.argmax(-1).tolist()
    s.caches_match()
    assert s.fallbacks == 1


def test_tree_step_equals_reference(model) -> None:
    """SSD tree decoding: branch tokens in scratch slots after the glue region, explicit tree mask, RoPE at
    logical positions (the layout DraftEngine._tree_item builds)."""
    s = TwinSessions(model, CONFIG)
    lengths = {0: 0, 1: 0}
    K = 3
    _append_step(s, lengths, {0: _prompt(9, 11), 1: _prompt(14, 12)}, {0: 1, 1: 1})
    branches = {0: [0, 0, 1, 3], 1: [1, 2]}  # acceptance length k of each branch
    for depth in range(2):
        items = []
        for seq, ks in branches.items():
            n, m = lengths[seq], len(ks)
            glue_end = n + K
            table = s.table(seq, glue_end + 2 * m)
            ks_arr = np.array(ks)
            scratch = np.arange((depth + 1) * m)
            mask = np.zeros((m, glue_end + (depth + 1) * m), dtype=bool)
            mask[:, :glue_end] = np.arange(glue_end)[None, :] <= (n - 1 + ks_arr)[:, None]
            mask[:, glue_end:] = (scratch[None, :] % m) == np.arange(m)[:, None]
            read = np.concatenate([block_slots(table, BLOCK, 0, glue_end),
                                   block_slots(table, BLOCK, glue_end, glue_end + (depth + 1) * m)])
            write = block_slots(table, BLOCK, glue_end + depth * m, glue_end + (depth + 1) * m)
            items.append(ForwardItem(_prompt(m, 20 + seq + depth), n, table, num_logits=m, positions=n + ks_arr + depth,
                                     write_slots=write, read_slots=read, mask=mask))
        ref, out = s.step(items)
        assert s.runner.last_shape == BucketShape(2, 4, 32)
        _close(out, ref)
        assert out.argmax(-1).tolist() == ref.argmax(-1).tolist()
    s.caches_match()


def test_reduced_vocabulary_input_map(model) -> None:
    """A draft with a reduced vocabulary receives target ids; the runner maps them like ModelRunner does."""
    vocab = model.config.vocab_size
    input_map = np.random.default_rng(0).permutation(vocab).astype(np.int64)  # target id -> model id
    s = TwinSessions(model, CONFIG, input_map=input_map)
    lengths = {0: 0}
    _append_step(s, lengths, {0: _prompt(6, 30)}, {0: 1})
    ref, out = _append_step(s, lengths, {0: _prompt(3, 31)}, {0: 3})
    _close(out, ref)
    assert s.fallbacks == 0


def test_steps_outside_every_bucket_return_none(model) -> None:
    caches = model.allocate_kv_caches(NUM_BLOCKS + 1, BLOCK)
    runner = GraphRunner(model, caches, PAD_SLOT, CONFIG)
    one = lambda q, kv: SequenceLayout(np.arange(kv - q, kv), np.arange(kv))  # noqa: E731
    assert runner.run([1] * 9, np.arange(9), [one(9, 20)], [8]) is None  # 9 query rows > 8
    assert runner.run([1] * 5, np.zeros(5), [one(1, 4)] * 5, [0]) is None  # 5 sequences > 4
    assert runner.run([1], np.zeros(1), [one(1, 161)], [0]) is None  # 161 slots > 160
    assert runner.run([], np.zeros(0), [], []) is None
    assert not any(c.key.any() for c in caches)  # nothing was written


def test_padding_writes_only_the_pad_slot(model) -> None:
    caches = model.allocate_kv_caches(NUM_BLOCKS + 1, BLOCK)
    runner = GraphRunner(model, caches, PAD_SLOT, CONFIG)
    write = np.array([17, 42, 3])
    runner.run([5, 6, 7], np.arange(3), [SequenceLayout(write, write)], [2])  # bucket (1, 4, 16): 1 pad row
    written = {int(i) for i in torch.nonzero(caches[0].key.view(-1, caches[0].key[0, 0].numel()).any(-1))}
    assert written == {3, 17, 42, PAD_SLOT}


def test_bucket_policy() -> None:
    policy = BucketPolicy.default(max_batch_size=12, max_query_len=8, max_kv_len=1000, min_kv_len=64)
    assert policy.batch_sizes == (1, 2, 4, 8, 12)
    assert policy.query_lens == (1, 2, 4, 8)
    assert policy.kv_lens == (64, 128, 256, 512, 1008)  # rounded up to multiples of 16
    assert policy.select(3, 5, 65) == BucketShape(4, 8, 128)
    assert policy.select(1, 1, 1) == BucketShape(1, 1, 64)
    assert policy.select(13, 1, 1) is None and policy.select(1, 9, 1) is None and policy.select(1, 1, 1009) is None
    with pytest.raises(ValueError):
        BucketPolicy((1, 4, 2), (1,), (16,))


def test_pack_step_layout() -> None:
    layouts = [SequenceLayout(np.array([10, 11]), np.array([8, 9, 10, 11])),
               SequenceLayout(np.array([30]), np.array([30]))]
    packed = pack_step(BucketShape(2, 4, 16), [7, 8, 9], np.array([2, 3, 0]), layouts, [1, 2], pad_slot=99)
    assert packed.input_ids.tolist() == [7, 8, 0, 0, 9, 0, 0, 0]
    assert packed.positions.tolist() == [2, 3, 0, 0, 0, 0, 0, 0]
    assert packed.slot_mapping.tolist() == [10, 11, 99, 99, 30, 99, 99, 99]
    assert packed.logit_index.tolist() == [1, 4]
    assert packed.kv_slots[0, :5].tolist() == [8, 9, 10, 11, 99]
    assert packed.mask[0, 0, :, :5].tolist() == [[True, True, True, False, False], [True, True, True, True, False],
                                                [True, False, False, False, False], [True, False, False, False, False]]
    with pytest.raises(ValueError):
        pack_step(BucketShape(2, 4, 16), [7, 8], np.array([2, 3]), layouts, [1], pad_slot=99)


def test_capture_requires_cuda_device(model) -> None:
    caches = model.allocate_kv_caches(NUM_BLOCKS + 1, BLOCK)
    with pytest.raises(ValueError, match="CUDA"):
        GraphRunner(model, caches, PAD_SLOT, GraphRunnerConfig(capture=True))
    with pytest.raises(ValueError, match="pad_slot"):
        GraphRunner(model, caches, (NUM_BLOCKS + 1) * BLOCK, CONFIG)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph capture needs a GPU")
def test_cuda_graph_replay_equals_eager(checkpoint_factory) -> None:
    """Captured replays equal the reference forward over decode, verify and a new bucket mid-run."""
    gpu_model, _ = load_model(checkpoint_factory(), dtype=torch.float32, device="cuda")
    gpu_model.eval()
    config = GraphRunnerConfig(max_batch_size=4, max_query_len=8, max_kv_len=160, min_kv_len=16, capture=True)
    s = TwinSessions(gpu_model, config)
    lengths = {0: 0, 1: 0}
    _append_step(s, lengths, {0: _prompt(5, 1), 1: _prompt(7, 2)}, {0: 1, 1: 1})
    tokens = {0: 1, 1: 2}
    for step in range(4):
        ref, out = _append_step(s, lengths, {q: [t] for q, t in tokens.items()}, {0: 1, 1: 1})
        _close(out.cpu(), ref.cpu())
        tokens = {q: int(t) for q, t in zip(tokens, ref.argmax(-1).tolist())}
    ref, out = _append_step(s, lengths, {0: [tokens[0], 5, 6, 7], 1: [tokens[1], 8]}, {0: 4, 1: 2})
    _close(out.cpu(), ref.cpu())
    assert s.runner.num_graphs >= 2



@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_static_forward_never_synchronises(checkpoint_factory) -> None:
    """The per-layer path issues no host synchronisation (CUDA's sync debug mode raises on any)."""
    gpu_model, _ = load_model(checkpoint_factory(), dtype=torch.float32, device="cuda")
    caches = gpu_model.allocate_kv_caches(NUM_BLOCKS + 1, BLOCK)
    runner = GraphRunner(gpu_model.eval(), caches, PAD_SLOT, CONFIG)
    layouts = [SequenceLayout(np.arange(8, 13), np.arange(13)), SequenceLayout(np.arange(20, 21), np.arange(14, 21))]
    with torch.inference_mode():
        shape = runner.policy.select(2, 5, 13)
        views = runner.inputs.load(pack_step(shape, [3] * 6, np.arange(6), layouts, [4, 5], PAD_SLOT))
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            runner._forward(views)
        finally:
            torch.cuda.set_sync_debug_mode("default")


def test_model_runner_static_path_equals_eager(checkpoint_factory):
    """ModelRunner wired to a GraphRunner (static buffers, padded buckets, pad block beyond the pool; capture
    off so it runs on CPU) gives the eager runner's logits for prefill, decode and K+1 verification, and
    sends steps no bucket fits (long prefill) down the eager path."""
    from ssd.runtime.model_runner import GraphOptions, ModelRunner

    path = str(checkpoint_factory("qwen3", num_heads=4, num_kv_heads=2))
    kwargs = dict(block_size=4, max_model_len=64, kv_cache_memory=None, kv_cache_fraction=0.25, num_blocks=40,
                  max_num_seqs=4)
    eager = ModelRunner(path, "float32", "cpu", **kwargs)
    static = ModelRunner(path, "float32", "cpu", graphs=GraphOptions(max_query_len=5, capture=False), **kwargs)
    assert eager.graph_runner is None and static.graph_runner is not None
    assert len(static.kv_caches[0].key) == static.num_blocks + 1  # the pad block
    prompts = [[5, 9, 17, 33, 2, 8, 1, 40, 41, 42], [7, 3, 11]]
    tables = [list(range(0, 10)), list(range(10, 20))]
    steps = [
        [ForwardItem(p, 0, t, num_logits=1) for p, t in zip(prompts, tables)],  # prefill: eager fallback
        [ForwardItem([21], len(p), t) for p, t in zip(prompts, tables)],  # decode
        [ForwardItem([22, 23, 24, 25, 26], len(p) + 1, t, num_logits=5) for p, t in zip(prompts, tables)],  # verify
    ]
    used_static = []
    for items in steps:
        static.graph_runner.last_shape = None
        torch.testing.assert_close(static.forward(items), eager.forward(items), rtol=1e-5, atol=1e-5)
        used_static.append(static.graph_runner.last_shape is not None)
    assert used_static == [False, True, True]
