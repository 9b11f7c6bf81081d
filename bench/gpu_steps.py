"""Step drivers and timing helpers of ``bench/gpu_check.py``: models with random weights in the shapes the check
times, one model stepped over its own paged cache (reference forward or GraphRunner), the exactness scenario,
step inputs of one sequence, the copy bandwidth that sets the floor, step timing and a kernel profile.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ssd.models.attention_layout import SequenceLayout, block_slots, build_attention_metadata
from ssd.runtime.cuda_graphs import GraphRunner, GraphRunnerConfig
from ssd.runtime.forward_items import FlatStep, ForwardItem, flatten_items
from ssd.models.arch import ModelArchConfig
from ssd.models.decoder import DecoderLM


LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False)
LLAMA32_1B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                  num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True)
TINY_TARGET = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=512, tie_word_embeddings=False)
TINY_DRAFT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True)
BLOCK = 16


class Driver:
    """One model over its own paged cache (plus a pad block), stepped by the reference forward or a GraphRunner."""

    def __init__(self, model: DecoderLM, num_blocks: int, graphs: GraphRunnerConfig | None = None,
                 row_invariant: bool = False) -> None:
        """``row_invariant``: the reference forward's attention runs row by row (as a w8a8 target's does)."""
        self.model = model
        self.row_invariant = row_invariant
        self.caches = model.allocate_kv_caches(num_blocks + 1, BLOCK)
        self.runner = None if graphs is None else GraphRunner(model, self.caches, num_blocks * BLOCK, graphs)
        self.fallbacks = 0

    @torch.inference_mode()
    def step(self, flat: FlatStep) -> torch.Tensor:
        """Float32 logits ``[N, V]`` on the model's device (like ModelRunner.forward)."""
        if self.runner is not None:
            out = self.runner.run(flat.token_ids, flat.positions, flat.layouts, flat.logit_rows)
            if out is not None:
                return out
            self.fallbacks += 1
        device = self.model.device
        meta = build_attention_metadata(flat.layouts, device)
        meta.row_invariant = self.row_invariant
        hidden = self.model(torch.tensor(flat.token_ids, dtype=torch.long, device=device),
                            torch.tensor(flat.positions, dtype=torch.long, device=device), meta, self.caches)
        rows = torch.tensor(flat.logit_rows, dtype=torch.long, device=device)
        return self.model.compute_logits(hidden[rows])  # [N, V]


