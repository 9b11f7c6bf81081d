"""The option vocabulary: the type of every engine and speculative option, and how an option is declared.

Standard library only (importing it, or ``ssd.config``, loads no torch): the command line, the server and the
configuration read their options from here, and the modules that implement an option import its type from
here, never the other way round.

- Enumerations for the options with a fixed set of values (:class:`SpecMethod`, :class:`Fallback`,
  :class:`FillerPadding`, :class:`WeightFormat`, :class:`AdaptiveMode`, :class:`Dtype`). They are ``str``
  enums, so ``WeightFormat.DENSE == "dense"`` and a user may pass either spelling.
- :class:`FanOutChoice`, the SSD fan-out as a tagged value, parsed once where it enters (a dict, a flag).
- :class:`LookupConfig`, prompt lookup's three settings as one record.
- :func:`option`: a dataclass field declared with its help text, the processes that read it and its command
  line spelling. The configuration dataclasses (``ssd/config.py``) declare every field this way, so one
  declaration is the table the command line flags and the per-process settings are generated from
  (:func:`option_fields`, :func:`options_for`).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Callable, ClassVar
from urllib.parse import urlsplit


class _Choice(str, enum.Enum):
    """A string-valued choice; ``str(x)`` and ``repr(x)`` show its value (what the user writes)."""

    def __str__(self) -> str:
        return self.value

    def __repr__(self) -> str:
        return repr(self.value)

    @classmethod
    def parse(cls, value: object, name: str):
        """``value`` (a member or its spelling) as a member, or a ValueError naming the option and the choices."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"{name} {value!r} is not supported: {name} must be one of {cls.values()}") from None

    @classmethod
    def values(cls) -> list[str]:
        return [m.value for m in cls]


class SpecMethod(_Choice):
    DRAFT_MODEL = "draft_model"  # ordinary speculative decoding with a draft model
    SSD = "ssd"  # speculative speculative decoding: the draft in its own process
    NGRAM = "ngram"  # prompt lookup alone, no draft model
    EAGLE3 = "eagle3"  # an EAGLE-3 head reading the target's hidden states, in the engine's process


class Fallback(_Choice):
    """What serves an SSD cache miss: the draft drafts just in time, a random filler, or the measured best."""

    JIT = "jit"
    RANDOM = "random"
    AUTO = "auto"


class FillerPadding(_Choice):
    """What a random filler holds past prompt lookup's copies: nothing, the pending token repeated up to K, or
    ``auto`` (nothing on CPU, where each verified position costs the target time; repeat on CUDA)."""

    NONE = "none"
    REPEAT = "repeat"
    AUTO = "auto"


class WeightFormat(_Choice):
    """How a model's projections hold their weights (``ssd/models/weight_formats.py``)."""

    DENSE = "dense"
    FP16_PACKED = "fp16-packed"
    INT8_PACKED = "int8-packed"  # drafts only
    W8A8 = "w8a8"  # int8 weights and per-row int8 activations; targets use row-invariant attention with it
    Q8_0 = "q8_0"  # GGUF's blocks of 32 int8 weights, activations in blocks of 32 too (a C++ kernel)
    Q4_0 = "q4_0"  # GGUF's blocks of 32 4-bit weights (LM head in q8_0), activations as for q8_0
    Q4_1 = "q4_1"  # the same with a float16 minimum per block (w = d * q + m), as GGUF's Q4_1
    GGUF = "gguf"  # the blocks a GGUF import kept (keep_blocks) as stored, LM head in q8_0
    AUTO = "auto"


BLOCK_WEIGHT_FORMATS = (WeightFormat.Q8_0, WeightFormat.Q4_0, WeightFormat.Q4_1, WeightFormat.GGUF)  # C++ kernel
TARGET_WEIGHT_FORMATS = (WeightFormat.DENSE, WeightFormat.FP16_PACKED, WeightFormat.W8A8, *BLOCK_WEIGHT_FORMATS,
                         WeightFormat.AUTO)
PACKED_WEIGHT_FORMATS = (WeightFormat.FP16_PACKED, WeightFormat.INT8_PACKED, WeightFormat.W8A8,
                         *BLOCK_WEIGHT_FORMATS)
# Formats that quantize each product's input: a target in one computes attention with the row-invariant kernel,
# so that a token's activations, and their rounding, are the same in every kind of step.
ACTIVATION_QUANTIZED_FORMATS = (WeightFormat.W8A8, *BLOCK_WEIGHT_FORMATS)


