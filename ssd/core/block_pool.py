"""Paged KV block pool with a content-addressed prefix cache.

The KV cache is cut into fixed-size blocks. A block is *in use* while some sequence references it
(``ref_cnt > 0``) and *free* otherwise. A free block that once held a full block of computed tokens keeps its
content hash, so a later sequence with the same prefix can take it back instead of recomputing it; it stays
reusable until the allocator hands it out for something else (eviction). The free queue is therefore also
the eviction order: allocation always takes the head.

Pure Python on purpose: the pool is bookkeeping only (block ids and counts); the executor owns the tensors.
"""

from __future__ import annotations

import hashlib
import logging
import struct
import sys
from array import array
from collections import OrderedDict
from collections.abc import Iterable
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass

logger = logging.getLogger(__name__)

BlockHash = bytes

_HASH_PERSON = b"ssd-kv-block-v1"  # blake2b personalisation (<= 16 bytes): separates our hashes from others


def hash_block_tokens(
    parent_hash: BlockHash | None, token_ids: SequenceABC[int], extra: bytes = b""
) -> BlockHash:
    """Content hash of one block, chained on the hash of the block before it.

    Chaining makes a block's hash identify the whole prefix up to and including it, which is what KV reuse
    needs: the same tokens after a different prefix have different K/V. Built only from bytes (no Python
    ``hash()``), so it is the same in every process and run. Every field is length-prefixed, so no two
    different inputs serialise to the same byte string.
    """
    tokens = array("q", token_ids)
    if sys.byteorder == "big":  # fix the byte order so hashes agree across machines
        tokens.byteswap()
    h = hashlib.blake2b(digest_size=32, person=_HASH_PERSON)
    if parent_hash is None:
        h.update(b"\x00")
    else:
        h.update(b"\x01" + struct.pack("<I", len(parent_hash)) + parent_hash)
    h.update(struct.pack("<I", len(tokens)))
    h.update(tokens.tobytes())
    h.update(struct.pack("<I", len(extra)) + extra)
    return h.digest()


class NoFreeBlocksError(RuntimeError):
    """Raised when more blocks are requested than are free; callers are expected to check first."""


@dataclass(eq=False)
class KVBlock:
    """One block of KV slots. ``block_hash`` is set only while the block is registered in the prefix cache."""

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None


class BlockPool:
    """Fixed set of KV blocks, a free queue in eviction order and the prefix-cache map (hash -> block).

    Eviction order: a freed block that carries a hash goes to the tail (least recently used is evicted
    first). A freed block without a hash holds nothing reusable, so it goes to the head and is handed out
    again before any cached block is evicted; this keeps rejected-speculation churn (trim, then allocate
    again next round) from eating the prefix cache.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive integer, got {num_blocks!r}")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks: list[KVBlock] = [KVBlock(block_id=i) for i in range(num_blocks)]
        # OrderedDict gives O(1) pop at the head, append at either end and removal from the middle.
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[BlockHash, KVBlock] = {}
        # Prefix-cache statistics, in tokens.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # ------------------------------------------------------------------ allocation
    @property
    def num_free_blocks(self) -> int:
        """Blocks nobody references, including cached ones that can still be evicted."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by at least one sequence."""
        return self.num_used_blocks / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache (in use or free)."""
        return len(self._cached)

    def free_block_ids(self) -> list[int]:
        """Free blocks in eviction order, next to be allocated first (for tests and debugging)."""
        return list(self._free)

    def allocate(self, num_blocks: int) -> list[KVBlock]:
        """Take ``num_blocks`` blocks from the head of the free queue, evicting their cached content."""
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if num_blocks > len(self._free):
            raise NoFreeBlocksError(f"requested {num_blocks} KV blocks but only {len(self._free)} are free")
        out: list[KVBlock] = []
        for _ in range(num_blocks):
            _, block = self._free.popitem(last=False)
            if block.ref_cnt != 0:
                raise RuntimeError(f"block {block.block_id} is in the free queue with ref_cnt {block.ref_cnt}")
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block; unreferenced ones become free (see the class docstring).

        Callers pass a sequence's blocks last-first so that, among its cached blocks, the end of the sequence
        is evicted before its beginning (beginnings are the prefixes other requests share).
        """
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of KV block {block.block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block
                if block.block_hash is None:
                    self._free.move_to_end(block.block_id, last=False)

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Add one reference to each block (prefix-cache hit), taking free ones out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    # ------------------------------------------------------------------ prefix cache
    def lookup(self, block_hash: BlockHash) -> KVBlock | None:
        if not self.enable_prefix_caching:
            return None
        return self._cached.get(block_hash)

    def cache_block(self, block: KVBlock, block_hash: BlockHash) -> bool:
        """Register a block whose slots all hold computed K/V; returns whether it was registered.

        If another block already holds the same content (two sequences computed the same prefix before either
        was cached), the first one stays the cache entry and this block is left unregistered.
        """
        if not self.enable_prefix_caching:
            return False
        if block.block_hash is not None:
            if block.block_hash != block_hash:
                raise RuntimeError(f"block {block.block_id} is already cached under a different hash")
            return True
        if block_hash in self._cached:
            return False
        block.block_hash = block_hash
        self._cached[block_hash] = block
        return True

    def record_prefix_lookup(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_cache_queries += num_query_tokens
        self.prefix_cache_hits += num_hit_tokens

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash (e.g. after new weights); refused (False) while any block is in use."""
        if self.num_used_blocks:
            logger.warning("not resetting the prefix cache: %d blocks are still in use", self.num_used_blocks)
            return False
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()
        return True

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is None:
            return
        if self._cached.get(block.block_hash) is block:
            del self._cached[block.block_hash]
        block.block_hash = None
