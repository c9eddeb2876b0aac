"""The Communicator's protocol beyond all-reduce, in real MPI jobs of 1-4 ranks.

Section "comm" of tests/support/mpi_progs/collectives_check.py: binomial broadcast
from every root, pairwise all-to-all(v) with uneven and empty blocks,
send/recv/sendrecv around a ring, split/dup, and clear errors for bad
arguments, each against MPI's own collective and a direct computation.
Section "gpu": the same collectives on arrays that expose only
`__cuda_array_interface__` (host memory, as in mpi4py's tests), once staged
through host memory and once handed to MPI directly (GPU-aware).
"""

from __future__ import annotations

import pytest
from support.mpirun import mpirun

pytestmark = pytest.mark.usefixtures("mpiexec")


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_broadcast_alltoallv_p2p_and_errors(n):
    r = mpirun(n, "tests/support/mpi_progs/collectives_check.py", "comm", timeout=120)
    assert r.rc == 0, r
    assert "PASS comm" in r.stdout, r


@pytest.mark.parametrize("n", [1, 3])
def test_device_arrays_staged_and_gpu_aware(n):
    r = mpirun(n, "tests/support/mpi_progs/collectives_check.py", "gpu", timeout=120)
    assert r.rc == 0, r
    assert "PASS gpu" in r.stdout, r
