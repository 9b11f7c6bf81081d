"""Scheduler: hand-built steps with exact plans and block ids, plus a simulated engine run with invariants.

The engine's update step is simulated: advance ``num_computed_tokens``, append a fake token when a sequence's
tokens are all computed, register full blocks. Fake tokens depend only on (sequence, position), so a
recompute after preemption reproduces the same text.
"""

from __future__ import annotations

import ast
import pathlib
import random

import pytest

from ssd.core.block_pool import BlockPool
from ssd.core.kv_cache_manager import KVCacheManager
from ssd.core.scheduler import Scheduler, SchedulerConfig, SchedulerOutput, SequenceTooLongError
from ssd.core.sequence import FinishReason, Sequence, SequenceStatus


def make(
    num_blocks: int,
    block_size: int = 4,
    *,
    max_num_seqs: int = 8,
    budget: int = 64,
    max_model_len: int = 64,
    chunked: bool = True,
    prefix: bool = True,
) -> tuple[BlockPool, KVCacheManager, Scheduler]:
    pool = BlockPool(num_blocks, block_size, enable_prefix_caching=prefix)
    kv = KVCacheManager(pool)
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        enable_chunked_prefill=chunked,
    )
    return pool, kv, Scheduler(config, kv)


def seq_of(seq_id: int, num_tokens: int, base: int | None = None) -> Sequence:
    base = seq_id * 100 if base is None else base
    return Sequence(seq_id=seq_id, prompt_token_ids=list(range(base, base + num_tokens)), sampling_params=None)


def fake_token(seq: Sequence, position: int) -> int:
    return 10_000 + 1_000 * seq.seq_id + position


def update(kv: KVCacheManager, out: SchedulerOutput) -> None:
    """The engine's non-speculative update: lookahead slots (if any) are all rejected."""
    for item in out.scheduled:
        seq = item.seq
        seq.num_computed_tokens += item.num_new_tokens
        if seq.num_computed_tokens == seq.num_tokens:
            seq.append_tokens([fake_token(seq, seq.num_tokens)])
        kv.cache_full_blocks(seq)
        kv.trim(seq)


def step(sched: Scheduler, num_drafts=0) -> SchedulerOutput:
    out = sched.schedule(num_drafts)
    update(sched.kv, out)
    return out


def plan(out: SchedulerOutput) -> list[tuple[int, int, int]]:
    return [(s.seq.seq_id, s.num_new_tokens, s.num_lookahead_tokens) for s in out.scheduled]


def test_core_modules_import_no_torch():
    core = pathlib.Path(__file__).resolve().parents[1] / "ssd" / "core"
    for name in ("block_pool.py", "kv_cache_manager.py", "scheduler.py", "sequence.py"):
        tree = ast.parse((core / name).read_text())
        imported = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                imported.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                imported.add(node.module.split(".")[0])
        assert imported.isdisjoint({"torch", "numpy"}), (name, imported)


def test_config_validation():
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(max_num_batched_tokens=True)
    with pytest.raises(ValueError, match="chunked prefill"):
        SchedulerConfig(max_num_batched_tokens=8, max_model_len=16, enable_chunked_prefill=False)


def test_add_validation():
    _, _, sched = make(8, max_model_len=10)
    sched.add(seq_of(1, 3))
    with pytest.raises(ValueError, match="already"):
        sched.add(seq_of(1, 3))
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add(seq_of(2, 11))
    with pytest.raises(ValueError, match="no tokens"):
        sched.add(seq_of(3, 0))
    assert sched.num_waiting == 1


