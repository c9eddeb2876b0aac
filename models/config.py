"""Typed configuration objects and their command-line flags.

Each config is a small dataclass with defaults (GPTConfig-style). Every field
is also a flag spelled with dashes (`d_model` -> `--d-model`), parsed with
the type of its default (or `described(None, ..., kind=int)`'s: a flag off
unless given); booleans get `--flag` / `--no-flag`. `validate()` checks the
values and raises ConfigError naming the flag, which entry points turn into
`error: ...` and exit code 2 (no traceback; models/run/cli.py). The rules
between flags are declared on the dataclasses: models/flag_rules.py.
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the flag."""


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def described(default, help: str, kind: type | None = None, metavar: str | None = None) -> Any:
    """A field whose flag's --help says `help`; `kind` types its flag where the default
    is None (a flag that is off unless given), `metavar` names its value."""
    metadata = {"help": help, "kind": kind or type(default), "metavar": metavar}
    return dataclasses.field(default=default, metadata=metadata)


def choice(default, *choices, help: str = "") -> Any:
    """A field restricted to `choices` (strings, or numbers as --zero's stages)."""
    return dataclasses.field(default=default, metadata={"choices": choices, "help": help})


def kind_of(f: dataclasses.Field) -> type:
    """The type of field `f`'s values: its default's, or `described`'s `kind`."""
    return f.metadata.get("kind") or type(f.default)


def positive(cfg, *names: str) -> None:
    for name in names:
        value = getattr(cfg, name)
        if value <= 0:
            raise ConfigError(f"{flag(name)} must be positive (got {value})")


def positive_list(cfg, name: str) -> list[int | float]:
    """The comma-separated positive numbers of field `name` (ints where written so)."""
    text = getattr(cfg, name)
    try:
        values = [float(x) if "." in x else int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) <= 0:
        raise ConfigError(f"{flag(name)} must be a comma-separated list of positive numbers "
                          f"(got {text!r})")
    return values


def non_negative(cfg, *names: str) -> None:
    for name in names:
        value = getattr(cfg, name)
        if value < 0:
            raise ConfigError(f"{flag(name)} must not be negative (got {value})")


def add_flags(parser: argparse.ArgumentParser, cls, title: str | None = None,
              only: tuple[str, ...] | None = None) -> None:
    """One flag per field of dataclass `cls` (or of the fields in `only`), typed by its default."""
    group = parser.add_argument_group(title or cls.__name__)
    for f in dataclasses.fields(cls):
        if only is not None and f.name not in only:
            continue
        default, kind = f.default, kind_of(f)
        help_text = f.metadata.get("help", "") + (f" (default: {default})"
                                                   if default is not None else "")
        if kind is bool:
            group.add_argument(flag(f.name), dest=f.name, default=None,
                               action=argparse.BooleanOptionalAction, help=help_text)
        else:
            group.add_argument(flag(f.name), dest=f.name, default=None,
                               type=kind if kind is not type(None) else str,
                               choices=f.metadata.get("choices") or None,
                               metavar=f.metadata.get("metavar"), help=help_text)


def from_namespace(cls, ns: argparse.Namespace, base: dict | None = None,
                   only: tuple[str, ...] | None = None):
    """Build `cls` from `base` (e.g. a config file's section) overridden by the flags
    given in `ns` (of the fields in `only`, if given; unset flags keep `base`'s value or
    the default), and validate it."""
    given = {f.name: getattr(ns, f.name) for f in dataclasses.fields(cls)
             if (only is None or f.name in only) and getattr(ns, f.name, None) is not None}
    return build(cls, {**(base or {}), **given})


def build(cls, values: dict):
    """Build and validate `cls` from a dict; unknown keys and wrong types are errors."""
    values = check_values(cls, values)
    cfg = cls(**values)
    cfg.validate()
    return cfg


def check_values(cls, values: dict) -> dict:
    """`values` checked field by field against `cls` (known keys, types, choices; ints
    given for float fields become floats), before any check across fields."""
    values = dict(values)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ConfigError(f"unknown {cls.__name__} key(s): {', '.join(unknown)}")
    for name, value in values.items():
        default, kind = fields[name].default, kind_of(fields[name])
        ok = (value is None and default is None) or isinstance(value, kind) and not (
            isinstance(value, bool) and kind is not bool)
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            ok, values[name] = True, float(value)
        if not ok:
            raise ConfigError(f"{flag(name)} must be {kind.__name__}, got {value!r}")
        choices = fields[name].metadata.get("choices")
        if choices and value not in choices:
            raise ConfigError(f"{flag(name)} must be one of {', '.join(choices)}, got {value!r}")
    return values


def as_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)
