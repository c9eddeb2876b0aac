"""Rules between flags declared on the config dataclasses (models/flag_rules.py): each
kind refuses what it says with both flags named, a rule cannot name a flag that does not
exist, and every rule dtlab-sync and dtlab-worker declare fires on a command line with both
sides named. Parsing only: no MPI job starts, no server."""

from __future__ import annotations

import dataclasses
import re
import sys
from dataclasses import dataclass

import pytest

from dtlab.collective.reducers.methods import Methods
from dtlab.collective.train import SYNC_CONFIGS, parse_args
from dtlab.models.config import described, flag
from dtlab.models.flag_rules import (
    ABSENT,
    Conflicts,
    Flag,
    MultipleOf,
    NoEffectWith,
    NoEffectWithout,
    OneAtATime,
    Refusal,
    Requires,
    at,
    check,
    rules,
    rules_of,
)
from dtlab.models.run.session import GROUPS
from dtlab.models.zoo import MODELS
from dtlab.pserver.worker import flags as worker_flags


@dataclass
class Other:
    mode: str = described("off", "a mode")


@rules(
    Conflicts("a", "b", why="they clash"),
    NoEffectWith("c", Flag("mode", Other)),
    NoEffectWithout("d", at("a", 3)),
    Requires("e", Flag("mode", Other, words="a mode (--mode on)")),
    MultipleOf("f", "a"),
    OneAtATime(("b", "c", "e")),
)
@dataclass
class Toy:
    a: int = described(0, "")
    b: bool = described(False, "")
    c: float = described(1.5, "")
    d: str = described("", "")
    e: int | None = described(None, "", kind=int)
    f: int = described(0, "")


def refusal(**values) -> str | None:
    """The message of the Toy rule that `values` (Toy's fields, and Other's `mode`) break."""
    toy, other = Toy(**{k: v for k, v in values.items() if k != "mode"}), None
    if "mode" in values:
        other = Other(values["mode"])

    def value_of(f: Flag):
        cfg = toy if f.owner is Toy else other
        return ABSENT if cfg is None else getattr(cfg, f.name)
    try:
        check(Toy.RULES, value_of)
    except Refusal as e:
        return str(e)
    return None


@pytest.mark.parametrize("values, message", [
    (dict(a=2, b=True), "--a 2 with --b: they clash"),
    (dict(c=2.0, mode="on"), "--c 2.0 has no effect with --mode on"),
    (dict(d="x"), "--d x has no effect without --a 3"),
    (dict(d="x", a=2), "--d x has no effect without --a 3"),
    (dict(e=1), "--e 1 needs a mode (--mode on)"),  # Other absent: off
    (dict(e=1, mode="off"), "--e 1 needs a mode (--mode on)"),
    (dict(a=3, f=4), "--f 4 must be a multiple of --a 3"),
    (dict(b=True, c=2.0), "--b with --c 2.0: one of them at a time"),
])
def test_each_kind_refuses_naming_both_flags(values, message):
    assert refusal(**values) == message


@pytest.mark.parametrize("values", [
    dict(), dict(a=2), dict(b=True), dict(c=2.0), dict(c=2.0, mode="off"), dict(d="x", a=3),
    dict(e=1, mode="on"), dict(a=3, f=6), dict(f=4), dict(b=True, mode="on"),
])
def test_each_kind_lets_what_it_allows_run(values):
    assert refusal(**values) is None


def test_a_flag_is_on_when_it_differs_from_its_dataclass_default():
    e, b = Flag("e", Toy), Flag("b", Toy)
    assert not e.on(None) and e.on(0)  # a None default: any value given is on
    assert b.given(True) == "--b" and b.given(False) == "--no-b"


def test_a_rule_naming_a_flag_that_does_not_exist_fails_where_it_is_declared():
    with pytest.raises(NameError, match="--nope, which is no field of Other"):
        Flag("nope", Other)
    with pytest.raises(NameError, match="--mod, which is no field of Loose"):
        @rules(NoEffectWithout("mod", Flag("mode", Other)))
        @dataclass
        class Loose:
            mode: str = described("off", "")


MLP = ["--model", "mlp"]
MOE = ["--model", "transformer", "--moe-experts", "4"]
# One command line per rule dtlab-sync keeps (the test below checks that together they
# break every declared rule, so a new rule needs its line here).
BREAKING = [
    [*MLP, "--stages", "2,3"],
    [*MLP, "--virtual-stages", "2"],
    [*MOE, "--moe-alltoall", "mpi"],
    [*MOE, "--moe-chunks", "2"],
    [*MLP, "--ep", "2"],
    [*MOE, "--ep", "2", "--moe-groups", "2"],
    [*MLP, "--zero", "2", "--no-zero-reshard-after-forward"],
    [*MOE, "--zero", "1", "--ep", "2"],
    [*MLP, "--zero", "3", "--pp", "2"],
    [*MOE, "--zero", "2", "--moe-bias-rate", "1e-3"],
    [*MLP, "--zero", "3", "--allreduce", "mpi"],
    [*MLP, "--zero", "1", "--bucket-mb", "5"],
    [*MLP, "--outer-optimizer", "sgd"],
    [*MLP, "--fragments", "2", "--mix", "0.5"],
    [*MLP, "--local-steps", "3", "--eval-every", "4"],
    [*MLP, "--onebit-adam", "4", "--optimizer", "sgd"],
    [*MLP, "--zero-one-adam", "4", "--optimizer", "sgd"],
    [*MLP, "--local-steps", "2", "--compress", "sign"],
    [*MLP, "--compress", "sign", "--zero", "2"],
    [*MLP, "--no-quantize-error-feedback"],
    [*MLP, "--zero-one-local-max", "4"],
]


