"""KVCacheManager: block tables, prefix reuse, lookahead slots and trimming, with exact block ids."""

from __future__ import annotations

import pytest

from ssd.core.block_pool import BlockPool, hash_block_tokens
from ssd.core.kv_cache_manager import KVCacheManager
from ssd.core.sequence import Sequence

BS = 4


def make(num_blocks: int, block_size: int = BS, prefix: bool = True) -> tuple[BlockPool, KVCacheManager]:
    pool = BlockPool(num_blocks, block_size, enable_prefix_caching=prefix)
    return pool, KVCacheManager(pool)


def seq_of(seq_id: int, tokens: list[int]) -> Sequence:
    return Sequence(seq_id=seq_id, prompt_token_ids=list(tokens), sampling_params=None)


def compute(kv: KVCacheManager, seq: Sequence, num_new: int, num_lookahead: int = 0) -> None:
    """What the engine does around one step: allocate, 'run', advance, sample if done, cache."""
    assert kv.allocate_slots(seq, num_new, num_lookahead)
    seq.num_computed_tokens += num_new
    if seq.num_computed_tokens == seq.num_tokens:
        seq.append_tokens([900 + seq.num_tokens])
    kv.cache_full_blocks(seq)


def refs(pool: BlockPool) -> list[int]:
    return [b.ref_cnt for b in pool.blocks]


def test_allocate_slots_is_all_or_nothing():
    pool, kv = make(4)
    a = seq_of(1, list(range(10)))
    assert kv.allocate_prefix(a) == 0
    assert kv.num_blocks_needed(a, 10) == 3
    assert kv.allocate_slots(a, 10)
    assert a.block_table == [0, 1, 2]
    assert kv.num_blocks_needed(a, 10) == 0  # already covered
    b = seq_of(2, list(range(100, 106)))
    assert not kv.can_allocate(b, 6)
    assert not kv.allocate_slots(b, 6)
    assert b.block_table == [] and pool.free_block_ids() == [3]
    assert kv.allocate_slots(b, 4)
    assert b.block_table == [3] and kv.num_free_blocks == 0 and kv.usage == 1.0
    with pytest.raises(ValueError):
        kv.allocate_slots(b, -1)


def test_cache_full_blocks_registers_only_computed_full_blocks():
    pool, kv = make(8)
    s = seq_of(1, list(range(7)))
    kv.allocate_prefix(s)
    assert kv.allocate_slots(s, 5)
    s.num_computed_tokens = 5  # a chunk of 5
    assert kv.cache_full_blocks(s) == 1
    h0 = hash_block_tokens(None, [0, 1, 2, 3])
    assert pool.lookup(h0) is pool.blocks[0]
    assert pool.blocks[1].block_hash is None
    assert kv.cache_full_blocks(s) == 0  # incremental: nothing new
    compute(kv, s, 2)  # finishes the prompt (7 computed), samples token 907
    assert s.token_ids[-1] == 907 and pool.blocks[1].block_hash is None  # block 1 has 3 computed slots
    compute(kv, s, 1)  # decode: 8 computed
    h1 = hash_block_tokens(h0, [4, 5, 6, 907])
    assert pool.lookup(h1) is pool.blocks[1] and pool.num_cached_blocks == 2


