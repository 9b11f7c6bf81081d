"""Command line flags generated from the configuration's option declarations (``ssd/options.py: option``).

Each declared option becomes one flag: ``--field-name`` unless the declaration spells it otherwise, a
``--x / --no-x`` pair for a bool, the enumeration's values as the choices of an enum, the declared parser for
anything else. The flag's value lands in ``args`` under the flag's own name (``--draft`` -> ``args.draft``) and
:func:`options_from_args` gives it back under the field's name, ready for the configuration dataclass.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import types
import typing
from typing import Any

from ssd.options import OptionInfo, option_fields


def add_option_flags(group: Any, config_class: type) -> None:
    """Add a flag to ``group`` (a parser or an argument group) for every option of ``config_class``."""
    hints = typing.get_type_hints(config_class)
    for f, info in option_fields(config_class):
        value_type = _value_type(hints[f.name])
        default = info.cli_default if info.cli_default is not None else f.default
        if default is dataclasses.MISSING:  # a required field (the model): the command fills it in
            default = None
        kwargs: dict[str, Any] = dict(dest=_dest(f, info), default=default, help=info.help)
        if value_type is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
            kwargs["help"] += f" (default: {'on' if default else 'off'})"
        else:
            if isinstance(value_type, type) and issubclass(value_type, enum.Enum):
                kwargs["type"] = value_type
                kwargs["choices"] = [value_type(c) for c in info.choices] if info.choices else list(value_type)
                if info.const is not None:
                    kwargs.update(nargs="?", const=value_type(info.const))
            else:
                kwargs["type"] = info.parse or value_type
            if default is not None:
                kwargs["help"] += " (default: %(default)s)"
        group.add_argument(*_flags(f, info), **kwargs)
        for flag in info.off_flags:
            group.add_argument(flag, dest=kwargs["dest"], action="store_false",
                               help=f"the same as --no-{_flags(f, info)[0].lstrip('-')}")


def options_from_args(args: argparse.Namespace, config_class: type) -> dict[str, Any]:
    """The options of ``config_class`` that ``args`` holds (parsed with :func:`add_option_flags`), by field."""
    return {f.name: getattr(args, _dest(f, info)) for f, info in option_fields(config_class)}


def _flags(f: dataclasses.Field, info: OptionInfo) -> tuple[str, ...]:
    return info.flags or ("--" + f.name.replace("_", "-"),)


def _dest(f: dataclasses.Field, info: OptionInfo) -> str:
    return _flags(f, info)[0].lstrip("-").replace("-", "_")


def _value_type(hint: Any) -> Any:
    """The type a flag parses to: the hint itself, or its one type besides None (``int | None`` -> ``int``);
    ``str`` where several remain (the declaration's parser takes the text)."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        members = [a for a in typing.get_args(hint) if a is not type(None)]
        return members[0] if len(members) == 1 else str
    return hint
