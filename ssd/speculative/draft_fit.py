"""Whether a draft model fits its target, and how much KV cache it needs beside it: shared by the proposers
that run a draft model (SD in the engine's process, SSD in a worker of its own)."""

from __future__ import annotations

import hashlib
import json
import logging

from ssd.config import EngineConfig
from ssd.core.kv_cache_manager import cdiv
from ssd.models.draft_vocab import DraftVocab
from ssd.models.loader import load_arch_config
from ssd.speculative.proposal import TargetFacts
from ssd.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


def check_vocabularies(target: Tokenizer, draft: Tokenizer, target_vocab: int, draft_vocab: int) -> int:
    """Return the number of token ids both sides can produce; raise if the vocabularies differ.

    Model vocabularies may be padded past the tokenizer (rows no token id reaches); any other difference
    would make draft token ids mean different text to the target.
    """
    return usable_tokens(target.get_vocab() == draft.get_vocab(), len(target), len(draft), target_vocab,
                         draft_vocab)


def usable_tokens(same_vocabulary: bool, target_tokens: int, draft_tokens: int, target_vocab: int,
                  draft_vocab: int) -> int:
    """:func:`check_vocabularies` once the tokenizers are compared (here or, for a remote draft, by digest):
    ``*_tokens`` the tokenizers' sizes, ``*_vocab`` the models' embedding rows."""
    if not same_vocabulary:
        raise ValueError(
            f"draft and target tokenizers differ (target has {target_tokens} tokens, draft {draft_tokens}); "
            "speculative decoding needs the same vocabulary"
        )
    usable = target_tokens
    if usable > target_vocab or usable > draft_vocab:
        raise ValueError(
            f"tokenizer has {usable} tokens but the target's embedding has {target_vocab} rows and the draft's "
            f"{draft_vocab}; both must cover every token id"
        )
    if target_vocab != draft_vocab:
        logger.info("target vocab %d and draft vocab %d differ only by padding rows", target_vocab, draft_vocab)
    return usable


def vocabulary_digest(tokenizer: Tokenizer) -> str:
    """A fingerprint of the token -> id map: equal digests mean equal vocabularies (a remote draft server
    compares them without the target's tokenizer)."""
    items = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    return hashlib.sha256(json.dumps(items, ensure_ascii=False).encode("utf-8")).hexdigest()


def draft_model_vocab(draft_path: str) -> int:
    """The draft's embedding rows, in target ids (a reduced-vocabulary draft maps into the target's)."""
    draft_vocab = DraftVocab.load(draft_path)
    return draft_vocab.target_vocab_size if draft_vocab is not None else load_arch_config(draft_path).vocab_size


def check_draft_vocabulary(tokenizer: Tokenizer, target: TargetFacts, draft_path: str) -> int:
    """Token ids both models can produce, read from the draft folder's tokenizer and config only (before
    paying for loading the weights)."""
    draft_vocab = draft_model_vocab(draft_path)  # first: a missing folder is reported as such
    return check_vocabularies(tokenizer, Tokenizer(draft_path), target.vocab_size, draft_vocab)


def draft_num_blocks(config: EngineConfig, target: TargetFacts, extra_tokens_per_seq: int) -> int:
    """Enough draft blocks to never run out before the target does (own scratch per running sequence)."""
    return target.num_kv_blocks + config.max_num_seqs * (cdiv(extra_tokens_per_seq, config.block_size) + 1)