def test_chunked_prefill_chunks_follow_the_token_budget():
    pool, _, sched = make(32, budget=8)
    a, b, c = seq_of(1, 10), seq_of(2, 5), seq_of(3, 3)
    for s in (a, b, c):
        sched.add(s)
    out = step(sched)
    assert plan(out) == [(1, 8, 0)] and out.num_batched_tokens == 8
    assert [s.computes_all_tokens for s in out.scheduled] == [False]
    assert a.block_table == [0, 1] and a.num_computed_tokens == 8 and a.num_tokens == 10
    assert (sched.num_running, sched.num_waiting) == (1, 2)

    out = step(sched)
    assert plan(out) == [(1, 2, 0), (2, 5, 0), (3, 1, 0)] and out.num_batched_tokens == 8
    assert [s.computes_all_tokens for s in out.scheduled] == [True, True, False]
    assert (a.block_table, b.block_table, c.block_table) == ([0, 1, 2], [3, 4], [5])
    assert (a.num_tokens, b.num_tokens, c.num_computed_tokens) == (11, 6, 1)

    out = step(sched)
    assert plan(out) == [(1, 1, 0), (2, 1, 0), (3, 2, 0)] and out.num_batched_tokens == 4
    assert a.output_token_ids == [fake_token(a, 10), fake_token(a, 11)]


def test_without_chunked_prefill_a_prompt_runs_whole_or_waits():
    _, _, sched = make(32, budget=16, max_model_len=16, chunked=False)
    sched.add(seq_of(1, 10))
    sched.add(seq_of(2, 10))
    assert plan(step(sched)) == [(1, 10, 0)]
    assert plan(step(sched)) == [(1, 1, 0), (2, 10, 0)]
    assert plan(step(sched)) == [(1, 1, 0), (2, 1, 0)]


def test_max_num_seqs_limits_running():
    _, _, sched = make(32, max_num_seqs=2)
    seqs = [seq_of(i, 3) for i in (1, 2, 3)]
    for s in seqs:
        sched.add(s)
    assert plan(step(sched)) == [(1, 3, 0), (2, 3, 0)]
    assert (sched.num_running, sched.num_waiting) == (2, 1)
    assert plan(step(sched)) == [(1, 1, 0), (2, 1, 0)]
    sched.finish(seqs[0], FinishReason.STOP)
    assert seqs[0].status is SequenceStatus.FINISHED and seqs[0].finish_reason is FinishReason.STOP
    assert seqs[0].block_table == []
    assert plan(step(sched)) == [(2, 1, 0), (3, 3, 0)]


def test_admission_is_fcfs_without_skipping():
    pool, _, sched = make(4)
    sched.add(seq_of(1, 12))  # 3 blocks
    sched.add(seq_of(2, 8))  # needs 2 blocks, 1 left
    sched.add(seq_of(3, 2))  # would fit, but must not overtake
    assert plan(step(sched)) == [(1, 12, 0)]
    assert [s.seq_id for s in sched.waiting] == [2, 3] and pool.num_free_blocks == 1


def test_preemption_latest_first_readmitted_first_with_prefix_reuse():
    pool, kv, sched = make(6, block_size=2)
    a, b, c = seq_of(1, 4), seq_of(2, 3), seq_of(3, 3)
    for s in (a, b, c):
        sched.add(s)
    assert plan(step(sched)) == [(1, 4, 0), (2, 3, 0), (3, 3, 0)]
    assert (a.block_table, b.block_table, c.block_table) == ([0, 1], [2, 3], [4, 5])
    assert (a.num_tokens, b.num_tokens, c.num_tokens) == (5, 4, 4)

    # A verifies 1 + 5 tokens: positions 4..9 need 3 more blocks, none are free.
    out = sched.schedule(num_drafts=5)
    assert plan(out) == [(1, 1, 5)] and out.num_batched_tokens == 6
    assert [s.seq_id for s in out.preempted] == [3, 2]  # latest arrival first
    assert [s.seq_id for s in sched.waiting] == [2, 3]  # and requeued at the front, in arrival order
    for s in (b, c):
        assert s.status is SequenceStatus.WAITING and s.num_computed_tokens == 0
        assert s.block_table == [] and s.num_preemptions == 1
    # Freed last-first: unhashed tails 5, 3 to the head; hashed 4, 2 to the tail; A took 3, 5, 4.
    assert a.block_table == [0, 1, 3, 5, 4] and pool.free_block_ids() == [2]
    assert pool.blocks[2].block_hash is not None  # B's first block survives
    sched.add(seq_of(4, 1))  # a newer arrival queues behind the preempted ones

    # Every draft is rejected: the pending token is computed, a recovery token appended, the tail trimmed.
    a.num_computed_tokens += 1
    a.append_tokens([fake_token(a, 5)])
    kv.cache_full_blocks(a)
    assert kv.trim(a) == 2
    assert a.block_table == [0, 1, 3] and pool.free_block_ids() == [5, 4, 2]

    out = step(sched)
    assert plan(out) == [(1, 1, 0), (2, 2, 0)]  # B recomputes its 4 tokens, 2 of them from the cache
    assert b.num_cached_prompt_tokens == 2 and b.block_table == [2, 5]
    assert b.status is SequenceStatus.RUNNING and b.output_token_ids == [fake_token(b, 3), fake_token(b, 4)]
    assert [s.seq_id for s in sched.waiting] == [3, 4]  # C (no cached blocks left) does not fit yet
    assert [s.seq_id for s in sched.running] == [1, 2]


