"""Ring all-reduce, reduce-scatter and all-gather (and the recursive-doubling,
naive and MPI all-reduce paths) at world sizes 1-4, in real MPI jobs.

One `mpiexec` per world size runs every case (tests/support/mpi_progs/collectives_check.py
section "ring"): rank-valued inputs against the direct sum and against MPI's
own collective, dtypes float16/32/64 and int32/64, lengths 0, 1, N +- 1 and odd
sizes, 1-D and 2-D buffers, the unchunked and sub-chunked ring, averages, and
bit-identical results on every rank.
"""

from __future__ import annotations

import os

import pytest
from support.mpirun import mpirun

pytestmark = pytest.mark.usefixtures("mpiexec")


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_ring_collectives_match_direct_sum_and_mpi(n):
    r = mpirun(n, "tests/support/mpi_progs/collectives_check.py", "ring", timeout=120)
    assert r.rc == 0, r
    assert "PASS ring" in r.stdout, r


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two CPUs to bind ranks to")
def test_ring_follows_cpu_binding_and_stays_correct():
    """Ranks bound round-robin to CPUs 0,1,0,1 form the ring 0,2,1,3 (neighbours share a
    CPU), and every collective is still right."""
    order = mpirun(4, "-c", "from collective.comm import world; c = world(); "
                   "o = c._link.ring()[0]; c.rank == 0 and print('ORDER', o)",
                   launcher_args=("-bind-to", "user:0,1,0,1"), timeout=60)
    assert order.rc == 0 and "ORDER [0, 2, 1, 3]" in order.stdout, order
    r = mpirun(4, "tests/support/mpi_progs/collectives_check.py", "ring",
               launcher_args=("-bind-to", "user:0,1,0,1"), timeout=120)
    assert r.rc == 0 and "PASS ring" in r.stdout, r
