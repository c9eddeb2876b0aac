"""Every collective against MPI's own and against a direct sum, at this world size.

    mpiexec -n 3 python -m mpi4py tests/support/mpi_progs/collectives_check.py ring
    mpiexec -n 3 python -m mpi4py tests/support/mpi_progs/collectives_check.py comm
    mpiexec -n 3 python -m mpi4py tests/support/mpi_progs/collectives_check.py gpu

Sections: ring (allreduce on every path, reduce_scatter, allgather), comm
(broadcast, alltoallv, send/recv, dup/split, argument errors), gpu (the same
through fake device arrays, staged and GPU-aware). Inputs are rank-valued,
x_r[i] = (r + 1) (1 + i mod 5), so the sum is exact in every dtype; lengths
include 0, 1, N - 1, N + 1 and odd sizes that do not divide by N. A failed
check raises, which ends the job (python -m mpi4py); rank 0 prints
"PASS <section> <number of checks>" at the end.
"""

from __future__ import annotations

import os
import sys
import zlib

import numpy as np
from fakecuda import FakeDeviceArray
from mpi4py import MPI
from rank_checks import RankChecks

from dtlab.collective import Communicator
from dtlab.collective.algorithms.ring import segment_bounds
from dtlab.collective.transport import gpu

DTYPES = (np.float32, np.float64, np.float16, np.int32, np.int64)
# (name, Communicator.ours, chunk_bytes): each of our all-reduce algorithms forced
# for every size (the ring also in many sub-chunks: pipelining and window logic),
# and the choice by size; shared memory only for host arrays
P2P_PATHS = (("ring", "ring", 1 << 20), ("ring-chunked", "ring", 512),
             ("halving", "halving", 1 << 20), ("doubling", "doubling", 1 << 20),
             ("by size", None, 1 << 20))
PATHS = P2P_PATHS + (("shm-one-shot", "shm-one-shot", 1 << 20),
                     ("shm-two-shot", "shm-two-shot", 1 << 20))

comm = Communicator(timeout=60, check="always")
N, R = comm.size, comm.rank
LENGTHS = sorted({0, 1, max(1, N - 1), N + 1, 7, 1001, 20011})
LARGE = 300007  # 0.6-2.4 MB: the choice by size reaches two-shot, halving and the ring
check = RankChecks(R, N)


def rank_input(rank: int, length: int, dtype, rest=()) -> np.ndarray:
    i = np.arange(length * int(np.prod(rest, dtype=np.int64)))
    return ((rank + 1) * (1 + i % 5)).astype(dtype).reshape(length, *rest)


def direct_sum(length: int, dtype, rest=()) -> np.ndarray:
    return sum(rank_input(r, length, np.float64, rest) for r in range(N)).astype(dtype)


def same_on_all_ranks(a: np.ndarray) -> bool:
    return len(set(comm.mpi.allgather(zlib.crc32(a.tobytes())))) == 1


def mpi_allreduce(x: np.ndarray) -> np.ndarray:
    y = x.copy()
    comm.mpi.Allreduce(MPI.IN_PLACE, y, op=MPI.SUM)
    return y


def check_segments() -> None:
    check(segment_bounds(10, 4) == [0, 3, 6, 8, 10], "leftovers go to the first segments")
    check(segment_bounds(2, 4) == [0, 1, 2, 2, 2], "empty trailing segments")
    check(segment_bounds(0, 3) == [0, 0, 0, 0], "empty buffer")


