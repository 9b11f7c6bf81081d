"""Tensor parallelism on CPU (gloo, two processes): partition math, logits and greedy generations of
TP = 2 equal to TP = 1 for every supported architecture and speculation mode, and rank failures.

Everything runs in float32, where a row-parallel all-reduce differs from the single GEMM only by
summation order (~1e-6), far below the logit gaps of the random checkpoints (see tests/checkpoints.py).
"""

from __future__ import annotations

import multiprocessing
import os
import signal

import numpy as np
import pytest
import torch

from ssd import LLM, SamplingParams
from ssd.distributed.comm import TensorParallelError
from ssd.distributed.launcher import TensorParallelRanks
from ssd.distributed.layout import plan_layout
from ssd.distributed.worker import RunnerArgs, build_runner
from ssd.runtime.forward_items import ForwardItem
from ssd.models.parallel import partition_heads, partition_vocab
from ssd_utils import make_perturbed_draft

PROMPTS = [[5, 17, 42, 9, 33, 71, 2], [100, 3, 250, 7], [64, 65, 66, 67, 68, 69, 70, 71, 72, 73, 74]]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
ENGINE = dict(dtype="float32", block_size=4, kv_cache_memory="4MiB", num_threads=1, distributed_timeout_s=60.0)


# ----------------------------------------------------------------------------------------- partitioning
def test_partition_heads_divisible_and_replicated():
    assert partition_heads(8, 4, 1, 2) == partition_heads(8, 4, 1, 2)
    p = partition_heads(8, 4, rank=1, world=2)
    assert (p.q_start, p.num_q, p.kv_start, p.num_kv) == (4, 4, 2, 2)
    # Fewer KV heads than ranks: each KV head is replicated on the ranks whose query heads use it.
    parts = [partition_heads(8, 2, rank=r, world=4) for r in range(4)]
    assert [(p.q_start, p.num_q, p.kv_start, p.num_kv) for p in parts] == [
        (0, 2, 0, 1), (2, 2, 0, 1), (4, 2, 1, 1), (6, 2, 1, 1)
    ]
    for p in parts:  # query head h uses KV head h // (H / Hkv) = h // 4
        assert {h // 4 for h in range(p.q_start, p.q_start + p.num_q)} == {p.kv_start}
    with pytest.raises(ValueError, match="num_attention_heads=6 is not divisible"):
        partition_heads(6, 2, 0, 4)
    with pytest.raises(ValueError, match="one must divide the other"):
        partition_heads(12, 3, 0, 2)


def test_partition_vocab_pads_the_last_rank():
    parts = [partition_vocab(501, r, 2) for r in range(2)]
    assert [(p.start, p.stop, p.local_size) for p in parts] == [(0, 251, 251), (251, 501, 251)]


def test_plan_layout_gives_ranks_and_draft_their_own_cores():
    layout = plan_layout("cpu", 2, draft_on_cpu=True, cpus=[0, 1, 2, 3, 4])
    assert layout.draft_cpus == [4]
    assert layout.rank_cpus == [[0, 1], [2, 3]] and layout.rank_threads == [2, 2]
    single = plan_layout("cpu", 1, draft_on_cpu=True, cpus=[0, 1])
    assert single.rank_cpus == [[0]] and single.draft_cpus == [1]
    assert plan_layout("cpu", 1, cpus=[0, 1]).rank_cpus == [None]  # nothing to share: no pinning
    assert plan_layout("cpu", 4, cpus=[0, 1]).rank_cpus == [None] * 4  # oversubscribed
    assert plan_layout("cuda:1", 2).rank_devices == ["cuda:1", "cuda:2"]


# ----------------------------------------------------------------------------------------- logits
def _items(block_size: int, decode_tokens: list[int] | None = None) -> list[ForwardItem]:
    items, next_block = [], 0
    for prompt in PROMPTS:
        n_blocks = -(-(len(prompt) + 4) // block_size)
        table = list(range(next_block, next_block + n_blocks))
        next_block += n_blocks
        if decode_tokens is None:
            items.append(ForwardItem(prompt, 0, table, num_logits=len(prompt)))
        else:
            items.append(ForwardItem([decode_tokens.pop(0)], len(prompt), table))
    return items


@pytest.mark.parametrize(
    "arch,options",
    [
        ("llama", dict(num_heads=4, num_kv_heads=2)),
        ("llama", dict(num_heads=4, num_kv_heads=1, tie_word_embeddings=True, vocab_size=501)),  # replicated KV
        ("qwen3", dict(num_heads=4, num_kv_heads=2)),
        ("qwen2", dict(num_heads=4, num_kv_heads=2, tie_word_embeddings=True)),
    ],
)
def test_tp2_logits_equal_tp1(checkpoint_factory, arch, options):
    path = str(checkpoint_factory(arch, **options))
    args = RunnerArgs(path, "float32", 4, None, 4 << 20, 0.25, 4)
    single = build_runner(args, "cpu", None)
    ranks = TensorParallelRanks.start(args, plan_layout("cpu", 2, num_threads=1, cpus=[0]), timeout_s=60)
    try:
        sharded = build_runner(args, "cpu", ranks.group)
        # The KV budget is per rank: a rank holding fewer KV heads fits proportionally more blocks.
        assert sharded.num_blocks * sharded.model.num_kv_heads == single.num_blocks * single.model.num_kv_heads
        prefill_1, prefill_2 = single.forward(_items(4)), sharded.forward(_items(4))  # [sum(P), V]
        torch.testing.assert_close(prefill_2, prefill_1, rtol=1e-5, atol=1e-5)
        nxt = prefill_1.argmax(-1).tolist()
        last = list(np.cumsum([len(p) for p in PROMPTS]) - 1)
        decode_1 = single.forward(_items(4, [nxt[i] for i in last]))
        decode_2 = sharded.forward(_items(4, [nxt[i] for i in last]))  # reads the prefilled sharded cache
        torch.testing.assert_close(decode_2, decode_1, rtol=1e-5, atol=1e-5)
        assert decode_2.shape[-1] == single.arch.vocab_size
    finally:
        ranks.shutdown()
    assert all(not p.is_alive() for p in ranks.processes)


# ----------------------------------------------------------------------------------------- generation
def _generate(path, **engine) -> list[list[int]]:
    llm = LLM(str(path), **ENGINE, **engine)
    try:
        return [out.token_ids for out in llm.generate(PROMPTS, GREEDY)]
    finally:
        llm.shutdown()


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen2"])
def test_tp2_greedy_ar_equals_tp1(checkpoint_factory, arch):
    path = checkpoint_factory(arch, num_heads=4, num_kv_heads=2)
    assert _generate(path, tensor_parallel_size=2) == _generate(path)


@pytest.mark.parametrize("method", ["draft_model", "ssd"])
def test_tp2_speculative_greedy_equals_tp1_ar(checkpoint_factory, tmp_path, method):
    target = checkpoint_factory("llama", num_heads=4, num_kv_heads=2)
    draft = make_perturbed_draft(target, tmp_path / "draft", sigma=0.3)
    spec = dict(method=method, model=str(draft), num_speculative_tokens=3)
    reference = _generate(target)
    llm = LLM(str(target), **ENGINE, tensor_parallel_size=2, speculative_config=spec)
    try:
        outs = [out.token_ids for out in llm.generate(PROMPTS, GREEDY)]
        stats = llm.engine.spec_stats
    finally:
        llm.shutdown()
    assert outs == reference
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0


@pytest.mark.parametrize("method", ["eagle3", "ssd"])
def test_tp2_speculation_with_an_eagle3_head_equals_tp1_ar(checkpoint_factory, tmp_path, method):
    """The driver takes the target's features from its own pass (the residual stream is whole on every rank)
    while the other rank runs the same pass; the head reads the whole embedding, not the driver's shard. The
    head's drafts come from those features: with the features of TP = 1 they are the same drafts."""
    from eagle3_utils import LAYERS, make_eagle3_head

    target = checkpoint_factory("llama", num_heads=4, num_kv_heads=2)
    head = make_eagle3_head(tmp_path / "head", vocab_size=512, target_hidden_size=64, hidden_size=64,
                            feature_layers=LAYERS, seed=3)
    spec = dict(method=method, model=str(head), num_speculative_tokens=3, adaptive_lookahead=False,
                interruptible_build=False, fan_out=2, fallback="jit")  # SSD's trees independent of timing
    reference = _generate(target)
    drafts = {}
    for tp in (1, 2):
        llm = LLM(str(target), **ENGINE, tensor_parallel_size=tp, speculative_config=spec)
        try:
            assert [out.token_ids for out in llm.generate(PROMPTS, GREEDY)] == reference
            drafts[tp] = llm.engine.spec_stats.num_draft_tokens
        finally:
            llm.shutdown()
    assert drafts[2] == drafts[1] > 0


# ----------------------------------------------------------------------------------------- failures
def test_dead_worker_rank_is_a_clear_error_and_shutdown_leaves_no_process(checkpoint_factory):
    path = checkpoint_factory("llama", num_heads=4, num_kv_heads=2)
    llm = LLM(str(path), **ENGINE, tensor_parallel_size=2)
    worker = llm.engine.parallel.processes[0]
    try:
        assert [o.token_ids for o in llm.generate(PROMPTS[:1], GREEDY)] == _generate(path)[:1]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(10)
        with pytest.raises(TensorParallelError, match=r"rank 1 \(pid \d+, exit code -9\) died"):
            llm.generate(PROMPTS[:1], GREEDY)
    finally:
        llm.shutdown()
    assert not worker.is_alive()


def test_shutdown_stops_workers(checkpoint_factory):
    path = checkpoint_factory("qwen3", num_heads=4, num_kv_heads=2)
    llm = LLM(str(path), **ENGINE, tensor_parallel_size=2)
    processes = list(llm.engine.parallel.processes)
    llm.shutdown()
    assert processes and all(not p.is_alive() for p in processes)


# ----------------------------------------------------------------------------------------- torchrun
def test_torchrun_launch_matches_single_process(checkpoint_factory):
    """Ranks from torchrun's environment variables (no spawned workers): rank 1 serves, rank 0 generates."""
    import shutil
    import subprocess
    import sys

    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    if torchrun is None:
        pytest.skip("torchrun is not installed next to this interpreter")
    path = checkpoint_factory("llama", num_heads=4, num_kv_heads=2)
    command = ["-m", "ssd.cli.main", "generate", "--model", str(path), "--dtype", "float32", "--threads", "1",
               "--prompt", "def add(a, b):", "--max-tokens", "12", "--ignore-eos"]
    env = dict(os.environ, OMP_NUM_THREADS="1")

    def run(args: list[str]) -> subprocess.CompletedProcess:
        # Own process group, so a hang takes torchrun's children down with it.
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                start_new_session=True)
        try:
            out, err = proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
        return subprocess.CompletedProcess(args, proc.returncode, out, err)

    single = run([sys.executable, *command])
    launched = run([torchrun, "--standalone", "--nproc-per-node", "2", *command, "-tp", "2"])
    assert single.returncode == 0, single.stderr
    assert launched.returncode == 0, launched.stderr
    text = single.stdout.split("\n[")[0]  # generated text, before the "[N tokens, finish=...]" line
    assert text.startswith("=== ") and text in launched.stdout


def test_unsplittable_model_fails_fast_and_stops_workers(checkpoint_factory):
    path = checkpoint_factory("llama", num_heads=3, num_kv_heads=3, hidden_size=48)
    before = {p.pid for p in multiprocessing.active_children()}
    with pytest.raises(ValueError, match="num_attention_heads=3 is not divisible by tensor_parallel_size=2"):
        LLM(str(path), **ENGINE, tensor_parallel_size=2)
    assert {p.pid for p in multiprocessing.active_children()} <= before