def named(f: Flag, message: str) -> bool:
    return f.name.replace("_", "-") in message or bool(f.words) and f.words in message


def test_every_rule_of_dtlab_sync_fires_with_both_flags_named():
    declared = rules_of(*(c.config for c in MODELS.values()), *GROUPS.values(),
                        *(cls for cls, _ in SYNC_CONFIGS)) + Methods.RULES
    fired = set()
    for argv in BREAKING:
        with pytest.raises(Refusal) as e:
            parse_args(argv)
        rule, message = e.value.rule, str(e.value)
        fired.add(rule)
        for side in (rule.flags, rule.other):
            assert not side or any(named(f, message) for f in side), (argv, message)
        if not rule.other:  # one at a time: two of them named
            assert sum(named(f, message) for f in rule.flags) >= 2, message
    assert fired == set(declared), set(declared) - fired


def sync_help(capsys) -> str:
    with pytest.raises(SystemExit) as e:
        parse_args(["--help"])
    assert e.value.code == 0
    return " ".join(capsys.readouterr().out.split())


def test_dtlab_sync_help_shows_every_flag_with_its_dataclass_default(capsys):
    out = sync_help(capsys)
    for cls, title, *_ in SYNC_CONFIGS:
        assert title in out
        for f in dataclasses.fields(cls):
            assert "--" + f.name.replace("_", "-") in out, f.name
    assert "(1e6 bytes) (default: 25.0)" in out  # SyncConfig.bucket_mb's, from buckets.py


def test_every_config_with_rules_whose_flags_dtlab_sync_takes_is_checked_by_it(capsys):
    """A config class added with add_flags alone would have its RULES never kept: it
    belongs in parse's `configs` (collective/train.py, SYNC_CONFIGS)."""
    out = sync_help(capsys)
    checked = {*(c.config for c in MODELS.values()), *GROUPS.values(),
               *(cls for cls, *_ in SYNC_CONFIGS), Methods}
    for name, module in list(sys.modules.items()):
        if not name.startswith("dtlab."):
            continue
        for cls in vars(module).values():
            if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)
                    and getattr(cls, "RULES", ()) and cls not in checked):
                continue
            taken = all(re.search(re.escape(flag(f.name)) + r"(?![\w-])", out)
                        for f in dataclasses.fields(cls))
            assert not taken, f"{cls.__name__}'s rules are not kept by dtlab-sync"


WORKER = ["--servers", "127.0.0.1:1", *MLP]
WORKER_MOE = ["--servers", "127.0.0.1:1", *MOE]
# One command line per rule dtlab-worker keeps among the flags it takes (pserver/worker/
# flags.py; the test below checks that together they break every such rule).
WORKER_BREAKING = [
    [*WORKER, "--dylu"],
    [*WORKER, "--fragments", "2"],
    [*WORKER, "--fragments", "3", "--local-steps", "4"],
    [*WORKER, "--fragments", "2", "--local-steps", "4", "--dylu"],
    [*WORKER_MOE, "--moe-sparse-push", "--local-steps", "2"],
    [*WORKER, "--moe-sparse-push"],
    [*WORKER_MOE, "--moe-sparse-push", "--tp", "2"],
    [*WORKER, "--local-steps", "2", "--pp", "2"],
    [*WORKER, "--local-steps", "3", "--eval-every", "4"],
    [*WORKER, "--compress", "sign", "--wire", "fp16"],
    [*WORKER, "--stages", "3,2"],
    [*WORKER, "--pp-schedule", "gpipe"],
    [*MLP, "--servers", "auto", "--tp", "2"],
]


def worker_help(capsys) -> str:
    with pytest.raises(SystemExit) as e:
        worker_flags.parse_args(["--help"])
    assert e.value.code == 0
    return " ".join(capsys.readouterr().out.split())


def test_every_rule_of_dtlab_worker_on_its_flags_fires_with_both_flags_named(capsys):
    """GridConfig's rules on flags the worker does not take (--ep, --virtual-stages) are
    kept but cannot fire: they are left out here."""
    out = worker_help(capsys)
    classes = (*(c.config for c in MODELS.values()), *GROUPS.values(),
               *(cls for cls, *_ in worker_flags.WORKER_CONFIGS))
    declared = {rule for rule in rules_of(*classes) + worker_flags.GROUP_RULES
                if all(re.search(re.escape(flag(f.name)) + r"(?![\w-])", out)
                       for f in (*rule.flags, *rule.other))}
    fired = set()
    for argv in WORKER_BREAKING:
        with pytest.raises(Refusal) as e:
            worker_flags.parse_args(argv)
        rule, message = e.value.rule, str(e.value)
        fired.add(rule)
        for side in (rule.flags, rule.other):
            assert not side or any(named(f, message) for f in side), (argv, message)
    assert fired == declared, declared - fired