def sequence_logits(model: DecoderLM, tokens: list[int], chunks: list[int], row_invariant: bool = False):
    """Float32 logits ``[len(tokens), V]`` of one sequence fed to a fresh cache in steps of ``chunks`` tokens."""
    driver = Driver(model, num_blocks=-(-len(tokens) // BLOCK) + 1, row_invariant=row_invariant)
    out, pos = [], 0
    for n in chunks:
        slots = np.arange(pos, pos + n)
        step = FlatStep(tokens[pos : pos + n], slots, [SequenceLayout(slots, np.arange(pos + n), None)], list(range(n)))
        out.append(driver.step(step))
        pos += n
    return torch.cat(out)


def scenario(vocab: int, seed: int = 0) -> Callable[[torch.Tensor | None], FlatStep | None]:
    """Prefill of 3 prompts, 6 batched decode steps, a K+1 = 8 verify step, then an SSD tree step, over
    shuffled blocks. Decode tokens come from the reference's greedy argmax so every driver sees the same inputs.
    Returns a generator-like callable: feed it the reference logits of the previous step."""
    rng = np.random.default_rng(seed)
    blocks = rng.permutation(64).tolist()
    tables: dict[int, list[int]] = {0: [], 1: [], 2: []}
    lengths = {0: 0, 1: 0, 2: 0}
    prompts = {0: rng.integers(3, vocab, 5).tolist(), 1: rng.integers(3, vocab, 13).tolist(),
               2: rng.integers(3, vocab, 40).tolist()}
    state = {"i": 0}

    def table(seq: int, n: int) -> list[int]:
        while len(tables[seq]) * BLOCK < n:
            tables[seq].append(blocks.pop())
        return tables[seq]

    def causal(new: dict[int, list[int]], num_logits: dict[int, int]) -> FlatStep:
        items = []
        for seq, toks in new.items():
            start = lengths[seq]
            lengths[seq] += len(toks)
            items.append(ForwardItem(toks, start, table(seq, lengths[seq]), num_logits[seq]))
        return flatten_items(items, BLOCK)

    def tree(m: int, k: int) -> FlatStep:
        """One depth-0 tree step of sequence 0: m branches after a glue of k drafts (DraftEngine's layout)."""
        n = lengths[0]
        glue_end = n + k
        t = table(0, glue_end + m)
        ks = np.arange(m) % (k + 1)
        mask = np.zeros((m, glue_end + m), dtype=bool)
        mask[:, :glue_end] = np.arange(glue_end)[None, :] <= (n - 1 + ks)[:, None]
        mask[:, glue_end:] = np.eye(m, dtype=bool)
        item = ForwardItem(rng.integers(3, vocab, m).tolist(), n, t, num_logits=m, positions=n + ks,
                           write_slots=block_slots(t, BLOCK, glue_end, glue_end + m),
                           read_slots=block_slots(t, BLOCK, 0, glue_end + m), mask=mask)
        return flatten_items([item], BLOCK)

    def next_step(prev: torch.Tensor | None) -> FlatStep | None:
        i = state["i"]
        state["i"] += 1
        if i == 0:
            return causal(prompts, {0: 1, 1: 1, 2: 1})
        greedy = prev.argmax(-1).tolist() if prev is not None else []
        if 1 <= i <= 6:
            last = greedy[-3:]
            return causal({seq: [last[seq]] for seq in range(3)}, {0: 1, 1: 1, 2: 1})
        if i == 7:
            last = greedy[-3:]
            new = {seq: [last[seq]] + rng.integers(3, vocab, 7).tolist() for seq in range(3)}
            return causal(new, {0: 8, 1: 8, 2: 8})
        if i == 8:
            return tree(m=6, k=3)
        return None

    return next_step


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, nbytes: int, iters: int) -> float:
    """Bytes per second moved by a device-to-device copy (each copied byte is read once and written once)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    return 2 * nbytes / median_seconds(lambda: dst.copy_(src), iters, device)


def median_seconds(fn: Callable[[], object], iters: int, device: torch.device) -> float:
    """Median wall time of ``fn()`` over ``iters`` calls, the device synchronised after each."""
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def random_model(shape: dict[str, Any], dtype: torch.dtype, device: torch.device, seed: int = 0) -> DecoderLM:
    """A Llama-shaped model with random weights, built on the meta device and materialised in place."""
    cfg = ModelArchConfig.from_hf_config(dict(architectures=["LlamaForCausalLM"], rms_norm_eps=1e-5,
                                              rope_theta=500000.0, max_position_embeddings=8192, **shape))
    with torch.device("meta"):
        model = DecoderLM(cfg, dtype=dtype)
    model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02, generator=gen)
    return model.eval()


def weight_bytes_read(model: DecoderLM) -> int:
    """Bytes of weights one forward reads: all parameters, except that an untied embedding is only indexed."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if model.lm_head is not None:
        total -= model.embed_tokens.weight.numel() * model.embed_tokens.weight.element_size()
    return total


def step_inputs(queries: int, kv_len: int, tree: bool, vocab: int) -> FlatStep:
    """One sequence reading ``kv_len`` contiguous slots; its last ``queries`` are new (causal), or a tree
    step whose ``queries`` branches sit in scratch slots and each see the prefix plus themselves."""
    read = np.arange(kv_len)
    write = read[kv_len - queries:]
    prefix = kv_len - queries
    mask = None
    positions = np.arange(prefix, kv_len)
    if tree:
        mask = np.zeros((queries, kv_len), dtype=bool)
        mask[:, :prefix] = True
        mask[:, prefix:] = np.eye(queries, dtype=bool)
        positions = np.full(queries, prefix)
    ids = (np.arange(queries) * 7 + 3) % vocab
    return FlatStep(ids.tolist(), positions, [SequenceLayout(write, read, mask)], list(range(queries)))


def time_step(driver: Driver, inputs: FlatStep, warmup: int, iters: int, device: torch.device) -> float:
    for _ in range(warmup):
        driver.step(inputs)
    sync(device)
    return median_seconds(lambda: driver.step(inputs), iters, device) * 1e3


@dataclass(frozen=True)
class TimingMode:
    """How part (c) runs a model: through a GraphRunner (``graphs``: its switches) or the reference forward
    (None), with or without the fused kernels, and the fused attention's keys per program (None: default)."""

    name: str
    graphs: dict[str, bool] | None
    fused: bool = False
    cols_per_split: int | None = None


def timing_modes(device: torch.device, compile_model: bool, fused: bool, splits: list[int]) -> list[TimingMode]:
    modes = [TimingMode("eager", None), TimingMode("static eager", dict(capture=False))]
    if fused:
        modes.append(TimingMode("fused static eager", dict(capture=False), True))
    if device.type == "cuda":
        modes.append(TimingMode("cuda graphs", dict(capture=True)))
        if fused:
            modes.append(TimingMode("fused graphs", dict(capture=True), True))
        if compile_model:
            modes.append(TimingMode("compiled graphs", dict(capture=True, compile=True)))
        if fused:
            modes += [TimingMode(f"fused graphs, {n} keys/split", dict(capture=True), True, n) for n in splits]
    return modes


def profile_step(driver: Driver, inputs: FlatStep, device: torch.device, top: int = 12) -> dict[str, Any]:
    """Device kernels of one step (the static forward run eagerly, so every kernel is visible): how many, their
    summed time, the share in matrix products, and the ``top`` kernels by time."""
    from torch.profiler import ProfilerActivity, profile

    activity = ProfilerActivity.CUDA if device.type == "cuda" else ProfilerActivity.CPU
    driver.step(inputs)
    sync(device)
    with profile(activities=[activity]) as prof:
        driver.step(inputs)
        sync(device)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA] \
        if device.type == "cuda" else [e for e in prof.events() if not e.cpu_children]
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        entry = by_name.setdefault(e.name, [0, 0.0])
        entry[0] += 1
        entry[1] += e.device_time if device.type == "cuda" else e.cpu_time
    total_us = sum(v[1] for v in by_name.values())
    gemm_us = sum(v[1] for k, v in by_name.items() if any(m in k.lower() for m in ("gemm", "gemv", "cutlass", "sm90")))
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
    return {"kernels": len(kernels), "kernel_ms": total_us / 1e3, "gemm_ms": gemm_us / 1e3,
            "top": [{"name": k[:90], "count": int(v[0]), "ms": v[1] / 1e3} for k, v in ranked]}


def print_profile(mode: str, prof: dict[str, Any]) -> None:
    print(f"profile of one target AR step ({mode}): {prof['kernels']} kernels, "
          f"{prof['kernel_ms']:.3f} ms of kernel time, {prof['gemm_ms']:.3f} ms in matrix products", flush=True)
    for row in prof["top"]:
        print(f"    {row['ms']:8.3f} ms  x{row['count']:<5d} {row['name']}", flush=True)
