"""Bucketed gradient averaging equals a direct average (tests/support/mpi_progs/buckets_check.py).

Both modes (after backward; overlapped in a comm thread), all three
algorithms, ready() called in backward order, stale, or never, a real MLP's
backward driving ready(); and the fallback to no overlap, with a warning,
when MPI offers less than MPI_THREAD_MULTIPLE.
"""

from __future__ import annotations

import pytest
from support.mpirun import mpirun

pytestmark = pytest.mark.usefixtures("mpiexec")

PROG = "tests/support/mpi_progs/buckets_check.py"


@pytest.mark.parametrize("n", [1, 3])
def test_bucket_reducer_equals_direct_average(n):
    r = mpirun(n, PROG, timeout=120)
    assert r.rc == 0, r
    assert "PASS buckets" in r.stdout, r


def test_without_thread_multiple_it_warns_and_reduces_in_wait():
    r = mpirun(2, PROG, "--expect-no-overlap", timeout=120,
               env={"MPI4PY_RC_THREAD_LEVEL": "serialized"})
    assert r.rc == 0, r
    assert "PASS buckets" in r.stdout, r
    assert "MPI does not provide MPI_THREAD_MULTIPLE" in r.stderr, r