def test_a_sequence_that_is_the_latest_arrival_preempts_itself():
    pool, _, sched = make(5, block_size=2)
    a, b = seq_of(1, 2), seq_of(2, 5)
    sched.add(a)
    sched.add(b)
    assert plan(step(sched)) == [(1, 2, 0), (2, 5, 0)]
    assert plan(step(sched)) == [(1, 1, 0), (2, 1, 0)]
    assert (a.block_table, b.block_table) == ([0, 4], [1, 2, 3])
    out = step(sched)  # B needs a 4th block; A, arrived earlier, is never the victim
    assert plan(out) == [(1, 1, 0)] and out.preempted == [b]
    assert a.block_table == [0, 4] and b.block_table == [] and list(sched.waiting) == [b]
    assert pool.free_block_ids() == [3, 2, 1]  # all of B's blocks were full and cached
    out = step(sched)
    assert plan(out) == [(1, 1, 0)] and out.preempted == []
    assert a.block_table == [0, 4, 3]  # evicts B's last block; B (2 cached + 2 new blocks) must wait
    assert list(sched.waiting) == [b]


def test_no_admission_in_a_step_that_preempted():
    pool, _, sched = make(5, budget=16, prefix=False)
    a, c = seq_of(1, 4), seq_of(2, 20)
    sched.add(a)
    sched.add(c)
    assert plan(step(sched)) == [(1, 4, 0), (2, 12, 0)]
    assert (a.block_table, c.block_table, pool.free_block_ids()) == ([0], [1, 2, 3], [4])
    out = sched.schedule(num_drafts=7)  # A needs 2 more blocks: C is preempted
    assert plan(out) == [(1, 1, 7)] and out.preempted == [c]
    # A chunk of C would fit in the 2 blocks left, but admitting right after a preemption would thrash.
    assert pool.num_free_blocks == 2 and list(sched.waiting) == [c]


def test_lookahead_only_for_chunks_that_finish_the_sequence():
    _, _, sched = make(32, budget=10)
    a = seq_of(1, 3)
    sched.add(a)
    assert plan(step(sched)) == [(1, 3, 0)]
    sched.add(seq_of(2, 20))
    out = sched.schedule(num_drafts=4)
    assert plan(out) == [(1, 1, 4), (2, 5, 0)] and out.num_batched_tokens == 10
    assert [s.computes_all_tokens for s in out.scheduled] == [True, False]
    assert a.block_table == [0, 1]  # positions 0..7


def test_candidates_are_the_running_then_the_waiting_that_admission_could_reach():
    _, _, sched = make(32, max_num_seqs=2)
    for i in range(1, 5):
        sched.add(seq_of(i, 2))
    assert [s.seq_id for s in sched.candidates()] == [1, 2]  # nothing running: room for two
    step(sched)
    sched.add(seq_of(5, 2))
    assert [s.seq_id for s in sched.candidates()] == [1, 2]  # full: no waiting one can be admitted


