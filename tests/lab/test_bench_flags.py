"""Every benchmark's flags come from one harness (scripts/lab/bench/harness.py): its parser,
built as `dtlab-bench NAME` builds it (cli.py runs the module as __main__), takes --tiny
and --json PATH, and a --launches or --ranks it takes is the harness's (`launch_flags`
marks the actions it adds), never one declared by hand. Parsers only: nothing launches."""

from __future__ import annotations

import argparse
import runpy
import sys

import pytest

from dtlab.lab.bench import harness
from dtlab.lab.bench.cli import NAMES

LAUNCH_FLAGS = {"--launches", "--ranks"}


class Built(BaseException):
    """Raised in place of parsing (past run_cli's handlers): the benchmark's parser."""

    def __init__(self, parser: argparse.ArgumentParser):
        super().__init__(parser.prog)
        self.parser = parser


def parser_of(name: str, monkeypatch) -> argparse.ArgumentParser:
    """The parser `dtlab-bench NAME` builds, caught at its first parse."""
    def catch(self, args=None, namespace=None):
        raise Built(self)

    monkeypatch.setattr(sys, "argv", [f"dtlab-bench {name}", "--tiny", "--json", "x.json"])
    with monkeypatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_known_args", catch)
        with pytest.raises(Built) as built:
            runpy.run_module(f"dtlab.lab.bench.{name}", run_name="__main__", alter_sys=True)
    return built.value.parser


def hand_rolled(p: argparse.ArgumentParser) -> list[list[str]]:
    """The --launches / --ranks actions of `p` that harness.launch_flags did not add."""
    return [a.option_strings for a in p._actions
            if LAUNCH_FLAGS & set(a.option_strings)
            and not getattr(a, harness.FROM_HARNESS, False)]


@pytest.mark.parametrize("name", NAMES)
def test_parser_takes_tiny_and_json_and_the_harness_launch_flags(name, monkeypatch):
    p = parser_of(name, monkeypatch)
    args, rest = p.parse_known_args(["--tiny", "--json", "out.json"])
    assert args.tiny is True and args.json == "out.json" and not rest, (args, rest)
    own = hand_rolled(p)
    assert not own, f"{name} declares {own} itself: use harness.launch_flags"


def test_the_harness_parses_ranks_one_way():
    p = argparse.ArgumentParser(prog="b", exit_on_error=False)
    harness.launch_flags(p, "launches", ranks="1,2,4", default_launches=1)
    assert vars(p.parse_args([])) == {"launches": 1, "ranks": [1, 2, 4]}
    assert p.parse_args(["--ranks", "2, 8", "--launches", "3"]).ranks == [2, 8]
    for bad in ("2,x", "0", ""):
        with pytest.raises(argparse.ArgumentError, match="--ranks must be"):
            p.parse_args(["--ranks", bad])


def test_a_hand_rolled_flag_is_told_apart():
    ours, theirs = argparse.ArgumentParser(), argparse.ArgumentParser()
    harness.launch_flags(ours, "launches", ranks="1,2")
    theirs.add_argument("--launches", type=int, default=1)
    theirs.add_argument("--ranks", default="1,2")
    assert hand_rolled(ours) == [] and hand_rolled(theirs) == [["--launches"], ["--ranks"]]
