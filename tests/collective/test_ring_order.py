"""The ring's sum has exactly the bits of its summation order, whichever memory it adds in.

The segment the rank at ring position s finishes is summed around the ring from
position s + 1: ((a[s+1] + a[s+2]) + ...) + a[s]. ring_allreduce keeps partial
sums in scratch (slot += own, not own += slot) and at two ranks swaps the ranks'
segments every call (collective/algorithms/ring.py); both only commute the two
operands of an add, so random float32 inputs must give that order's bits exactly,
call after call (a turn the ranks disagreed on would mismatch the message sizes of
the odd lengths below), unchunked and in 512-byte sub-chunks (slots reused).
"""

from __future__ import annotations

import pytest
from support.mpirun import mpirun

pytestmark = pytest.mark.usefixtures("mpiexec")

PROGRAM = """
import numpy as np
from mpi4py import MPI
from dtlab.collective.algorithms.ring import ring_allreduce, segment_bounds
from dtlab.collective.transport.link import Link

link = Link(MPI.COMM_WORLD.Dup(), "order", 60)
n, rank = link.size, link.rank
order, _ = link.ring()
wrong = 0
for chunk_bytes in (1 << 20, 512):
    for length in (1001, 4099):
        x = [np.random.default_rng([11, q, length]).standard_normal(length).astype(np.float32)
             for q in range(n)]  # every rank's input, (length,) each
        bounds = segment_bounds(length, n)
        expect = np.empty(length, np.float32)  # (length,)
        for s in range(n):  # the segment position s finishes, summed from s + 1 on
            lo, hi = bounds[order[s]], bounds[order[s] + 1]
            acc = x[order[(s + 1) % n]][lo:hi].copy()
            for k in range(2, n + 1):
                acc += x[order[(s + k) % n]][lo:hi]
            expect[lo:hi] = acc
        buf = np.empty(length, np.float32)
        for _ in range(3):
            buf[:] = x[rank]
            ring_allreduce(link, buf, xp=np, sync=None, chunk_bytes=chunk_bytes, divide=None)
            wrong += int(np.count_nonzero(buf.view(np.uint32) != expect.view(np.uint32)))
wrong = link.comm.allreduce(wrong)
if rank == 0:
    print("WRONG", wrong)
"""


@pytest.mark.parametrize("n", [2, 4])
def test_ring_sum_has_the_bits_of_its_order(n):
    r = mpirun(n, "-c", PROGRAM, timeout=60)
    assert r.rc == 0 and "WRONG 0" in r.stdout, r