def test_lookahead_plan_and_caps():
    _, _, sched = make(32, budget=10)
    sched.add(seq_of(1, 3))
    sched.add(seq_of(2, 20))
    sched.add(seq_of(3, 2))
    # 2's chunk is a partial prefill: no lookahead whatever the plan says; 3 is not admitted (budget)
    assert plan(sched.schedule({1: 2, 2: 3, 3: 1})) == [(1, 3, 2), (2, 5, 0)]

    _, _, sched = make(32)
    sched.add(seq_of(1, 2))
    sched.add(seq_of(2, 2))
    assert plan(sched.schedule({2: 3})) == [(1, 2, 0), (2, 2, 3)]  # a sequence the plan omits gets none

    _, _, sched = make(32, budget=4)
    sched.add(seq_of(1, 2))
    assert plan(sched.schedule(5)) == [(1, 2, 2)]  # capped by the token budget

    _, _, sched = make(32, max_model_len=8)
    sched.add(seq_of(1, 6))
    assert plan(sched.schedule(5)) == [(1, 6, 2)]  # draft positions stay below max_model_len

    _, _, sched = make(32)
    sched.add(seq_of(1, 2))
    with pytest.raises(ValueError, match="num_drafts"):
        sched.schedule(-1)
    with pytest.raises(ValueError, match="num_drafts must be a non-negative integer for sequence 1, got 1.5"):
        sched.schedule({1: 1.5})


def test_prefix_cache_hit_across_requests():
    pool, _, sched = make(8)
    a = seq_of(1, 9, base=0)
    sched.add(a)
    step(sched)
    sched.finish(a, FinishReason.LENGTH)
    assert pool.num_free_blocks == 8 and pool.num_cached_blocks == 2
    b = seq_of(2, 9, base=0)
    sched.add(b)
    out = step(sched)
    assert plan(out) == [(2, 1, 0)] and b.num_cached_prompt_tokens == 8
    assert b.block_table == [0, 1, 2] and b.num_computed_tokens == 9


def test_abort_frees_blocks():
    pool, _, sched = make(8, max_num_seqs=1)
    a, b = seq_of(1, 6), seq_of(2, 3)
    sched.add(a)
    sched.add(b)
    step(sched)
    assert a.block_table == [0, 1] and pool.num_free_blocks == 6
    assert sched.abort(1) is a
    assert a.status is SequenceStatus.FINISHED and a.finish_reason is FinishReason.ABORT
    assert a.block_table == [] and pool.num_free_blocks == 8 and sched.num_running == 0
    assert sched.abort(1) is None and sched.abort(999) is None
    assert sched.has_unfinished()
    assert sched.abort(2) is b and b.finish_reason is FinishReason.ABORT  # waiting: nothing to free
    assert not sched.has_unfinished() and sched.schedule().is_empty
    with pytest.raises(ValueError, match="not an unfinished"):
        sched.finish(a, FinishReason.STOP)


def test_sequence_that_can_never_fit_raises():
    _, _, sched = make(2, block_size=2)
    s = seq_of(1, 5)
    sched.add(s)
    with pytest.raises(SequenceTooLongError, match="pool only has 2 blocks") as info:
        sched.schedule()
    assert info.value.seq is s and list(sched.waiting) == [s]

    _, _, sched = make(2, block_size=2)
    sched.add(seq_of(1, 4))
    with pytest.raises(SequenceTooLongError, match="whole pool"):
        sched.schedule(num_drafts=1)  # fits alone, but not with a lookahead slot


