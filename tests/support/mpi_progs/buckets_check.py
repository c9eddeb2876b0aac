"""The bucket reducer in both modes equals a direct average (tests/collective/test_buckets.py).

    mpiexec -n 3 python -m mpi4py tests/support/mpi_progs/buckets_check.py
    MPI4PY_RC_THREAD_LEVEL=serialized mpiexec -n 2 python -m mpi4py \
        tests/support/mpi_progs/buckets_check.py --expect-no-overlap

Gradients are rank-valued, g_r[i] = (r + 1) (1 + (i + step) mod 5), so the
average is exact and compared with ==. A simulated backward fills the
buffer from its end towards the start in uneven strides, calling ready()
after each stride with a matmul in between (which releases the GIL, as
backward does); it also calls ready() out of order and not at all. Last, a
real MLP's backward drives ready() through Replica.compute_grads, compared
with MPI's own Allreduce of the same local gradients. A half-precision wire
(fp16, bf16) stays within its rounding bound of the float64 average. Rank 0 prints
"PASS buckets <checks>".
"""

from __future__ import annotations

import sys
import warnings

import numpy as np
from mpi4py import MPI
from rank_checks import RankChecks

from dtlab.collective import BucketReducer, world
from dtlab.collective.reducers.buckets import bucket_bounds
from dtlab.models.mlp import MLP, MLPConfig
from dtlab.models.model import Replica

comm = world(timeout=60)
N, R = comm.size, comm.rank
L = 10007
check = RankChecks(R, N)


def local_grad(rank: int, step: int, lo: int = 0, hi: int = L) -> np.ndarray:
    i = np.arange(lo, hi)
    return ((rank + 1) * (1 + (i + step) % 5)).astype(np.float32)


def expected_average(step: int) -> np.ndarray:
    total = sum(local_grad(r, step).astype(np.float64) for r in range(N)).astype(np.float32)
    return np.true_divide(total, N)


def fake_backward(grad: np.ndarray, step: int, ready, stride: int = 777) -> None:
    a = np.ones((96, 96), np.float32)
    for hi in range(L, 0, -stride):
        lo = max(0, hi - stride)
        grad[lo:hi] = local_grad(R, step, lo, hi)
        a = a @ a / 96  # (96, 96): GIL-free work while buckets reduce
        ready(lo)
        ready(hi)  # a stale, higher offset must change nothing


def check_modes(algo: str | None) -> None:
    grad = np.zeros(L, np.float32)
    for overlap in (False, True):
        with BucketReducer(comm, grad, bucket_bytes=4000, overlap=overlap, algo=algo) as red:
            check(red.buckets == bucket_bounds(L, 1000) and red.buckets[0] == (L - 1000, L),
                  "buckets are laid out from the end of the buffer")
            for step in range(3):
                fake_backward(grad, step, red.ready)
                t = red.wait()
                check(np.array_equal(grad, expected_average(step)),
                      f"overlap={overlap} algo={algo} step {step}: not the direct average")
                check(t.buckets == 11 and t.comm_s > 0 and t.wait_s >= 0, f"timing {t}")
            grad[:] = local_grad(R, 5)  # ready() never called: wait() does everything
            red.wait()
            check(np.array_equal(grad, expected_average(5)), f"overlap={overlap}: no ready()")


def check_wire(wire: str, unit_roundoff: float) -> None:
    """A half-precision wire averages within the per-hop rounding bound: the cast in,
    at most N - 1 rounded additions, the division, the cast is exact back."""
    rng = np.random.default_rng([3, R])
    mine = rng.uniform(0.5, 2.0, L).astype(np.float32)  # positive: no cancellation
    every = comm.mpi.allgather(mine)
    exact = np.mean(np.array(every, dtype=np.float64), axis=0)
    grad = mine.copy()
    with BucketReducer(comm, grad, bucket_bytes=4000, wire=wire) as red:
        t = red.wait()
    bound = (N + 2) * unit_roundoff
    err = float(np.max(np.abs(grad - exact) / exact))
    check(err <= bound, f"wire {wire}: relative error {err:.2e} > {bound:.2e}")
    check(N == 1 or (t.wire_bytes == 2 * L and red.shadow.dtype.itemsize == 2),
          f"wire {wire}: {t.wire_bytes} bytes moved for {L} elements")
    check(len(set(comm.mpi.allgather(grad.tobytes()))) == 1, f"wire {wire}: ranks differ")


def check_model() -> None:
    model = MLP(MLPConfig(d_in=12, d_hidden=40, n_layers=3, n_classes=5))
    params = model.init_params(seed=0)
    replica = Replica(model, params)
    rng = np.random.default_rng([11, R])
    batches = [(rng.standard_normal((8, 12)).astype(np.float32), rng.integers(0, 5, 8))
               for _ in range(2)]
    replica.compute_grads(batches)
    reference = params.grad.copy()
    comm.mpi.Allreduce(MPI.IN_PLACE, reference, op=MPI.SUM)
    reference /= N
    with BucketReducer(comm, params.grad, bucket_bytes=1024) as red:
        calls = []
        replica.compute_grads(batches, grad_ready=lambda off: (calls.append(off), red.ready(off)))
        red.wait()
    check(calls == sorted(calls, reverse=True) and calls[-1] == 0,
          f"backward reports offsets from the end down to 0: {calls}")
    check(np.allclose(params.grad, reference, rtol=1e-5, atol=1e-7), "MLP: reducer != MPI average")
    check(len({float(params.grad.sum())} | set(comm.mpi.allgather(float(params.grad.sum())))) == 1,
          "MLP: every rank holds the same averaged gradient")


if __name__ == "__main__":
    expect_no_overlap = "--expect-no-overlap" in sys.argv
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        probe = BucketReducer(comm, np.zeros(10, np.float32), overlap=True)
        probe.close()
    warned = any("MPI_THREAD_MULTIPLE" in str(w.message) for w in caught)
    if N > 1:
        check(probe.overlap != expect_no_overlap, f"overlap={probe.overlap}")
        check(warned == expect_no_overlap, "warning iff MPI lacks THREAD_MULTIPLE")
    for algo in (None, "naive", "mpi"):
        check_modes(algo)
    check_wire("fp16", 2.0 ** -11)
    check_wire("bf16", 2.0 ** -8)
    check_model()
    total = comm.mpi.allreduce(check.passed)
    if R == 0:
        print(f"PASS buckets {total}")
