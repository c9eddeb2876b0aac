"""Typed configuration objects and their command-line flags.

Each config is a small dataclass with defaults (GPTConfig-style). Every field
is also a flag spelled with dashes (`d_model` -> `--d-model`), parsed with
the type of its default; booleans get `--flag` / `--no-flag`. `validate()`
checks the values and raises ConfigError naming the flag, which entry points
turn into `error: ...` and exit code 2 (no traceback).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable
from typing import Any


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the flag."""


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def described(default, help: str) -> Any:
    """A field whose flag's --help says `help`."""
    return dataclasses.field(default=default, metadata={"help": help})


def choice(default: str, *choices: str, help: str = "") -> Any:
    """A string field restricted to `choices`."""
    return dataclasses.field(default=default, metadata={"choices": choices, "help": help})


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


def add_flags(parser: argparse.ArgumentParser, cls, title: str | None = None) -> None:
    """One flag per field of dataclass `cls`, typed by the field's default."""
    group = parser.add_argument_group(title or cls.__name__)
    for f in dataclasses.fields(cls):
        default = f.default
        help_text = f.metadata.get("help", "") + f" (default: {default})"
        if isinstance(default, bool):
            group.add_argument(flag(f.name), dest=f.name, default=None,
                               action=argparse.BooleanOptionalAction, help=help_text)
        else:
            group.add_argument(flag(f.name), dest=f.name, default=None,
                               type=type(default) if default is not None else str,
                               choices=f.metadata.get("choices") or None, help=help_text)


def from_namespace(cls, ns: argparse.Namespace):
    """Build `cls` from parsed flags (unset flags keep their defaults) and validate it."""
    given = {f.name: getattr(ns, f.name) for f in dataclasses.fields(cls)
             if getattr(ns, f.name, None) is not None}
    return build(cls, given)


def build(cls, values: dict):
    """Build and validate `cls` from a dict; unknown keys and wrong types are errors."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ConfigError(f"unknown {cls.__name__} key(s): {', '.join(unknown)}")
    for name, value in values.items():
        default = fields[name].default
        ok = isinstance(value, type(default)) and not (
            isinstance(value, bool) and not isinstance(default, bool))
        if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
            ok, values[name] = True, float(value)
        if not ok:
            raise ConfigError(f"{flag(name)} must be {type(default).__name__}, got {value!r}")
        choices = fields[name].metadata.get("choices")
        if choices and value not in choices:
            raise ConfigError(f"{flag(name)} must be one of {', '.join(choices)}, got {value!r}")
    cfg = cls(**values)
    cfg.validate()
    return cfg


def as_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def run_cli(main: Callable[[list[str]], int], argv: list[str] | None = None,
            user_errors: tuple[type[BaseException], ...] = ()) -> int:
    """Run an entry point; a bad config prints `error: ...` and returns 2, any
    of `user_errors` (a corrupt checkpoint, a diverged run) prints and returns 1.
    Neither shows a traceback: the message names the problem."""
    prog = sys.argv[0].rsplit("/", 1)[-1]
    try:
        return main(sys.argv[1:] if argv is None else argv) or 0
    except ConfigError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except user_errors as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 1
