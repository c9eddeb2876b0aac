"""The suite's one rule about MPI: a test that starts mpiexec asks for the `mpiexec`
fixture (or uses it for its whole module: `pytestmark = pytest.mark.usefixtures("mpiexec")`),
which marks it `mpi`. Every other test runs with $DTLAB_MPIEXEC pointing at a launcher
that refuses to start, so a test that launches MPI without saying so fails by name, and
`pytest -m "not mpi"` starts no MPI process."""

from __future__ import annotations

import os
import stat

import pytest
from support import emulated_runs

from dtlab.models.run.launcher_env import mpiexec_path

REFUSE = """#!/bin/sh
echo "this test starts mpiexec without the mpiexec fixture (tests/conftest.py)" >&2
exit 97
"""


def pytest_collection_modifyitems(items):
    for item in items:
        if {"mpiexec", "emulated_validation"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.mpi)


@pytest.fixture
def mpiexec() -> str:
    """The mpiexec this test's jobs run under; marks the test `mpi`."""
    return mpiexec_path()


@pytest.fixture(scope="session")
def emulated_validation(tmp_path_factory) -> emulated_runs.Validation:
    """dtlab-simulate --validate across 2 emulated hosts at 1 and 0.1 Gbit/s, run once for
    every test that asks (support/emulated_runs.py); such a test asks for `mpiexec` too."""
    return emulated_runs.validate(tmp_path_factory.mktemp("emulated"))


@pytest.fixture(autouse=True)
def _no_undeclared_mpiexec(request, tmp_path_factory, monkeypatch):
    if "mpiexec" in request.fixturenames or os.environ.get("DTLAB_MPIEXEC"):
        return
    refuse = tmp_path_factory.getbasetemp() / "refusing-mpiexec"
    if not refuse.exists():
        refuse.write_text(REFUSE)
        refuse.chmod(refuse.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("DTLAB_MPIEXEC", str(refuse))
