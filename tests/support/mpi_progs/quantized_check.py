"""The quantized ring all-reduce (collective/algorithms/quantized_ring.py) against the direct sum.

    mpiexec -n N python -m mpi4py tests/support/mpi_progs/quantized_check.py

Rank r's vector is a seeded draw of its own (scales from 1e-3 to 30 across blocks, a
block of zeros), at lengths that do not divide by N or by the block; for 8 and 4 bits
every element of the result is within its bound (the half-scales of the N quantizations
it went through) plus float32 rounding of the N - 1 additions, every rank holds the same
bits, a block of zeros stays exactly zero, and the bytes sent are the payloads of the
ring's 2 (N - 1) steps.
"""

from __future__ import annotations

import numpy as np

from dtlab.collective.algorithms.quantized_ring import quantized_allreduce
from dtlab.collective.algorithms.ring import segment_bounds
from dtlab.collective.comm import world
from dtlab.models import quantize

comm = world()
N, r = comm.size, comm.rank


def draw(rank: int, n: int) -> np.ndarray:
    rng = np.random.default_rng(1000 + rank)
    scale = np.repeat([1e-3, 1.0, 30.0, 0.0, 2.0], -(-n // 5))[:n]
    return (rng.standard_normal(n) * scale).astype(np.float32)


for n in (1, 7, 1000, 3 * 256 + 5):
    for bits in (8, 4):
        x = draw(r, n)
        exact = sum(draw(k, n).astype(np.float64) for k in range(N))  # (n,)
        got = quantized_allreduce(comm, x, bits, track_bound=True)
        rounding = 4 * np.finfo(np.float32).eps * sum(np.abs(draw(k, n)) for k in range(N))
        err = np.abs(x.astype(np.float64) - exact)
        over = err - (got.bound * (1 + 1e-6) + rounding)
        assert np.all(over <= 0), (N, n, bits, float(over.max()))
        zeros = np.repeat([1e-3, 1.0, 30.0, 0.0, 2.0], -(-n // 5))[:n] == 0
        assert np.all(x[zeros] == 0)
        everyone = comm.mpi.allgather(x.tobytes())
        assert all(b == everyone[0] for b in everyone), "ranks hold different results"
        seg = segment_bounds(n, N)
        sizes = [seg[s + 1] - seg[s] for s in range(N)]
        expect = 0 if N == 1 else (
            sum(quantize.payload_bytes(sizes[(r - t - 1) % N], bits) for t in range(N - 1))
            + sum(quantize.payload_bytes(sizes[(r - t) % N], bits) for t in range(N - 1)))
        assert got.sent_bytes == expect, (got.sent_bytes, expect)
        if n == 1000 and r == 0:
            print(f"N={N} bits={bits}: max error {err.max():.3g}, max bound "
                  f"{got.bound.max():.3g}, sent {got.sent_bytes} bytes "
                  f"(float32 ring: {8 * (N - 1) * n // N})")