class AdaptiveMode(_Choice):
    """Adaptive lookahead: always (``on``), never (``off``), or ``auto`` (``ssd/speculative/lookahead.py``)."""

    ON = "on"
    OFF = "off"
    AUTO = "auto"

    @classmethod
    def parse(cls, value: object, name: str = "adaptive_lookahead"):
        if value is True:
            return cls.ON
        if value is False:
            return cls.OFF
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"{name} must be True, False or 'auto' (or 'on' / 'off'), got {value!r}") from None


class Dtype(_Choice):
    """Model dtypes by name; ``auto`` is resolved for the device (``ssd/dtypes.py``)."""

    AUTO = "auto"
    BFLOAT16 = "bfloat16"
    FLOAT32 = "float32"
    FLOAT16 = "float16"


def is_int(value: object) -> bool:
    """True for real integers; bools are rejected because ``True`` as a count is always a bug."""
    return isinstance(value, int) and not isinstance(value, bool)


class FanOutKind(_Choice):
    UNIFORM = "uniform"  # F candidates at every acceptance length
    PER_K = "per_k"  # F_0..F_K given
    AUTO = "auto"  # geometric allocation from online estimates
    DYNAMIC = "dynamic"  # each sequence's likeliest outcomes


@dataclass(frozen=True)
class FanOutChoice:
    """An SSD fan-out as the user gave it: ``uniform`` F >= 1, ``per_k`` F_0..F_K (ints >= 0, one > 0),
    ``auto`` or ``dynamic`` (``ssd/speculative/async_draft/planning/fanout.py`` turns it into a policy for a
    given K)."""

    kind: FanOutKind
    values: tuple[int, ...] = ()

    ALLOWED: ClassVar[str] = "an int >= 1, a list of K + 1 ints >= 0 (at least one > 0), 'auto' or 'dynamic'"

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", FanOutKind(self.kind))
        object.__setattr__(self, "values", tuple(self.values))
        if self.kind is FanOutKind.UNIFORM:
            if len(self.values) != 1 or not is_int(self.values[0]) or self.values[0] < 1:
                raise ValueError(f"a uniform fan_out must be >= 1, got {self.values}; allowed: {self.ALLOWED}")
        elif self.kind is FanOutKind.PER_K:
            for k, f in enumerate(self.values):
                if not is_int(f) or f < 0:
                    raise ValueError(f"fan-out entries must be integers >= 0, got F_{k} = {f!r}")
            if not any(self.values):
                raise ValueError(f"at least one fan-out entry must be > 0, got {list(self.values)}")
        elif self.values:
            raise ValueError(f"fan_out {self.kind.value!r} takes no values, got {list(self.values)}")

    @classmethod
    def parse(cls, value: "FanOutChoice | int | Sequence[int] | str") -> "FanOutChoice":
        """The choice for a user's value: an int, a list, ``"auto"``, ``"dynamic"``, or their command line
        spellings ``"3"`` and ``"4,2,1,1,0"``."""
        if isinstance(value, FanOutChoice):
            return value
        if isinstance(value, str):
            text = value.strip().lower()
            if text in (FanOutKind.AUTO.value, FanOutKind.DYNAMIC.value):
                return cls(FanOutKind(text))
            try:
                parts = [int(p) for p in text.split(",")]
            except ValueError:
                raise ValueError(f"fan_out must be {cls.ALLOWED}, got {value!r}") from None
            value = parts[0] if len(parts) == 1 and "," not in text else parts
        if is_int(value):
            return cls(FanOutKind.UNIFORM, (value,))  # type: ignore[arg-type]
        if isinstance(value, (list, tuple)):
            return cls(FanOutKind.PER_K, tuple(value))
        raise ValueError(f"fan_out must be {cls.ALLOWED}, got {value!r}")

    @property
    def adjustable(self) -> bool:
        """Whether the choice takes a branch budget (``auto`` and ``dynamic``); fixed ones are their own sum."""
        return self.kind in (FanOutKind.AUTO, FanOutKind.DYNAMIC)

    def per_k(self, K: int) -> list[int]:
        """F_0..F_K of a fixed choice for K."""
        if self.kind is FanOutKind.UNIFORM:
            return [self.values[0]] * (K + 1)
        if self.kind is FanOutKind.PER_K:
            if len(self.values) != K + 1:
                raise ValueError(f"fan_out list must have K + 1 = {K + 1} entries (F_0..F_{K}), got "
                                 f"{len(self.values)}: {list(self.values)}")
            return list(self.values)
        raise ValueError(f"fan_out {self.kind.value!r} has no fixed F_0..F_K")

    def __str__(self) -> str:
        if self.kind is FanOutKind.UNIFORM:
            return str(self.values[0])
        if self.kind is FanOutKind.PER_K:
            return ",".join(map(str, self.values))
        return self.kind.value


