"""Command-line flags made from config dataclasses, so that a flag's default, type and choices live once: in the field.

A field becomes a flag when its metadata holds ``flag(...)`` (its help, and a name or choices where the field's own
do not fit). ``add_flags`` adds a dataclass's flagged fields, and those of the config dataclasses nested in it, to an
argparse parser; ``from_args`` builds the dataclass back from the parsed flags. mini-sglang's ``ServerArgs`` and
vLLM's ``EngineArgs`` work the same way. This module imports nothing heavy: the CLI parses flags without torch."""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable, Iterator
from typing import Any

_FLAG = "serval.flag"
# The argparse type of a field's annotation (``from __future__ import annotations`` keeps annotations as text). A str
# field takes argparse's own (None), so that a parsed flag is exactly the text given.
_TYPES: dict[str, Callable | None] = {"int": int, "float": float, "str": None}


@dataclasses.dataclass(frozen=True)
class Flag:
    """How a config field appears on the command line."""

    help: str
    name: str | None = None  # None: --field-name
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    type: Callable[[str], Any] | None = None  # None: from the field's annotation
    action: str | None = None  # e.g. "append" for a repeatable flag; a bool field is a switch on its own


def flag(help: str, *, name: str | None = None, choices: tuple[str, ...] | None = None, metavar: str | None = None,
         type: Callable[[str], Any] | None = None, action: str | None = None) -> dict:
    """A field's metadata that makes it a flag: ``x: int = field(default=1, metadata=flag("what x is"))``."""
    return {_FLAG: Flag(help, name, choices, metavar, type, action)}


def flag_of(field: dataclasses.Field) -> Flag | None:
    return field.metadata.get(_FLAG)


def flag_name(field: dataclasses.Field) -> str:
    """The field's option string, e.g. ``--max-num-seqs``."""
    spec = flag_of(field)
    return (spec.name if spec and spec.name else "--" + field.name.replace("_", "-"))


def flag_dest(field: dataclasses.Field) -> str:
    """Where argparse keeps the field's value: the flag's name as an identifier (``args.max_num_seqs``)."""
    return flag_name(field).removeprefix("--").replace("-", "_")


def nested_config(field: dataclasses.Field) -> type | None:
    """The config dataclass a field holds (``EngineConfig.cache`` holds a CacheConfig), whose flags are its own."""
    factory = field.default_factory
    return factory if isinstance(factory, type) and dataclasses.is_dataclass(factory) else None


def field_default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    raise TypeError(f"{field.name} has no default: a flag needs one")


def flagged_fields(config: type | Any, exclude: tuple[str, ...] = ()) -> Iterator[tuple[dataclasses.Field, Any]]:
    """(field, default) of each flagged field of ``config`` (a dataclass, or an instance whose values are the
    defaults), nested configs' included, leaving out the fields (nested configs included) named in ``exclude``."""
    for field in dataclasses.fields(config):
        if field.name in exclude:
            continue
        nested = nested_config(field)
        if nested is not None and flag_of(field) is None:
            yield from flagged_fields(nested if isinstance(config, type) else getattr(config, field.name), exclude)
        elif flag_of(field) is not None:
            yield field, field_default(field) if isinstance(config, type) else getattr(config, field.name)


def add_flags(parser: argparse.ArgumentParser, config: type | Any, exclude: tuple[str, ...] = ()) -> None:
    """Adds a flag for each flagged field of ``config`` (a dataclass, or an instance of one whose values are this
    parser's defaults, e.g. a verb that listens on another port), with the field's default, type and choices."""
    for field, default in flagged_fields(config, exclude):
        spec = flag_of(field)
        kwargs: dict[str, Any] = {"default": default, "help": spec.help}
        annotation = str(field.type).replace(" | None", "")
        if annotation == "bool":
            # A switch that is on by default, or left to the device (None), can be turned off as well as on.
            kwargs["action"] = argparse.BooleanOptionalAction if default or default is None else "store_true"
        elif spec.action is not None:
            kwargs["action"] = spec.action
        elif spec.type is not None:
            kwargs["type"] = spec.type
        elif annotation not in _TYPES:
            raise TypeError(f"flag {flag_name(field)}: no argparse type for {field.type!r}; give flag(type=...)")
        elif _TYPES[annotation] is not None:
            kwargs["type"] = _TYPES[annotation]
        if spec.choices is not None:
            kwargs["choices"] = list(spec.choices)
        if spec.metavar is not None:
            kwargs["metavar"] = spec.metavar
        parser.add_argument(flag_name(field), **kwargs)


def from_args(config: type, args: argparse.Namespace, exclude: tuple[str, ...] = (), **given: Any) -> Any:
    """The ``config`` dataclass from parsed flags: each flagged field from its flag, ``given`` values as they are,
    nested configs built the same way, and the rest (fields without a flag, or whose flag this verb lacks) left to
    their defaults. The dataclass validates the values, as it does for Python callers."""
    values = dict(given)
    for field in dataclasses.fields(config):
        if field.name in values or field.name in exclude:
            continue
        nested = nested_config(field)
        if nested is not None and flag_of(field) is None:
            values[field.name] = from_args(nested, args, exclude)
        elif flag_of(field) is not None and hasattr(args, flag_dest(field)):
            values[field.name] = getattr(args, flag_dest(field))
    return config(**values)


def none_or_text(text: str) -> str | None:
    """A flag's "none" as None (a feature that is on by default, turned off)."""
    return None if text == "none" else text


def json_object(text: str) -> dict:
    """A flag's JSON object, e.g. ``'{"temperature": 0.5}'``."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text}")
    return value
