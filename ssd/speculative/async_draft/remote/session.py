"""What an engine and a remote draft server agree on when the engine connects (the HELLO message's settings).

The engine sends the draft options it resolved (those ``ssd/config.py`` declares for the draft worker), less
what the server decides for its own hardware (the draft model, its device, threads, dtype and weight format:
``ssd draft-serve``'s flags), with the target's sizes and a fingerprint of its vocabulary. The server turns
them into the same :class:`WorkerConfig` a local worker starts from, so a remote draft drafts exactly as a
local one with the same model would.
"""

from __future__ import annotations

import enum
import json
from dataclasses import asdict, dataclass
from typing import Any

from ssd.config import EngineConfig, SpeculativeConfig
from ssd.models.eagle3 import is_eagle3_head
from ssd.models.loader import load_arch_config
from ssd.options import FanOutChoice, Process, SpecMethod, options_for
from ssd.resolve import resolve_config
from ssd.runtime.model_runner import GraphOptions
from ssd.speculative.async_draft.worker import WorkerConfig
from ssd.speculative.draft_fit import draft_model_vocab, usable_tokens
from ssd.speculative.head_runner import head_feature_layers

SERVER_ENGINE_OPTIONS = ("model", "tokenizer")  # the server's: its draft model's folder (a head's: --target)
SERVER_SPEC_OPTIONS = ("model", "draft_device", "draft_threads", "draft_dtype", "draft_weight_format")


@dataclass(frozen=True)
class SessionSettings:
    """The HELLO message's settings: what the engine asks of a session."""

    engine_options: dict[str, Any]  # EngineConfig's draft-worker options, less SERVER_ENGINE_OPTIONS
    spec_options: dict[str, Any]  # SpeculativeConfig's draft-worker options, less SERVER_SPEC_OPTIONS
    max_model_len: int  # the target's
    num_blocks: int  # draft KV blocks the engine sized for its sequences and their branches
    target_vocab_size: int  # the target's embedding rows
    target_tokens: int  # the target tokenizer's size
    vocab_digest: str  # draft_fit.vocabulary_digest of the target's tokenizer
    max_num_seqs: int  # the most sequences the engine runs at once (the server's bound counts them)
    target_hidden_size: int  # the target's shape: an EAGLE-3 head on the server reads its features
    target_num_layers: int
    graphs: dict[str, Any] | None = None  # GraphOptions' fields (CUDA graphs on a CUDA draft), None: eager

    @classmethod
    def for_worker(cls, worker: WorkerConfig, target_tokens: int, vocab_digest: str) -> SessionSettings:
        """The settings of the worker the engine would start locally."""
        config, spec = worker.engine_config, worker.spec
        arch = load_arch_config(config.model)
        return cls(
            engine_options=_plain({k: v for k, v in options_for(config, Process.DRAFT_WORKER).items()
                                   if k not in SERVER_ENGINE_OPTIONS}),
            spec_options=_plain({k: v for k, v in options_for(spec, Process.DRAFT_WORKER).items()
                                 if k not in SERVER_SPEC_OPTIONS}),
            max_model_len=worker.max_model_len,
            num_blocks=worker.num_blocks,
            target_vocab_size=worker.target_vocab_size,
            target_tokens=target_tokens,
            vocab_digest=vocab_digest,
            max_num_seqs=config.max_num_seqs,
            target_hidden_size=arch.hidden_size,
            target_num_layers=arch.num_hidden_layers,
            graphs=None if worker.graphs is None else asdict(worker.graphs),
        )

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> SessionSettings:
        try:
            data = json.loads(text)
            return cls(**data)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"malformed session settings: {exc}") from None


@dataclass(frozen=True)
class ServerDraft:
    """What a draft server decides itself: its model and how it runs it."""

    model: str
    device: str = "cpu"
    threads: int | None = None
    dtype: str | None = None  # None: the draft's "auto" for its device
    weight_format: str = "auto"
    vocab_digest: str = ""  # of the model folder's tokenizer (a head's: the target's)
    tokens: int = 0  # that tokenizer's size
    target: str | None = None  # an EAGLE-3 head's target checkpoint folder (its embedding, tokenizer, layers)


def worker_config(settings: SessionSettings, draft: ServerDraft) -> WorkerConfig:
    """The worker a session runs: the engine's options with the server's model and hardware; ValueError (with
    the reason) when they do not fit, e.g. a draft whose vocabulary differs from the target's."""
    same_vocabulary = settings.vocab_digest == draft.vocab_digest
    if draft.target is None:
        usable = usable_tokens(same_vocabulary, settings.target_tokens, draft.tokens, settings.target_vocab_size,
                               draft_model_vocab(draft.model))
    else:  # an EAGLE-3 head: the engine's target must be the server's, whose features and embedding it reads
        arch = load_arch_config(draft.target)
        theirs = (settings.target_hidden_size, settings.target_num_layers)
        if not same_vocabulary or theirs != (arch.hidden_size, arch.num_hidden_layers):
            raise ValueError(f"the engine's target (hidden size {theirs[0]}, {theirs[1]} layers, "
                             f"{settings.target_tokens} tokens) is not the head's target {draft.target} (hidden size "
                             f"{arch.hidden_size}, {arch.num_hidden_layers} layers, {draft.tokens} tokens"
                             f"{'' if same_vocabulary else ', another vocabulary'})")
        usable = settings.target_vocab_size  # the head's draft vocabulary (d2t) says which ids it proposes
    spec = SpeculativeConfig(method=SpecMethod.SSD, model=draft.model, draft_device=draft.device,
                             draft_threads=draft.threads, draft_dtype=draft.dtype,
                             draft_weight_format=draft.weight_format, **settings.spec_options)
    config = resolve_config(EngineConfig(model=draft.target or draft.model, device=draft.device,
                                         speculative_config=spec, **settings.engine_options))
    return WorkerConfig(
        engine_config=config,
        device=draft.device,
        max_model_len=settings.max_model_len,
        num_blocks=settings.num_blocks,
        target_vocab_size=settings.target_vocab_size,
        num_usable_tokens=usable,
        graphs=None if settings.graphs is None else GraphOptions(**settings.graphs),
    )


def head_layers(config: WorkerConfig) -> tuple[int, ...] | None:
    """The target layers whose features a session's EAGLE-3 head reads (None: a draft model)."""
    if not is_eagle3_head(config.spec.model):
        return None
    return head_feature_layers(config.spec, load_arch_config(config.engine_config.model))


def _plain(options: dict[str, Any]) -> dict[str, Any]:
    """Option values as JSON scalars that the config classes parse back (choices by value, fan-outs by text)."""
    out: dict[str, Any] = {}
    for name, value in options.items():
        if isinstance(value, enum.Enum):
            value = value.value
        elif isinstance(value, FanOutChoice):
            value = str(value)
        out[name] = value
    return out