def check_allreduce() -> None:
    for name, ours, chunk in PATHS:
        comm.ours, comm.chunk_bytes = ours, chunk
        for dtype in DTYPES:
            for length in LENGTHS + [LARGE] * (ours is None):
                x = rank_input(R, length, dtype)
                y = comm.allreduce(x.copy())
                what = f"allreduce {name} {np.dtype(dtype).name} L={length}"
                check(np.array_equal(y, direct_sum(length, dtype)), f"{what} != direct sum")
                check(np.array_equal(y, mpi_allreduce(x)), f"{what} != MPI_Allreduce")
            if np.dtype(dtype).kind == "f":
                y = comm.allreduce(rank_input(R, 1001, dtype), average=True)
                expected = np.true_divide(direct_sum(1001, dtype), N)
                check(np.array_equal(y, expected), f"allreduce {name} average {dtype}")
        rng = np.random.default_rng([7, R])
        x = rng.standard_normal(20011).astype(np.float32)
        y = comm.allreduce(x.copy())
        exact = sum(np.random.default_rng([7, r]).standard_normal(20011) for r in range(N))
        check(np.allclose(y, exact, rtol=1e-5, atol=1e-5), f"allreduce {name} random floats")
        check(same_on_all_ranks(y), f"allreduce {name}: ranks hold different bits")
        x2 = rank_input(R, 6, np.float32, (7,))  # (6, 7)
        check(np.array_equal(comm.allreduce(x2), direct_sum(6, np.float32, (7,))), "2-D allreduce")
    for algo in ("naive", "mpi"):
        for dtype in DTYPES:
            for length in LENGTHS:
                y = comm.allreduce(rank_input(R, length, dtype), algo=algo)
                check(np.array_equal(y, direct_sum(length, dtype)),
                      f"allreduce {algo} {np.dtype(dtype).name} L={length}")
        y = comm.allreduce(rank_input(R, 1001, np.float64), algo=algo, average=True)
        check(np.array_equal(y, direct_sum(1001, np.float64) / N), f"{algo} average")
    comm.ours, comm.chunk_bytes = None, 512


def check_repeated_calls() -> None:
    """The same array object again (the fast path past the checks), with the
    algorithm switched in between and its binding evicted by other buffers."""
    twin = comm.dup(name="repeat", persistent_buffers=1)
    x, other = np.empty(5003, np.float32), np.empty(4001, np.float64)
    for ours in (None, "halving", "doubling", "shm-two-shot", "ring", None):
        twin.ours = ours
        for _ in range(3):
            x[:] = rank_input(R, 5003, np.float32)
            twin.allreduce(x)
            check(np.array_equal(x, direct_sum(5003, np.float32)), f"repeated allreduce {ours}")
        other[:] = rank_input(R, 4001, np.float64)  # evicts x's binding (1 kept)
        twin.allreduce(other, average=True)
        check(np.array_equal(other, direct_sum(4001, np.float64) / N), f"evicting call {ours}")
        twin.reduce_scatter(rank_input(R, 4001, np.float64))
        x[:] = rank_input(R, 5003, np.float32)
        twin.allreduce(x, average=True)
        check(np.array_equal(x, np.true_divide(direct_sum(5003, np.float32), N)),
              f"allreduce after eviction {ours}")
    twin.free()


def check_reduce_scatter_allgather() -> None:
    comm.ours, comm.chunk_bytes = None, 512
    for dtype in DTYPES:
        for length in LENGTHS:
            for rest in ((), (3,)):
                x = rank_input(R, length, dtype, rest)
                rows = segment_bounds(length, N)
                full = direct_sum(length, dtype, rest)
                mine = comm.reduce_scatter(x.copy())
                what = f"reduce_scatter {np.dtype(dtype).name} {(length, *rest)}"
                check(np.array_equal(mine, full[rows[R] : rows[R + 1]]), f"{what} != direct")
                ref = np.empty_like(mine)
                width = int(np.prod(rest, dtype=np.int64))
                counts = [(rows[s + 1] - rows[s]) * width for s in range(N)]
                comm.mpi.Reduce_scatter(x, ref, counts, op=MPI.SUM)
                check(np.array_equal(mine, ref), f"{what} != MPI_Reduce_scatter")
                # reduce_scatter then allgather in place == allreduce
                buf = x.copy()
                part = comm.reduce_scatter(buf)
                comm.allgather(part, out=buf, counts=[rows[s + 1] - rows[s] for s in range(N)])
                check(np.array_equal(buf, full), f"{what}: + allgather != allreduce")
        y = comm.reduce_scatter(rank_input(R, 1001, np.float64), average=True)
        rows = segment_bounds(1001, N)
        check(np.array_equal(y, (direct_sum(1001, np.float64) / N)[rows[R] : rows[R + 1]]),
              "reduce_scatter average")
    for dtype in DTYPES:
        counts = [(s * 7 + 3) % 5 for s in range(N)]  # uneven, zeros included
        x = np.full((counts[R], 2), R + 1, dtype=dtype)
        out = comm.allgather(x, counts=counts)
        expected = np.concatenate([np.full((counts[s], 2), s + 1, dtype=dtype) for s in range(N)])
        check(np.array_equal(out, expected), f"allgather uneven {np.dtype(dtype).name}")
        ref = np.empty_like(expected)
        comm.mpi.Allgatherv(x, [ref, [c * 2 for c in counts]])
        check(np.array_equal(out, ref), f"allgather {np.dtype(dtype).name} != MPI_Allgatherv")
        x = rank_input(R, 1001, dtype)
        out = comm.allgather(x)
        check(np.array_equal(out, np.concatenate([rank_input(s, 1001, dtype) for s in range(N)])),
              f"allgather equal {np.dtype(dtype).name}")