# ---------------------------------------------------------------------- simulated engine
def test_simulated_engine_keeps_kv_consistent():
    """Random workload with shared prefixes, speculation and a small pool; a fake KV store checks content.

    The store records which token was written to each slot. Every step reads back all positions a sequence
    has computed and compares them with its tokens, so a wrong prefix hit, a write into a shared block or a
    lost block would show up.
    """
    rng = random.Random(0)
    block_size = 4
    pool, kv, sched = make(14, block_size, max_num_seqs=4, budget=16, max_model_len=64)
    store: dict[tuple[int, int], int] = {}
    common = list(range(500, 512))
    max_out: dict[int, int] = {}
    seqs = []
    for i in range(16):
        prompt = common[: rng.choice([0, 4, 8, 12])] + [rng.randrange(100) for _ in range(rng.randint(1, 14))]
        s = Sequence(seq_id=i, prompt_token_ids=prompt, sampling_params=None)
        max_out[i] = rng.randint(1, 14)
        seqs.append(s)

    def slot(s: Sequence, pos: int) -> tuple[int, int]:
        return s.block_table[pos // block_size], pos % block_size

    pending = list(seqs)
    total_preempted = 0
    for _ in range(2000):
        if pending and rng.random() < 0.5:
            sched.add(pending.pop(0))
        if not sched.has_unfinished():
            if not pending:
                break
            continue
        out = sched.schedule({s.seq_id: (s.seq_id + s.num_tokens) % 4 for s in (*sched.running, *sched.waiting)})
        total_preempted += len(out.preempted)
        assert out.num_batched_tokens <= 16 and sched.num_running <= 4
        assert out.num_batched_tokens == sum(x.num_new_tokens + x.num_lookahead_tokens for x in out.scheduled)
        for x in out.scheduled:
            s = x.seq
            start = s.num_computed_tokens
            assert s.status is SequenceStatus.RUNNING and s.num_tokens <= 64
            assert len(s.block_table) * block_size >= start + x.num_new_tokens + x.num_lookahead_tokens
            for pos in range(start, start + x.num_new_tokens + x.num_lookahead_tokens):
                block = pool.blocks[slot(s, pos)[0]]
                assert block.ref_cnt == 1 and block.block_hash is None  # never write shared/cached KV
                store[slot(s, pos)] = s.token_ids[pos] if pos < s.num_tokens else -1  # drafts: garbage
            for pos in range(start + x.num_new_tokens):
                assert store[slot(s, pos)] == s.token_ids[pos]
        for x in out.scheduled:  # update, accepting a random number of drafts
            s = x.seq
            s.num_computed_tokens += x.num_new_tokens
            if s.num_computed_tokens == s.num_tokens:
                accepted = rng.randint(0, x.num_lookahead_tokens)
                for j in range(accepted):  # accepted drafts had their K/V written with the right token
                    pos = s.num_tokens + j
                    store[slot(s, pos)] = fake_token(s, pos)
                new = [fake_token(s, s.num_tokens + j) for j in range(accepted + 1)]
                new = new[: max_out[s.seq_id] - s.num_output_tokens]
                s.num_computed_tokens += len(new) - 1 if len(new) == accepted + 1 else len(new)
                s.append_tokens(new)
            kv.cache_full_blocks(s)
            kv.trim(s)
            if s.num_output_tokens >= max_out[s.seq_id]:
                sched.finish(s, FinishReason.LENGTH)
        # Invariants: reference counts match the tables, free queue holds exactly the unreferenced blocks.
        held: dict[int, int] = {}
        for s in sched.running:
            for b in s.block_table:
                held[b] = held.get(b, 0) + 1
        for s in sched.waiting:
            assert s.block_table == [] and s.num_computed_tokens == 0
        assert [b.ref_cnt for b in pool.blocks] == [held.get(i, 0) for i in range(pool.num_blocks)]
        assert sorted(pool.free_block_ids()) == [i for i in range(pool.num_blocks) if i not in held]
        assert all(pool.blocks[b].block_hash is not None for b, n in held.items() if n > 1)
    else:
        pytest.fail("simulation did not finish")

    assert all(s.is_finished and s.num_output_tokens == max_out[s.seq_id] for s in seqs)
    for s in seqs:
        assert s.output_token_ids == [fake_token(s, p) for p in range(s.num_prompt_tokens, s.num_tokens)]
    assert pool.num_free_blocks == pool.num_blocks
    assert total_preempted > 0 and pool.prefix_cache_hits > 0  # the run exercised both paths
