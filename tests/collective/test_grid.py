"""The dp x pp x ep x tp process grid in real MPI jobs (tests/support/mpi_progs/grid_check.py).

At 8 ranks every grid shape with product 8 is built and checked: coordinates
(tp fastest), the members of every sub-communicator, the flat names
(`pp_next`, `pp_is_last_stage`, ...), a message passed down the pipeline, a
tp all-reduce, the node-local rank, and GridError for shapes that do not fit.
"""

from __future__ import annotations

import pytest
from support.mpirun import mpirun

pytestmark = pytest.mark.usefixtures("mpiexec")


@pytest.mark.parametrize("n", [1, 8])
def test_grid_communicators_and_names(n):
    r = mpirun(n, "tests/support/mpi_progs/grid_check.py", timeout=120)
    assert r.rc == 0, r
    assert "PASS grid" in r.stdout, r
