"""Ring all-reduce, reduce-scatter and all-gather (and the recursive-doubling,
naive and MPI all-reduce paths) at world sizes 1-4, in real MPI jobs.

One `mpiexec` per world size runs every case (tests/mpi_progs/collectives_check.py
section "ring"): rank-valued inputs against the direct sum and against MPI's
own collective, dtypes float16/32/64 and int32/64, lengths 0, 1, N +- 1 and odd
sizes, 1-D and 2-D buffers, the unchunked and sub-chunked ring, averages, and
bit-identical results on every rank.
"""

from __future__ import annotations

import pytest
from mpirun import mpirun

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_ring_collectives_match_direct_sum_and_mpi(n):
    r = mpirun(n, "tests/mpi_progs/collectives_check.py", "ring", timeout=120)
    assert r.rc == 0, r
    assert "PASS ring" in r.stdout, r
