"""Per-sequence KV block bookkeeping on top of a :class:`BlockPool`.

A sequence's block table (``seq.block_table``, block ids in logical order) maps its token positions to KV
slots: position ``p`` lives in block ``block_table[p // block_size]`` at offset ``p % block_size``. The
manager grows the table ahead of computation (including *lookahead* slots for draft tokens that are not in
``token_ids`` yet), registers blocks in the prefix cache once every slot in them holds computed K/V of real
tokens, and shrinks the table again when speculation is rejected.

One manager per KV cache: the draft model gets its own pool and manager. Each manager reads and writes the
``token_ids``, ``num_computed_tokens`` and ``block_table`` of the objects it is given, so a draft-side manager
must be given the draft's own per-request state objects (e.g. a mirror :class:`Sequence` per request), never
the target's.

Assumes ``token_ids`` only ever grow (tokens are appended, never rewritten); block hashes are computed once
per full block and reused.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from ssd.core.block_pool import BlockHash, BlockPool, KVBlock, hash_block_tokens
from ssd.core.sequence import Sequence

logger = logging.getLogger(__name__)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class _SeqKVState:
    block_hashes: list[BlockHash] = field(default_factory=list)  # of full blocks of token_ids, in order
    num_cached_blocks: int = 0  # leading blocks of the table already offered to the prefix cache


class KVCacheManager:
    """Owns the mapping from sequences to blocks of one pool; all-or-nothing allocation."""

    def __init__(self, pool: BlockPool) -> None:
        self.pool = pool
        self._states: dict[int, _SeqKVState] = {}

    # ------------------------------------------------------------------ stats
    @property
    def block_size(self) -> int:
        return self.pool.block_size

    @property
    def num_total_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.pool.prefix_cache_hit_rate

    def num_blocks_for_tokens(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.pool.block_size)

    # ------------------------------------------------------------------ prefix cache
    def find_cached_prefix(self, seq: Sequence) -> int:
        """Tokens of ``seq`` (a multiple of the block size) whose K/V the cache holds; no side effects.

        Capped below ``seq.num_tokens``: the model must still run at least one token to produce logits.
        """
        return len(self._cached_prefix_blocks(seq)) * self.pool.block_size

    def can_admit(self, seq: Sequence, num_new_tokens: int, num_lookahead_tokens: int = 0) -> bool:
        """Whether :meth:`allocate_prefix` followed by :meth:`allocate_slots` would succeed.

        ``num_new_tokens`` counts tokens after the cached prefix. Cached blocks nobody holds sit in the free
        queue, so taking them costs free blocks too; this is why admission needs its own check.
        """
        self._require_unallocated(seq, "can_admit")
        blocks = self._cached_prefix_blocks(seq)
        num_cached_tokens = len(blocks) * self.pool.block_size
        total_blocks = cdiv(num_cached_tokens + num_new_tokens + num_lookahead_tokens, self.pool.block_size)
        num_new_blocks = max(0, total_blocks - len(blocks))
        num_revived = sum(1 for b in blocks if b.ref_cnt == 0)
        return num_new_blocks + num_revived <= self.pool.num_free_blocks

    def allocate_prefix(self, seq: Sequence) -> int:
        """Take the cached prefix for a sequence holding no KV; returns its length in tokens.

        Sets ``block_table``, ``num_computed_tokens`` and ``num_cached_prompt_tokens``.
        """
        self._require_unallocated(seq, "allocate_prefix")
        blocks = self._cached_prefix_blocks(seq)
        self.pool.touch(blocks)
        seq.block_table.extend(b.block_id for b in blocks)
        num_cached_tokens = len(blocks) * self.pool.block_size
        seq.num_computed_tokens = num_cached_tokens
        seq.num_cached_prompt_tokens = num_cached_tokens
        self._state(seq).num_cached_blocks = len(blocks)
        if self.pool.enable_prefix_caching:
            self.pool.record_prefix_lookup(seq.num_tokens, num_cached_tokens)
        return num_cached_tokens

    def cache_full_blocks(self, seq: Sequence) -> int:
        """Register blocks whose slots all hold computed K/V of real tokens; returns how many were offered.

        Only positions below ``num_computed_tokens`` (and inside ``token_ids``) count, so slots written for
        lookahead draft tokens never enter the cache.
        """
        if not self.pool.enable_prefix_caching:
            return 0
        state = self._state(seq)
        num_full = min(min(seq.num_computed_tokens, seq.num_tokens) // self.pool.block_size, len(seq.block_table))
        if num_full <= state.num_cached_blocks:
            return 0
        hashes = self._block_hashes(seq, num_full)
        for i in range(state.num_cached_blocks, num_full):
            self.pool.cache_block(self.pool.blocks[seq.block_table[i]], hashes[i])
        offered = num_full - state.num_cached_blocks
        state.num_cached_blocks = num_full
        return offered

    # ------------------------------------------------------------------ slots
    def num_blocks_needed(self, seq: Sequence, num_new_tokens: int, num_lookahead_tokens: int = 0) -> int:
        """Blocks to add so the table covers computed + new + lookahead tokens."""
        total = seq.num_computed_tokens + num_new_tokens + num_lookahead_tokens
        return max(0, cdiv(total, self.pool.block_size) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int, num_lookahead_tokens: int = 0) -> bool:
        return self.num_blocks_needed(seq, num_new_tokens, num_lookahead_tokens) <= self.pool.num_free_blocks

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, num_lookahead_tokens: int = 0) -> bool:
        """Extend the block table to cover the next tokens; allocates nothing and returns False if short."""
        if num_new_tokens < 0 or num_lookahead_tokens < 0:
            raise ValueError(
                f"token counts must be >= 0, got num_new_tokens={num_new_tokens}, "
                f"num_lookahead_tokens={num_lookahead_tokens}"
            )
        needed = self.num_blocks_needed(seq, num_new_tokens, num_lookahead_tokens)
        if needed > self.pool.num_free_blocks:
            return False
        if needed:
            seq.block_table.extend(b.block_id for b in self.pool.allocate(needed))
        return True

    def trim(self, seq: Sequence) -> int:
        """Free blocks past the ones the sequence's tokens need (after rejected speculation); returns count.

        The pending token keeps its slot: ``ceil(num_tokens / block_size)`` blocks stay.
        """
        keep = cdiv(seq.num_tokens, self.pool.block_size)
        extra = seq.block_table[keep:]
        if not extra:
            return 0
        self.pool.free(self.pool.blocks[i] for i in reversed(extra))
        del seq.block_table[keep:]
        state = self._states.get(seq.seq_id)
        if state is not None:
            state.num_cached_blocks = min(state.num_cached_blocks, keep)
        return len(extra)

    def free(self, seq: Sequence) -> None:
        """Release every block (last first, so the sequence's tail is evicted first) and forget the sequence.

        ``num_computed_tokens`` is left to the caller (the scheduler resets it on preemption).
        """
        if seq.block_table:
            self.pool.free(self.pool.blocks[i] for i in reversed(seq.block_table))
            seq.block_table.clear()
        self._states.pop(seq.seq_id, None)

    # ------------------------------------------------------------------ internals
    def _state(self, seq: Sequence) -> _SeqKVState:
        state = self._states.get(seq.seq_id)
        if state is None:
            state = self._states[seq.seq_id] = _SeqKVState()
        return state

    def _block_hashes(self, seq: Sequence, num_blocks: int) -> list[BlockHash]:
        """Hashes of the first ``num_blocks`` full blocks of ``token_ids``, extending the memo as needed."""
        hashes = self._state(seq).block_hashes
        bs = self.pool.block_size
        while len(hashes) < num_blocks:
            i = len(hashes)
            tokens = seq.token_ids[i * bs : (i + 1) * bs]
            if len(tokens) != bs:
                raise RuntimeError(f"block {i} of sequence {seq.seq_id} is not full; cannot hash it")
            hashes.append(hash_block_tokens(hashes[-1] if hashes else None, tokens))
        return hashes

    def _cached_prefix_blocks(self, seq: Sequence) -> list[KVBlock]:
        if not self.pool.enable_prefix_caching or seq.num_tokens <= 1:
            return []
        max_blocks = (seq.num_tokens - 1) // self.pool.block_size
        out: list[KVBlock] = []
        for i in range(max_blocks):  # hash lazily: a miss on block 0 should not hash a long prompt
            block = self.pool.lookup(self._block_hashes(seq, i + 1)[i])
            if block is None:
                break
            out.append(block)
        return out

    def _require_unallocated(self, seq: Sequence, what: str) -> None:
        if seq.block_table or seq.num_computed_tokens:
            raise RuntimeError(
                f"{what} needs a sequence holding no KV; sequence {seq.seq_id} has "
                f"{len(seq.block_table)} blocks and {seq.num_computed_tokens} computed tokens"
            )
