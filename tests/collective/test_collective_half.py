"""Half-precision collectives are summed as floats, never as bit patterns.

tests/support/mpi_progs/half_check.py runs every all-reduce path (our algorithms
forced one by one and chosen by size, naive, MPI's own with its bfloat16
op) plus reduce-scatter and all-gather on float16 and bfloat16 inputs in a
real MPI job, against the float64 sum within the accumulation rule's bound
(tests/support/mpi_progs/half_bound.py), and shows that the same collectives run on
the bit patterns break that bound. The tests here also check the bound
itself on sums made in this process.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from support.mpi_progs.half_bound import error_bound, unit_roundoff, worst_ratio
from support.mpirun import mpirun

pytestmark = pytest.mark.usefixtures("mpiexec")

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_half_collectives_match_float64_sum_within_rule(n):
    r = mpirun(n, "tests/support/mpi_progs/half_check.py", timeout=120)
    assert r.rc == 0, r
    assert "PASS half" in r.stdout, r
    reached = next(line for line in r.stdout.splitlines() if line.startswith("BY SIZE"))
    algos = set(reached.split()[-1].split(","))
    # the choice by size reached the small, the shared-memory and a large path
    assert "doubling" in algos and algos & {"shm-one-shot", "shm-two-shot"}, r
    assert algos & {"halving", "ring"}, r


def hop_by_hop_sum(xs: list[np.ndarray]) -> np.ndarray:
    """((x0 + x1) + x2) + ..., each addition in the dtype's own add (float32, rounded)."""
    acc = xs[0].copy()
    for x in xs[1:]:
        np.add(acc, x, out=acc)
    return acc


def inputs(n: int, dtype) -> list[np.ndarray]:
    rng = np.random.default_rng(5)
    return [(rng.standard_normal(50_000) * 2.0 ** rng.integers(-6, 7, 50_000)).astype(dtype)
            for _ in range(n)]


@pytest.mark.parametrize("dtype", [F16, BF16], ids=["float16", "bfloat16"])
@pytest.mark.parametrize("n", [2, 3, 4, 8])
def test_rule_bound_holds_for_float_sums_and_breaks_for_bit_patterns(dtype, n):
    xs = inputs(n, dtype)
    exact = sum(x.astype(np.float64) for x in xs)
    abs_sum = sum(np.abs(x.astype(np.float64)) for x in xs)
    assert worst_ratio(hop_by_hop_sum(xs), exact, abs_sum, dtype, n - 1) <= 1.0
    bits = hop_by_hop_sum([x.view(np.uint16) for x in xs]).view(dtype)  # the bug
    assert worst_ratio(bits, exact, abs_sum, dtype, n - 1) > 1.0


def test_bound_is_k_roundings_of_the_unit_roundoff():
    assert unit_roundoff(BF16) == 2.0**-8 and unit_roundoff(F16) == 2.0**-11
    bound = error_bound(BF16, 3, np.array([1.0]))  # (1,)
    assert 3 * 2.0**-8 < bound[0] < 3 * 2.0**-8 * 1.02
    # one ulp off (twice the worst of the one rounding allowed) is caught
    one = np.array([1.0 + 2.0**-7], dtype=BF16)  # (1,): 1 + 1 ulp
    assert worst_ratio(one, np.array([1.0]), np.array([1.0]), BF16, 1) > 1.0