def test_prefix_hit_after_free_and_cap_leaves_one_token():
    pool, kv = make(6)
    a = seq_of(1, list(range(9)))
    kv.allocate_prefix(a)
    compute(kv, a, 9)
    assert a.block_table == [0, 1, 2] and pool.num_cached_blocks == 2
    kv.free(a)
    assert a.block_table == []
    # Reverse order: unhashed tail block 2 goes to the head, hashed 1 then 0 to the tail.
    assert pool.free_block_ids() == [2, 3, 4, 5, 1, 0]

    b = seq_of(2, list(range(8)) + [50, 51])
    assert kv.find_cached_prefix(b) == 8
    assert b.block_table == [] and refs(pool) == [0] * 6  # find has no side effects
    assert kv.allocate_prefix(b) == 8
    assert b.block_table == [0, 1] and b.num_computed_tokens == 8 and b.num_cached_prompt_tokens == 8
    assert refs(pool)[:2] == [1, 1] and pool.free_block_ids() == [2, 3, 4, 5]
    assert (pool.prefix_cache_queries, pool.prefix_cache_hits) == (9 + 10, 0 + 8)
    assert kv.allocate_slots(b, 2)
    assert b.block_table == [0, 1, 2]

    # Exactly the cached 8 tokens: only 4 may be reused, the model must run at least one token.
    c = seq_of(3, list(range(8)))
    assert kv.find_cached_prefix(c) == 4
    assert kv.allocate_prefix(c) == 4
    assert c.block_table == [0] and refs(pool)[0] == 2
    # A one-token sequence never hits.
    assert kv.find_cached_prefix(seq_of(4, [0])) == 0


def test_shared_blocks_are_freed_only_by_the_last_holder():
    pool, kv = make(6)
    a = seq_of(1, list(range(6)))
    kv.allocate_prefix(a)
    compute(kv, a, 6)  # blocks [0, 1]; block 0 cached
    b = seq_of(2, list(range(4)) + [70, 71])
    kv.allocate_prefix(b)
    assert kv.allocate_slots(b, 2)
    assert b.block_table == [0, 2] and refs(pool)[:3] == [2, 1, 1]
    kv.free(a)
    assert refs(pool)[:3] == [1, 0, 1] and pool.free_block_ids() == [1, 3, 4, 5]
    kv.free(b)
    assert refs(pool)[:3] == [0, 0, 0]
    assert pool.free_block_ids() == [2, 1, 3, 4, 5, 0]


def test_eviction_removes_hashes_tail_of_sequence_first():
    pool, kv = make(4)
    a = seq_of(1, list(range(12)))
    kv.allocate_prefix(a)
    compute(kv, a, 12)  # 12 computed + 1 sampled: blocks [0, 1, 2] all cached
    kv.free(a)
    assert pool.free_block_ids() == [3, 2, 1, 0]
    probe = seq_of(2, list(range(12)) + [5])
    assert kv.find_cached_prefix(probe) == 12
    filler = seq_of(3, list(range(200, 208)))
    kv.allocate_prefix(filler)
    assert kv.allocate_slots(filler, 8)
    assert filler.block_table == [3, 2]  # the unhashed block, then a's last block is evicted first
    assert kv.find_cached_prefix(probe) == 8
    assert pool.num_cached_blocks == 2 and pool.blocks[2].block_hash is None
    assert kv.allocate_slots(filler, 12)
    assert filler.block_table == [3, 2, 1]
    assert kv.find_cached_prefix(probe) == 4
    assert pool.lookup(hash_block_tokens(None, [0, 1, 2, 3])) is pool.blocks[0]
    assert pool.num_cached_blocks == 1


def test_can_admit_counts_revived_cached_blocks():
    pool, kv = make(4)
    a = seq_of(1, list(range(9)))
    kv.allocate_prefix(a)
    compute(kv, a, 9)
    kv.free(a)
    assert pool.free_block_ids() == [2, 3, 1, 0]
    big = seq_of(2, list(range(8)) + list(range(100, 109)))  # 17 tokens, 8 cached
    # 2 cached blocks leave the free queue and 3 new ones are needed: 5 > 4.
    assert kv.find_cached_prefix(big) == 8
    assert not kv.can_admit(big, 9)
    ok = seq_of(3, list(range(8)) + list(range(100, 105)))  # 13 tokens: 2 revived + 2 new = 4
    assert kv.can_admit(ok, 5)
    assert not kv.can_admit(ok, 5, num_lookahead_tokens=4)  # one more block
    kv.allocate_prefix(ok)
    assert kv.allocate_slots(ok, 5)
    assert ok.block_table == [0, 1, 2, 3] and kv.num_free_blocks == 0
    with pytest.raises(RuntimeError, match="holding no KV"):
        kv.can_admit(ok, 1)


