"""The quantized ring's error feedback (collective/algorithms/quantized_ring.py, `residual`)
against its definition and its purpose.

    mpiexec -n N python -m mpi4py tests/support/mpi_progs/quantized_feedback_check.py

Rank r's vector is a seeded draw of its own (quantized_check.py's: scales from 1e-3 to
30 across blocks, a block of zeros), at 8 and 4 bits:
- keeping the residual leaves the result's bits as they are without it;
- the residual's segment that rank r quantizes first (its own contribution alone) is its
  vector less the dequantized payload, bit for bit; the residuals sum to the exact sum
  less the result, up to the float32 rounding of the N - 1 additions;
- the same vectors all-reduced T = 64 times, each rank adding its residual to the next
  step's input: the mean of the results is within |sum_r e_r| / T (plus rounding) of the
  exact sum, at least 10x closer than without feedback, whose result, the same at every
  step, keeps its error.
"""

from __future__ import annotations

import numpy as np

from dtlab.collective.algorithms.quantized_ring import quantized_allreduce
from dtlab.collective.algorithms.ring import segment_bounds
from dtlab.collective.comm import world
from dtlab.models import quantize

comm = world()
N, r = comm.size, comm.rank
n, T = 1000, 64


def draw(rank: int) -> np.ndarray:
    rng = np.random.default_rng(1000 + rank)
    scale = np.repeat([1e-3, 1.0, 30.0, 0.0, 2.0], -(-n // 5))[:n]
    return (rng.standard_normal(n) * scale).astype(np.float32)


def ranks_sum(a: np.ndarray) -> np.ndarray:
    """(n,) float64: the sum over the ranks of `a`, exactly (every rank's, in rank order)."""
    return sum(np.asarray(b, np.float64) for b in comm.mpi.allgather(a))


g = draw(r)
exact = ranks_sum(g)  # (n,)
rounding = 4 * np.finfo(np.float32).eps * ranks_sum(np.abs(g))
seg = segment_bounds(n, N)
for bits in (8, 4):
    x, e, plain = g.copy(), np.empty_like(g), g.copy()
    quantized_allreduce(comm, plain, bits)
    quantized_allreduce(comm, x, bits, residual=e)
    assert np.array_equal(x, plain), (bits, "keeping the residual changed the result")
    first = slice(seg[(r - 1) % N], seg[(r - 1) % N + 1])  # quantized at the first hop
    own = g[first] - quantize.dequantize(quantize.quantize(g[first], bits))
    assert np.array_equal(e[first], own), (bits, "the first hop's residual")
    gap = np.abs(ranks_sum(e) - (exact - x))
    assert np.all(gap <= rounding), (bits, float((gap - rounding).max()))

    total = np.zeros(n)
    e.fill(0)
    for _ in range(T):
        x = g + e
        quantized_allreduce(comm, x, bits, residual=e)
        total += x
    with_ef = np.abs(total / T - exact).max()
    without = np.abs(plain - exact).max()
    allowed = np.abs(ranks_sum(e)).max() / T + rounding.max()
    assert with_ef <= allowed, (bits, with_ef, allowed)
    assert with_ef * 10 <= without, (bits, with_ef, without)
    if r == 0:
        print(f"N={N} int{bits}: mean of {T} results off the exact sum by {with_ef:.3g} with "
              f"error feedback, {without:.3g} without")
