"""The structured-output option of a request (vLLM's ``StructuredOutputsParams`` names).

Exactly one constraint is set: ``json`` (a JSON schema, as a dict or its JSON text), ``json_object`` (any JSON
object), ``regex``, ``grammar`` (Lark or GBNF text, as llguidance reads it) or ``choice`` (a list of strings).
``disable_any_whitespace`` makes JSON use one fixed spacing (``", "`` and ``": "``, no newlines) instead of any
whitespace between tokens, which keeps small models from spending their tokens on blank space. Only the shape is
checked here; whether a schema or regex compiles is known once the engine compiles it against
its tokenizer (``ssd/structured/grammar.py``), which raises ``ValueError`` naming the problem.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "json_object", "regex", "grammar", "choice")
FIELDS = (*KINDS, "disable_any_whitespace")


@dataclass(frozen=True)
class StructuredOutputs:
    json: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    grammar: str | None = None
    choice: tuple[str, ...] | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.choice, list):
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                f"structured outputs take exactly one of {', '.join(KINDS)}; got "
                f"{', '.join(given) if given else 'none'}"
            )
        for name in ("json_object", "disable_any_whitespace"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"structured outputs: {name} must be true or false, got {getattr(self, name)!r}")
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"structured outputs: json is not valid JSON: {exc}") from exc
            if not isinstance(schema, dict):
                raise ValueError(f"structured outputs: json must be a JSON schema object, got {type(schema).__name__}")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured outputs: {name} must be a non-empty string, got {value!r}")
        if self.choice is not None:
            if not isinstance(self.choice, tuple) or not self.choice or \
                    not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError(f"structured outputs: choice must be a non-empty list of non-empty strings, "
                                 f"got {self.choice!r}")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @classmethod
    def from_value(cls, value: StructuredOutputs | dict[str, Any]) -> StructuredOutputs:
        """Accept the dataclass itself or its fields as a dict (JSON request bodies)."""
        if isinstance(value, StructuredOutputs):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"structured_outputs must be an object with one of {', '.join(KINDS)}, got {value!r}")
        unknown = sorted(set(value) - set(FIELDS))
        if unknown:
            raise ValueError(f"structured_outputs has unknown fields {unknown}; known: {', '.join(FIELDS)}")
        return cls(**value)

    def to_json(self) -> str:
        """The set fields as JSON (what a draft worker receives); :meth:`from_json` reads it back."""
        return json.dumps({k: getattr(self, k) for k in FIELDS if getattr(self, k) not in (None, False)})

    @classmethod
    def from_json(cls, text: str) -> StructuredOutputs:
        return cls.from_value(json.loads(text))

    def schema_text(self) -> str:
        """The JSON schema to compile for ``json`` / ``json_object``."""
        if self.json_object:
            return '{"type": "object"}'
        return self.json if isinstance(self.json, str) else json.dumps(self.json)
