"""BlockPool: allocation order, reference counts, eviction order and the prefix-cache map."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ssd.core import block_pool
from ssd.core.block_pool import BlockPool, NoFreeBlocksError, hash_block_tokens


def ids(blocks):
    return [b.block_id for b in blocks]


# ---------------------------------------------------------------------- hashing
def test_hash_is_chained_and_separates_fields():
    h0 = hash_block_tokens(None, [1, 2, 3, 4])
    assert isinstance(h0, bytes) and len(h0) == 32
    assert hash_block_tokens(None, [1, 2, 3, 4]) == h0
    assert hash_block_tokens(None, (1, 2, 3, 4)) == h0  # any sequence type
    assert hash_block_tokens(None, [1, 2, 4, 3]) != h0  # order matters
    assert hash_block_tokens(h0, [1, 2, 3, 4]) != h0  # the parent matters
    assert hash_block_tokens(None, [1, 2, 3, 4], extra=b"x") != h0
    # Same bytes split differently between parent/tokens/extra must not collide.
    assert hash_block_tokens(None, [1, 2], extra=b"") != hash_block_tokens(None, [1], extra=b"\x02")
    assert hash_block_tokens(b"", [1]) != hash_block_tokens(None, [1])
    # Large and negative ids are representable.
    assert hash_block_tokens(None, [2**40, -1]) != hash_block_tokens(None, [2**40, -2])


def test_hash_is_the_same_in_another_process():
    # Load the module file on its own (it imports nothing from ssd), which keeps the child process fast.
    code = (
        "import importlib.util as u, sys;"
        f"spec = u.spec_from_file_location('bp', {block_pool.__file__!r});"
        "m = sys.modules['bp'] = u.module_from_spec(spec); spec.loader.exec_module(m);"
        "assert 'torch' not in sys.modules;"
        "print(m.hash_block_tokens(m.hash_block_tokens(None, [5, 6, 7]), [8, 9, 10], b'salt').hex())"
    )
    env = dict(os.environ, PYTHONHASHSEED="12345")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    expected = hash_block_tokens(hash_block_tokens(None, [5, 6, 7]), [8, 9, 10], b"salt").hex()
    assert out.stdout.strip() == expected


# ---------------------------------------------------------------------- allocation and refs
def test_constructor_validates():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0, 4)
    with pytest.raises(ValueError, match="block_size"):
        BlockPool(4, 0)


def test_allocate_pops_from_head_and_is_all_or_nothing():
    pool = BlockPool(5, 4)
    assert pool.free_block_ids() == [0, 1, 2, 3, 4]
    a = pool.allocate(2)
    assert ids(a) == [0, 1]
    assert [b.ref_cnt for b in a] == [1, 1]
    assert pool.free_block_ids() == [2, 3, 4]
    assert pool.num_free_blocks == 3 and pool.num_used_blocks == 2
    assert pool.usage == pytest.approx(0.4)
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(4)
    assert pool.free_block_ids() == [2, 3, 4]  # nothing taken by the failed call
    assert pool.allocate(0) == []
    with pytest.raises(ValueError):
        pool.allocate(-1)


def test_free_order_hashed_to_tail_unhashed_to_head():
    pool = BlockPool(6, 2)
    blocks = pool.allocate(4)  # 0..3; free queue [4, 5]
    pool.cache_block(blocks[0], b"h0")
    pool.cache_block(blocks[1], b"h1")
    pool.free(reversed(blocks))  # 3, 2 unhashed -> head; 1, 0 hashed -> tail
    assert pool.free_block_ids() == [2, 3, 4, 5, 1, 0]
    assert [b.ref_cnt for b in pool.blocks] == [0] * 6
    assert pool.usage == 0.0
    # Freed cached blocks stay reusable until evicted.
    assert pool.lookup(b"h0") is blocks[0] and pool.lookup(b"h1") is blocks[1]
    assert pool.num_cached_blocks == 2


def test_eviction_removes_hash_in_free_order():
    pool = BlockPool(3, 2)
    blocks = pool.allocate(3)
    for i, b in enumerate(blocks):
        pool.cache_block(b, f"h{i}".encode())
    pool.free(reversed(blocks))
    assert pool.free_block_ids() == [2, 1, 0]
    (first,) = pool.allocate(1)
    assert first.block_id == 2 and first.block_hash is None
    assert pool.lookup(b"h2") is None
    assert pool.lookup(b"h1") is blocks[1] and pool.lookup(b"h0") is blocks[0]
    assert pool.num_cached_blocks == 2
    assert ids(pool.allocate(2)) == [1, 0]
    assert pool.lookup(b"h1") is None and pool.lookup(b"h0") is None
    assert pool.num_cached_blocks == 0


def test_touch_takes_blocks_out_of_the_middle_of_the_free_queue():
    pool = BlockPool(4, 2)
    blocks = pool.allocate(4)
    for i, b in enumerate(blocks):
        pool.cache_block(b, bytes([i]))
    pool.free(blocks)  # in order: queue [0, 1, 2, 3]
    assert pool.free_block_ids() == [0, 1, 2, 3]
    pool.touch([blocks[2], blocks[1]])
    assert pool.free_block_ids() == [0, 3]
    assert blocks[1].ref_cnt == 1 and blocks[2].ref_cnt == 1
    pool.touch([blocks[1]])  # shared by a second sequence
    assert blocks[1].ref_cnt == 2 and pool.free_block_ids() == [0, 3]
    pool.free([blocks[1]])
    assert blocks[1].ref_cnt == 1 and pool.free_block_ids() == [0, 3]  # still held
    pool.free([blocks[1]])
    assert blocks[1].ref_cnt == 0 and pool.free_block_ids() == [0, 3, 1]
    assert blocks[1].block_hash == bytes([1])  # kept while free


def test_double_free_raises():
    pool = BlockPool(2, 2)
    (b,) = pool.allocate(1)
    pool.free([b])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free([b])


def test_cache_block_keeps_the_first_block_for_a_hash():
    pool = BlockPool(3, 2)
    a, b = pool.allocate(2)
    assert pool.cache_block(a, b"same") is True
    assert pool.cache_block(b, b"same") is False
    assert b.block_hash is None and pool.lookup(b"same") is a
    assert pool.cache_block(a, b"same") is True  # idempotent
    with pytest.raises(RuntimeError, match="different hash"):
        pool.cache_block(a, b"other")
    pool.free([b, a])
    assert pool.free_block_ids() == [1, 2, 0]  # unregistered duplicate is evicted first


def test_prefix_caching_disabled():
    pool = BlockPool(2, 2, enable_prefix_caching=False)
    (a,) = pool.allocate(1)
    assert pool.cache_block(a, b"h") is False
    assert a.block_hash is None and pool.lookup(b"h") is None
    pool.free([a])
    assert pool.free_block_ids() == [0, 1]  # unhashed blocks go to the head


def test_prefix_counters_and_reset():
    pool = BlockPool(2, 2)
    assert pool.prefix_cache_hit_rate == 0.0
    pool.record_prefix_lookup(10, 4)
    pool.record_prefix_lookup(6, 0)
    assert (pool.prefix_cache_queries, pool.prefix_cache_hits) == (16, 4)
    assert pool.prefix_cache_hit_rate == pytest.approx(0.25)
    (a,) = pool.allocate(1)
    pool.cache_block(a, b"h")
    assert pool.reset_prefix_cache() is False  # a block is in use
    assert pool.lookup(b"h") is a
    pool.free([a])
    assert pool.reset_prefix_cache() is True
    assert pool.lookup(b"h") is None and a.block_hash is None and pool.num_cached_blocks == 0
