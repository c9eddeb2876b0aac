"""Rules between flags, declared on the config dataclasses that hold the flags, and the
one checker that refuses a run breaking one of them.

    @rules(NoEffectWithout("stages", "pp"),
           Requires("ep", Flag("moe_experts", TransformerConfig, words="a model with experts")))
    @dataclass
    class GridConfig: ...

A rule names each flag by its config field: a bare name is a field of the class the rule
is declared on, `Flag(name, Owner)` a field of another config class. Both are looked up
when the rule is made, so a rule naming a flag that does not exist raises NameError at
import: a rule cannot outlive its flag. A flag is on when its value differs from its
field's default (the default is read from the dataclass, never repeated), or when it
passes the flag's `test` (`at("zero", 3)`: on at --zero 3 only). A refusal names both
sides as the run set them:

    Conflicts        --zero 3 with --pp 2: why
    NoEffectWith     --bucket-mb 5.0 has no effect with --zero 1: why
    NoEffectWithout  --stages 2,3 has no effect without --pp
    Requires         --ep 2 needs a model with experts
    MultipleOf       --eval-every 4 must be a multiple of --local-steps 3: why
    OneAtATime       --local-steps 2 with --compress sign: one of them at a time

`check(rules, value_of)` raises the first refusal as a `Refusal` (a ConfigError: exit 2,
one line); `value_of(flag)` is the run's value of a flag, or ABSENT where the run has no
config of the flag's class (an MLP has no --moe-experts): an absent flag is off.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from dtlab.models.config import ConfigError, flag

ABSENT = object()  # value_of's answer for a flag whose config this run does not have


class Refusal(ConfigError):
    """A run broke `rule`; the message names its flags."""

    def __init__(self, message: str, rule: Rule):
        super().__init__(message)
        self.rule = rule


def field_of(owner: type, name: str) -> dataclasses.Field:
    """Field `name` of dataclass `owner`; NameError where it has none."""
    for f in dataclasses.fields(owner):
        if f.name == name:
            return f
    raise NameError(f"a rule names {flag(name)}, which is no field of {owner.__name__}")


@dataclass(frozen=True)
class Flag:
    """Field `name` of config class `owner` (None until the rule is declared on a class:
    that class); on when `test(value)` holds, else when the value is not the default;
    `words` says what a rule asks for when the flag is off ("--zero 3")."""

    name: str
    owner: type | None = None
    test: Callable[[Any], bool] | None = None
    words: str = ""

    def __post_init__(self):
        if self.owner is not None:
            field_of(self.owner, self.name)

    def bound(self, owner: type) -> Flag:
        return self if self.owner is not None else dataclasses.replace(self, owner=owner)

    @property
    def default(self) -> Any:
        f = field_of(self.owner, self.name)
        return f.default_factory() if f.default is dataclasses.MISSING else f.default

    def on(self, value: Any) -> bool:
        if value is ABSENT:
            return False
        return self.test(value) if self.test is not None else value != self.default

    def given(self, value: Any) -> str:
        """'--zero 3', '--no-overlap': the flag as the run set it."""
        if isinstance(value, bool):
            return flag(self.name) if value else "--no-" + self.name.replace("_", "-")
        return f"{flag(self.name)} {value}"

    def asked(self) -> str:
        """'--pp', '--zero 3': the flag as a rule asks for it."""
        return self.words or flag(self.name)


def at(name: str, value: Any, owner: type | None = None) -> Flag:
    """Flag `name`, on at `value` only."""
    return Flag(name, owner, test=lambda v: v == value, words=f"{flag(name)} {value}")


def flags_of(spec: str | Flag | Iterable[str | Flag]) -> tuple[Flag, ...]:
    if isinstance(spec, (str, Flag)):
        spec = (spec,)
    return tuple(Flag(s) if isinstance(s, str) else s for s in spec)


def given(flags: tuple[Flag, ...], value_of: Callable[[Flag], Any]) -> list[str]:
    """'--flag value' of each of `flags` that is on."""
    values = [(f, value_of(f)) for f in flags]
    return [f.given(v) for f, v in values if f.on(v)]


class Rule:
    """`flags` (the rule applies when any one is on) held against `other`; `why`, if
    given, ends the refusal after a colon."""

    def __init__(self, flags, other=(), why: str = ""):
        self.flags, self.other, self.why = flags_of(flags), flags_of(other), why

    def __repr__(self) -> str:
        names = [" ".join(flag(f.name) for f in side) for side in (self.flags, self.other)]
        return f"{type(self).__name__}({', '.join(n for n in names if n)})"

    def bound(self, owner: type) -> Rule:
        """This rule with its bare names made fields of `owner` (NameError where not)."""
        rule = copy.copy(self)
        rule.flags = tuple(f.bound(owner) for f in self.flags)
        rule.other = tuple(f.bound(owner) for f in self.other)
        return rule

    def problem(self, value_of: Callable[[Flag], Any]) -> str | None:
        """The refusal's text where the values break this rule, else None."""
        raise NotImplementedError

    def because(self) -> str:
        return f": {self.why}" if self.why else ""


class Conflicts(Rule):
    """`flags` cannot run with `other`."""

    words = "with"

    def problem(self, value_of):
        mine, theirs = given(self.flags, value_of), given(self.other, value_of)
        if mine and theirs:
            return f"{mine[0]} {self.words} {theirs[0]}{self.because()}"
        return None


class NoEffectWith(Conflicts):
    """`flags` do nothing once `other` is on."""

    words = "has no effect with"


class NoEffectWithout(Rule):
    """`flags` do nothing unless `other` is on (every one of them on is named)."""

    words = "has no effect without"

    def problem(self, value_of):
        mine = given(self.flags, value_of)
        if mine and not given(self.other, value_of):
            asked = " or ".join(f.asked() for f in self.other)
            return f"{' '.join(mine)} {self.words} {asked}{self.because()}"
        return None


class Requires(NoEffectWithout):
    """`flags` cannot run unless `other` is on."""

    words = "needs"


class MultipleOf(Rule):
    """With both on, the value of `flags` (one flag) is a multiple of `other`'s."""

    def problem(self, value_of):
        (a,), (b,) = self.flags, self.other
        x, y = value_of(a), value_of(b)
        if a.on(x) and b.on(y) and x % y:
            return f"{a.given(x)} must be a multiple of {b.given(y)}{self.because()}"
        return None


class OneAtATime(Rule):
    """At most one of `flags` on."""

    def __init__(self, flags, why: str = "one of them at a time"):
        super().__init__(flags, (), why)

    def problem(self, value_of):
        mine = given(self.flags, value_of)
        return f"{' with '.join(mine)}{self.because()}" if len(mine) > 1 else None


def rules(*declared: Rule):
    """Class decorator (above @dataclass): `declared` become the class's RULES, their bare
    names its fields (NameError for a name that is none)."""
    def attach(cls):
        cls.RULES = tuple(rule.bound(cls) for rule in declared)
        return cls
    return attach


def rules_of(*classes: type) -> tuple[Rule, ...]:
    """Every rule the classes declare, in order."""
    return tuple(rule for cls in classes for rule in getattr(cls, "RULES", ()))


def check(declared: Iterable[Rule], value_of: Callable[[Flag], Any]) -> None:
    """The first of `declared` the values break, as a Refusal naming its flags."""
    for rule in declared:
        problem = rule.problem(value_of)
        if problem:
            raise Refusal(problem, rule)