def check_broadcast() -> None:
    for root in range(N):
        for dtype in DTYPES:
            for length in LENGTHS:
                x = rank_input(R, length, dtype)
                comm.broadcast(x, root=root)
                check(np.array_equal(x, rank_input(root, length, dtype)),
                      f"broadcast root {root} {np.dtype(dtype).name} L={length}")
                ref = rank_input(R, length, dtype)
                comm.mpi.Bcast(ref, root=root)
                check(np.array_equal(x, ref), f"broadcast root {root} != MPI_Bcast")


def check_alltoallv() -> None:
    for dtype in (np.float32, np.int64, np.float16):
        send_counts = [(R + 2 * d) % 3 for d in range(N)]  # zeros included
        x = np.concatenate(
            [np.full((send_counts[d], 2), 10 * R + d, dtype=dtype) for d in range(N)]
        )  # (sum(send_counts), 2)
        out, recv_counts = comm.alltoallv(x, send_counts)
        check(recv_counts == [(s + 2 * R) % 3 for s in range(N)], "alltoallv recv_counts")
        expected = np.concatenate(
            [np.full((recv_counts[s], 2), 10 * s + R, dtype=dtype) for s in range(N)]
        )
        check(np.array_equal(out, expected), f"alltoallv {np.dtype(dtype).name}")
        ref = np.empty_like(expected)
        sc, rc = [c * 2 for c in send_counts], [c * 2 for c in recv_counts]
        comm.mpi.Alltoallv([x, sc], [ref, rc])
        check(np.array_equal(out, ref), "alltoallv != MPI_Alltoallv")
        out2 = np.empty_like(expected)
        comm.alltoallv(x, send_counts, out=out2, recv_counts=recv_counts)
        check(np.array_equal(out2, expected), "alltoallv with recv_counts")


def check_point_to_point() -> None:
    right, left = (R + 1) % N, (R - 1) % N
    for dtype in (np.float32, np.int64):
        x = rank_input(R, 1001, dtype)
        y = np.zeros_like(x)
        comm.sendrecv(x, right, y, left, tag=5)
        check(np.array_equal(y, rank_input(left, 1001, dtype)), "sendrecv around the ring")
        if N > 1:
            z = np.zeros((7, 3), dtype=dtype)
            if R % 2 == 0:
                comm.send(rank_input(R, 7, dtype, (3,)), right, tag=9)
                comm.recv(z, left, tag=9)
            else:
                comm.recv(z, left, tag=9)
                comm.send(rank_input(R, 7, dtype, (3,)), right, tag=9)
            check(np.array_equal(z, rank_input(left, 7, dtype, (3,))), "send/recv")


def check_new_communicators() -> None:
    sub = comm.split(R % 2, key=-R, name="parity")
    members = [r for r in range(N) if r % 2 == R % 2]
    check(sub.size == len(members) and sub.rank == sorted(members, reverse=True).index(R),
          "split: size and key order")
    x = np.full(5, R + 1.0)
    check(np.array_equal(sub.allreduce(x), np.full(5, sum(m + 1.0 for m in members))),
          "allreduce on a split communicator")
    check(comm.split(None) is None, "split(None) joins no communicator")
    twin = comm.dup(name="twin")
    check(twin.size == N and twin.rank == R and twin.name == "twin", "dup")
    check(np.array_equal(twin.allreduce(np.ones(3)), np.full(3, float(N))), "allreduce on dup")


def check_errors() -> None:
    cases = [
        (lambda: comm.allreduce(np.zeros((4, 4))[:, 0]), ValueError, "C-contiguous"),
        (lambda: comm.allreduce(np.zeros(4), algo="tree"), ValueError, "ours"),
        (lambda: comm.allreduce(np.zeros(4, np.int32), average=True), TypeError, "floating"),
        (lambda: comm.broadcast(np.zeros(4), root=N), ValueError, "root"),
        (lambda: comm.allgather(np.zeros(3), counts=[1] * N), ValueError, "counts"),
        (lambda: comm.alltoallv(np.zeros(3), [4] + [0] * (N - 1)), ValueError, "send_counts"),
        (lambda: Communicator(algo="fast"), ValueError, "algorithm"),
    ]
    for fn, exc, text in cases:
        try:
            fn()
        except exc as e:
            check(text in str(e), f"error message {e!r} lacks {text!r}")
        else:
            check(False, f"no {exc.__name__} for {text}")


