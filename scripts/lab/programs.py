"""dtlab's programs as the lab starts them: this interpreter with `-m MODULE`.

Started by module, not by a console script found next to the interpreter, so
the lab works wherever the package is importable (a venv, `pip install --user`,
a source checkout on PYTHONPATH) and every process runs the same Python.
"""

from __future__ import annotations

import sys

MODULES = {
    "dtlab-sync": "dtlab.collective.train",
    "dtlab-pserver": "dtlab.pserver",
    "dtlab-worker": "dtlab.pserver.worker",
    "dtlab-train": "dtlab.models.run.train",
}


def program(name: str) -> list[str]:
    """The command line that runs dtlab's program `name` (e.g. "dtlab-sync")."""
    return [sys.executable, "-m", MODULES[name]]
