"""The per-sequence state an in-process drafter keeps beside the target: a *mirror* sequence over the draft's own
KV blocks, sharing the target's token list (appended tokens are visible without copying), and a prompt lookup
over those tokens. Shared by the draft-model and EAGLE-3 proposers."""

from __future__ import annotations

from ssd.core.kv_cache_manager import KVCacheManager
from ssd.core.sequence import Sequence
from ssd.options import LookupConfig
from ssd.speculative.lookup import PromptLookup, new_lookup


class DraftMirrors:
    def __init__(self, kv_manager: KVCacheManager, lookup: LookupConfig | None = None) -> None:
        self.kv_manager = kv_manager
        self.lookup = lookup or LookupConfig(enabled=False)
        self.mirrors: dict[int, Sequence] = {}  # num_computed_tokens: what the drafter's cache holds
        self.lookups: dict[int, PromptLookup | None] = {}  # per sequence, over its token list

    def mirror(self, seq: Sequence) -> Sequence:
        """``seq``'s mirror, made on first use (reusing the draft cache's prefix where it has one)."""
        mirror = self.mirrors.get(seq.seq_id)
        if mirror is None:
            mirror = Sequence(seq.seq_id, seq.prompt_token_ids, seq.sampling_params, token_ids=seq.token_ids)
            self.kv_manager.allocate_prefix(mirror)
            self.mirrors[seq.seq_id] = mirror
            self.lookups[seq.seq_id] = new_lookup(self.lookup, seq.token_ids)
        return mirror

    def release(self, seq_id: int) -> None:
        mirror = self.mirrors.pop(seq_id, None)
        self.lookups.pop(seq_id, None)
        if mirror is not None:
            self.kv_manager.free(mirror)

    def clear(self) -> None:
        for seq_id in list(self.mirrors):
            self.release(seq_id)