def check_gpu() -> None:
    check(gpu.libmpi_cuda_support() is not None, "MPIX_Query_cuda_support not found in libmpi")
    for aware in ("0", "1"):
        os.environ[gpu.AWARE_ENV] = aware
        gpu.mpi_is_gpu_aware.cache_clear()
        check(gpu.mpi_is_gpu_aware() == (aware == "1"), f"{gpu.AWARE_ENV}={aware} not honoured")
        FakeDeviceArray.gets = FakeDeviceArray.sets = 0
        results = {}
        for name, ours, chunk in P2P_PATHS:
            comm.ours, comm.chunk_bytes = ours, chunk
            for length in LENGTHS:
                d = FakeDeviceArray.of(rank_input(R, length, np.float32))
                results[name, length] = comm.allreduce(d)
        for algo in ("naive", "mpi"):
            d = FakeDeviceArray.of(rank_input(R, 1001, np.float32))
            results[algo, 1001] = comm.allreduce(d, algo=algo, average=True)
        rs_in = FakeDeviceArray.of(rank_input(R, 1001, np.float64))
        rs = comm.reduce_scatter(rs_in)
        ag_out = FakeDeviceArray.of(np.zeros((N * 5, 2), np.float32))
        comm.allgather(FakeDeviceArray.of(np.full((5, 2), R, np.float32)), out=ag_out)
        send_counts = [(R + d) % 2 + 1 for d in range(N)]
        a2a_in = FakeDeviceArray.of(
            np.concatenate([np.full(send_counts[d], 10 * R + d, np.float32) for d in range(N)])
        )
        recv_counts = [(s + R) % 2 + 1 for s in range(N)]
        a2a_out = FakeDeviceArray.of(np.zeros(sum(recv_counts), np.float32))
        comm.alltoallv(a2a_in, send_counts, out=a2a_out, recv_counts=recv_counts)
        bc = FakeDeviceArray.of(rank_input(R, 1001, np.int32))
        comm.broadcast(bc, root=N - 1)
        sr = FakeDeviceArray.of(np.zeros(7, np.float32))
        comm.sendrecv(FakeDeviceArray.of(np.full(7, R, np.float32)), (R + 1) % N, sr, (R - 1) % N)
        moved = FakeDeviceArray.gets + FakeDeviceArray.sets
        if N > 1:
            check((moved == 0) == (aware == "1"),
                  f"aware={aware}: {moved} host copies (staging iff not GPU-aware)")
        for (name, length), d in results.items():
            expected = direct_sum(length, np.float32)
            if name in ("naive", "mpi"):
                expected = np.true_divide(expected, N)
            check(np.array_equal(d.get(), expected), f"device allreduce {name} L={length}")
        rows = segment_bounds(1001, N)
        check(np.array_equal(rs.get(), direct_sum(1001, np.float64)[rows[R] : rows[R + 1]]),
              "device reduce_scatter")
        check(np.array_equal(ag_out.get(), np.repeat(np.arange(N, dtype=np.float32), 10)
                             .reshape(N * 5, 2)), "device allgather")
        expected = np.concatenate([np.full(recv_counts[s], 10 * s + R, np.float32)
                                   for s in range(N)])
        check(np.array_equal(a2a_out.get(), expected), "device alltoallv")
        check(np.array_equal(bc.get(), rank_input(N - 1, 1001, np.int32)), "device broadcast")
        check(np.array_equal(sr.get(), np.full(7, (R - 1) % N, np.float32)), "device sendrecv")
    check(raises(lambda: np.asarray(sr), TypeError), "a device array must refuse np.asarray")


def raises(fn, exc) -> bool:
    try:
        fn()
    except exc:
        return True
    return False


SECTIONS = {
    "ring": (check_segments, check_allreduce, check_repeated_calls,
             check_reduce_scatter_allgather),
    "comm": (check_broadcast, check_alltoallv, check_point_to_point, check_new_communicators,
             check_errors),
    "gpu": (check_gpu,),
}

if __name__ == "__main__":
    section = sys.argv[1]
    for fn in SECTIONS[section]:
        fn()
    total = comm.mpi.allreduce(check.passed)
    if R == 0:
        print(f"PASS {section} {total}")
