"""Every example in the READMEs runs as pasted: each shipped file a fenced command or an
image names exists, and each flag a dtlab command is given is one its --help lists."""

from __future__ import annotations

import ast
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


# A path that starts at a top folder of the repository must exist from the root; a bare
# file name of code must be some file's name (compare.py, once a script, is a package now).
TOP_FOLDERS = ("tests/", "models/", "collective/", "pserver/", "scripts/", "protos/")
PATH_TOKEN = re.compile(r"(?<![\w./-])((?:[\w-]+/)*[\w-]+\.(?:py|md|json|proto|c))\b")
NOT_OURS = {"reflection.proto"}  # grpc's, which pserver/server/reflection.py serves
PROGRAMS = ("dtlab-train", "dtlab-cost", "dtlab-sync", "dtlab-worker", "dtlab-replay",
            "dtlab-compare", "dtlab-simulate", "dtlab-bench")


def stale_paths(text: str, names: set[str]) -> list[str]:
    out = []
    for token in PATH_TOKEN.findall(text):
        if token in NOT_OURS:
            continue
        if token.startswith(TOP_FOLDERS):
            if not (ROOT / token).exists():
                out.append(token)
        elif "/" not in token and token.endswith((".py", ".c", ".proto")) and token not in names:
            out.append(token)
    return out


def docstrings(path: Path) -> str:
    nodes = ast.walk(ast.parse(path.read_text(), str(path)))
    return "\n".join(ast.get_docstring(n) or "" for n in nodes if isinstance(
        n, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef))


def test_every_repository_path_named_exists():
    """In every Markdown file, every docstring and every program's --help."""
    ours = [p for p in ROOT.rglob("*") if p.is_file() and not any(
        part.startswith(".") or part in ("build", "runs") or part.endswith(".egg-info")
        for part in p.relative_to(ROOT).parts)]
    names = {p.name for p in ours}
    texts = {str(p.relative_to(ROOT)): p.read_text(errors="replace")
             for p in ours if p.suffix == ".md"}
    texts |= {str(p.relative_to(ROOT)): docstrings(p) for p in ours if p.suffix == ".py"
              and not p.name.endswith(("_pb2.py", "_pb2_grpc.py"))}
    texts |= {f"{prog} --help": help_text(prog, ()) for prog in PROGRAMS}
    texts["dtlab-pserver serve --help"] = help_text("dtlab-pserver", ("serve",))
    stale = {where: bad for where, text in texts.items() if (bad := stale_paths(text, names))}
    assert not stale, f"paths that name nothing in the repository: {stale}"
