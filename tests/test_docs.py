"""Every example in the READMEs runs as pasted: each shipped file a fenced command or an
image names exists, and each flag a dtlab command is given is one its --help lists."""

from __future__ import annotations

import functools
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ["README.md", "models/README.md", "collective/README.md", "pserver/README.md",
        "scripts/README.md"]
SHIPPED = re.compile(r"^(scripts|models|collective|pserver|protos|tests)/[\w./-]+"
                     r"\.(json|py|md|proto|png|c)$|^README\.md$")
BIN = Path(sys.executable).parent
LAUNCHERS = {"mpiexec", "srun", "timeout", "flock"}


def commands(doc: str) -> list[list[str]]:
    """The fenced bash commands of `doc`, continuation lines joined, comments dropped."""
    out, block, fence = [], [], False
    for line in (ROOT / doc).read_text().splitlines():
        if line.startswith("```"):
            if fence:
                text = "\n".join(block).replace("\\\n", " ")
                for cmd in text.splitlines():
                    try:
                        words = shlex.split(cmd, comments=True)
                    except ValueError:
                        continue
                    words = [w.rstrip("&") for w in words if w != "&"]
                    while ":" in words:  # an MPMD launch: one command per program
                        cut = words.index(":")
                        out.append(words[:cut])
                        words = ["mpiexec", *words[cut + 1:]]
                    if words:
                        out.append(words)
            fence, block = line.strip() == "```bash" and not fence, []
        elif fence:
            block.append(line)
    return out


def program(words: list[str]) -> tuple[str, list[str]] | None:
    """(a dtlab console script, its arguments) of a command line, launchers stripped."""
    for i, w in enumerate(words):
        if w.startswith("dtlab-"):
            return w, words[i + 1:]
        if i == 0 and w not in LAUNCHERS:
            return None
    return None


@functools.cache
def help_text(prog: str, head: tuple[str, ...]) -> str:
    r = subprocess.run([str(BIN / prog), *head, "--help"], capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    assert r.returncode == 0, f"{prog} {' '.join(head)} --help: {r.stderr}"
    return r.stdout


def help_head(prog: str, args: list[str]) -> tuple[str, ...]:
    """What selects the flags --help lists: a subcommand or benchmark, the model."""
    head: list[str] = []
    if prog in ("dtlab-pserver", "dtlab-bench") and args and not args[0].startswith("-"):
        head.append(args[0])
    if "--model" in args:
        head += ["--model", args[args.index("--model") + 1]]
    return tuple(head)


CASES = [(doc, i, words) for doc in DOCS for i, words in enumerate(commands(doc))]


@pytest.mark.parametrize("doc", DOCS)
def test_every_shipped_file_named_exists(doc):
    text = (ROOT / doc).read_text()
    named = {w for words in commands(doc) for w in words if SHIPPED.match(w)}
    named |= {m for m in re.findall(r"!\[[^]]*\]\(([^)]+)\)", text)}
    base = ROOT / Path(doc).parent
    missing = [n for n in sorted(named)
               if not (ROOT / n).exists() and not (base / n).exists()]
    assert not missing, f"{doc} names files that do not exist: {missing}"


@pytest.mark.parametrize("doc, i, words", [c for c in CASES if program(c[2])],
                         ids=lambda v: v if isinstance(v, str) else None)
def test_every_flag_of_an_example_exists(doc, i, words):
    prog, args = program(words)
    assert (BIN / prog).exists(), f"{doc}: {prog} is not one of dtlab's commands"
    text = help_text(prog, help_head(prog, args))
    flags = {a.split("=", 1)[0] for a in args if a.startswith("--")}
    unknown = sorted(f for f in flags if not re.search(rf"{re.escape(f)}\b", text))
    assert not unknown, f"{doc}: `{' '.join(words)}`: {prog} has no {unknown}"