@dataclass(frozen=True)
class LookupConfig:
    """Prompt lookup (``ssd/speculative/lookup.py``): ``min_n`` <= match length counted up to ``max_n`` tokens;
    ``enabled=False`` turns it off."""

    enabled: bool = True
    min_n: int = 2
    max_n: int = 8

    def __post_init__(self) -> None:
        if not is_int(self.min_n) or self.min_n < 1:
            raise ValueError(f"prompt_lookup_min must be an integer >= 1, got {self.min_n!r}")
        if not is_int(self.max_n) or self.max_n < self.min_n:
            raise ValueError(f"prompt_lookup_max must be an integer >= prompt_lookup_min, got {self.max_n!r}")


class Process(_Choice):
    """Who reads an option. The engine reads every option; these say which other processes need it."""

    TARGET_RANK = "target rank"  # tensor-parallel ranks 1.. (``ssd/distributed/worker.py: RunnerArgs``)
    DRAFT_WORKER = "draft worker"  # SSD's draft process (``ssd/speculative/async_draft/worker.py``)


@dataclass(frozen=True)
class OptionInfo:
    """What a field declares besides its type and default.

    ``flags``: command line spellings (default ``--field-name``);
    ``parse``: turns a flag's text into the value (default: the field's type for ``int``, ``float`` and
    ``str``; a bool is a ``--x / --no-x`` pair); ``choices``: the allowed spellings; ``const``: the value of
    the flag given without an argument; ``processes``: besides the engine; ``cli_default``: where the command
    line's default differs from the library's (the ``ssd`` command speculates with SSD by default);
    ``off_flags``: further spellings that turn a bool off."""

    help: str
    processes: tuple[Process, ...] = ()
    flags: tuple[str, ...] | None = None
    parse: Callable[[str], Any] | None = None
    choices: tuple[str, ...] | None = None
    const: str | None = None
    cli_default: Any = None  # None: the field's default
    off_flags: tuple[str, ...] = ()  # a bool's further spellings for False


def option(default: Any = dataclasses.MISSING, help: str = "", *, processes: Sequence[Process] = (),
           flags: Sequence[str] | None = None, parse: Callable[[str], Any] | None = None,
           choices: Sequence[str] | None = None, const: str | None = None,
           cli_default: Any = None, off_flags: Sequence[str] = ()) -> Any:
    """A dataclass field that is an option: its default, help text, readers and command line spelling."""
    info = OptionInfo(help, tuple(processes), None if flags is None else tuple(flags), parse,
                      None if choices is None else tuple(choices), const,
                      cli_default, tuple(off_flags))
    return dataclasses.field(default=default, metadata={"option": info})


def option_fields(config_class: type) -> Iterator[tuple[dataclasses.Field, OptionInfo]]:
    """The declared options of a configuration dataclass, in declaration order."""
    for f in dataclasses.fields(config_class):
        info = f.metadata.get("option")
        if info is not None:
            yield f, info


def option_help(config_class: type, name: str) -> str:
    """The help text declared for option ``name`` of ``config_class``."""
    for f, info in option_fields(config_class):
        if f.name == name:
            return info.help
    raise KeyError(f"{config_class.__name__} declares no option {name!r}")


def options_for(config: Any, process: Process) -> dict[str, Any]:
    """The values of ``config``'s options that ``process`` reads, by field name."""
    return {f.name: getattr(config, f.name) for f, info in option_fields(type(config)) if process in info.processes}


def parse_draft_url(url: str) -> tuple[str, int]:
    """``tcp://HOST:PORT`` -> (host, port); a clear ValueError for anything else."""
    parts = urlsplit(url)
    if parts.scheme != "tcp" or not parts.hostname or parts.path not in ("", "/") or parts.query:
        raise ValueError(f"draft_url must look like tcp://HOST:PORT, got {url!r}")
    try:
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"draft_url {url!r}: {exc}") from None
    if port is None or port == 0:
        raise ValueError(f"draft_url {url!r} needs a port")
    return parts.hostname, port