def test_lookahead_slots_then_trim_after_rejection():
    pool, kv = make(8)
    s = seq_of(1, list(range(7)))
    kv.allocate_prefix(s)
    compute(kv, s, 7)  # 8 tokens, 7 computed; pending token 907
    assert s.block_table == [0, 1]
    # Verify step: pending token + 5 draft tokens -> slots for positions 7..12 -> 4 blocks.
    assert kv.num_blocks_needed(s, 1, 5) == 2
    assert kv.allocate_slots(s, 1, 5)
    assert s.block_table == [0, 1, 2, 3]
    # All drafts rejected: the pending token is computed, a recovery token is appended.
    s.num_computed_tokens += 1
    s.append_tokens([42])
    assert kv.cache_full_blocks(s) == 1  # block 1 (tokens 4..7) only; lookahead blocks never cached
    assert [b.block_hash is not None for b in pool.blocks[:4]] == [True, True, False, False]
    assert kv.trim(s) == 1  # 9 tokens need 3 blocks
    assert s.block_table == [0, 1, 2]
    assert pool.free_block_ids()[0] == 3  # garbage block is reused first, cached blocks are not churned
    assert kv.trim(s) == 0

    # Next round accepts 3 of 4 drafts plus a recovery token.
    assert kv.allocate_slots(s, 1, 4)  # positions 8..12 -> 4 blocks
    assert s.block_table == [0, 1, 2, 3]
    s.num_computed_tokens += 1 + 3
    s.append_tokens([43, 44, 45, 46])
    assert (s.num_tokens, s.num_computed_tokens) == (13, 12)
    assert kv.cache_full_blocks(s) == 1  # block 2 (tokens 8..11)
    assert kv.trim(s) == 0  # 13 tokens need all 4 blocks


def test_free_releases_in_reverse_and_forgets_state():
    pool, kv = make(5)
    s = seq_of(1, list(range(10)))
    kv.allocate_prefix(s)
    compute(kv, s, 10)
    assert s.block_table == [0, 1, 2]
    kv.free(s)
    assert pool.free_block_ids() == [2, 3, 4, 1, 0]
    assert s.block_table == [] and kv.num_free_blocks == 5
    # Re-admission recomputes hashes from scratch and hits both cached blocks.
    s.num_computed_tokens = 0
    assert kv.allocate_prefix(s) == 8
    assert s.block_table == [0, 1]
    kv.free(seq_of(99, [1]))  # never allocated: no-op


def test_prefix_caching_disabled():
    pool, kv = make(4, prefix=False)
    a = seq_of(1, list(range(9)))
    kv.allocate_prefix(a)
    compute(kv, a, 9)
    assert pool.num_cached_blocks == 0
    kv.free(a)
    b = seq_of(2, list(range(9)))
    assert kv.find_cached_prefix(b) == 0
    assert kv.allocate_prefix(b) == 0
    assert pool.prefix_cache_queries == 0


def test_two_managers_are_independent():
    target_pool, target = make(4)
    draft_pool, draft = make(8, block_size=2)
    t_seq = seq_of(7, list(range(6)))
    d_seq = seq_of(7, list(range(6)))  # the draft side's own mirror of request 7
    target.allocate_prefix(t_seq)
    draft.allocate_prefix(d_seq)
    assert target.allocate_slots(t_seq, 6)
    assert draft.allocate_slots(d_seq, 6, 3)
    assert t_seq.block_table == [0, 1] and d_seq.block_table == [0, 1, 2, 3, 4]
    assert target.num_free_blocks == 2 and draft.num_free_blocks == 3
    target.free(t_seq)
    assert draft.num_free_blocks == 3 and d_seq.block_table == [0, 1, 2, 3, 4]
