"""The import rule of ARCHITECTURE.md, checked on every module's imports (the module's
top level and inside its functions alike), and ARCHITECTURE.md naming every module.

    models/       imports nothing of collective/, pserver/ or the lab
    models/ math  (everything but models/run/) imports nothing of models/run/
    pserver/      imports collective/ only in worker/group_worker.py (a model-parallel
                  worker group is an MPI program); server/ and worker/ import each other
                  never, common/ neither of them
    cupy          imported by models/backend.py alone
    the lab       (scripts/lab, dtlab.lab) imports the package; nothing imports the lab
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"models": "dtlab.models", "collective": "dtlab.collective",
            "pserver": "dtlab.pserver", "protos": "dtlab.protos", "scripts/lab": "dtlab.lab"}


def modules() -> dict[str, Path]:
    """dotted name -> file, for every module of the installed packages."""
    found = {}
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT / folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            found[".".join([package, *parts])] = path
    return found


def imports(path: Path, name: str) -> set[str]:
    """Every module `path` imports, absolute (relative imports resolved against `name`)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = name.rsplit(".", node.level)[0]
                base = f"{parent}.{base}" if base else parent
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
    return out


MODULES = modules()
IMPORTS = {name: imports(path, name) for name, path in MODULES.items()}


def importers(prefix: str, within: str) -> dict[str, set[str]]:
    """Modules under `within` that import something under `prefix`, and what."""
    return {m: {i for i in got if i == prefix or i.startswith(prefix + ".")}
            for m, got in IMPORTS.items() if m.startswith(within)
            and any(i == prefix or i.startswith(prefix + ".") for i in got)}


@pytest.mark.parametrize("other", ["dtlab.collective", "dtlab.pserver", "dtlab.lab"])
def test_models_import_neither_transport_nor_the_lab(other):
    assert importers(other, "dtlab.models") == {}


def test_the_math_imports_nothing_of_the_run_machinery():
    found = {m: i for m, i in importers("dtlab.models.run", "dtlab.models").items()
             if not m.startswith("dtlab.models.run")}
    assert found == {}


def test_pserver_imports_collective_only_in_the_group_worker():
    assert set(importers("dtlab.collective", "dtlab.pserver")) == \
        {"dtlab.pserver.worker.group_worker"}


@pytest.mark.parametrize("role, others", [("server", ("worker",)), ("worker", ("server",)),
                                          ("common", ("server", "worker"))])
def test_pserver_roles_stay_apart(role, others):
    for other in others:
        assert importers(f"dtlab.pserver.{other}", f"dtlab.pserver.{role}") == {}, other


def test_only_the_backend_imports_cupy():
    assert set(importers("cupy", "dtlab")) == {"dtlab.models.backend"}


def test_nothing_of_the_package_imports_the_lab():
    found = {m: i for m, i in importers("dtlab.lab", "dtlab").items()
             if not m.startswith("dtlab.lab")}
    assert found == {}


SECTION = re.compile(r"^#+ `?((?:models|collective|pserver|scripts|protos)[\w/]*/)")
NAME = re.compile(r"`([\w/]+\.(?:py|c))`")


def architecture_rows() -> set[str]:
    """Every file a row of ARCHITECTURE.md's tables names, as a path from the root.

    A row's first cell names files relative to its section's folder (`## models/run/`);
    in `simulate/links.py`, `formulas.py` the folder of the first name carries to the
    next; a row whose first cell is a folder (`data/`) names its files in its text; the
    paragraph under a section heading may name files of that folder (`__main__.py`)."""
    named, folder = set(), None
    for line in (ROOT / "ARCHITECTURE.md").read_text().splitlines():
        heading = SECTION.match(line)
        if line.startswith("#"):
            folder = heading[1] if heading else None
            continue
        if folder is None:
            continue
        if not line.startswith("|"):  # prose may name files elsewhere (the root's setup.py)
            named |= {folder + n for n in NAME.findall(line)
                      if "/" not in n and (ROOT / folder / n).exists()}
            continue
        cells = line.split("|")
        if len(cells) < 3:
            continue
        first = re.findall(r"`([^`]+)`", cells[1])
        if first and first[0].endswith("/"):  # a folder: its files in the row's text
            named |= {folder + first[0] + n for n in NAME.findall(cells[2]) if "/" not in n}
            continue
        carried = ""
        for name in first:
            if "/" in name:
                carried = name.rsplit("/", 1)[0] + "/"
                named.add(folder + name)
            else:
                named.add(folder + carried + name)
    return named


def test_the_architecture_map_and_the_modules_agree_both_ways():
    """Every module has its row (by its path, not a basename found anywhere), and every
    row names a file that exists."""
    rows = architecture_rows()
    missing = []
    for path in MODULES.values():
        if path.name in ("__init__.py", "__main__.py") or path.name.endswith(
                ("_pb2.py", "_pb2_grpc.py")):
            continue
        if str(path.relative_to(ROOT)) not in rows:
            missing.append(str(path.relative_to(ROOT)))
    assert not missing, f"ARCHITECTURE.md has no row for: {', '.join(missing)}"
    gone = sorted(r for r in rows if not (ROOT / r).exists())
    assert not gone, f"ARCHITECTURE.md names files that do not exist: {', '.join(gone)}"
