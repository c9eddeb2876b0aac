"""float16 and bfloat16 collectives against the float64 sum, at this world size.

    mpiexec -n 3 python -m mpi4py tests/support/mpi_progs/half_check.py

Every all-reduce path (each of our algorithms forced, the ring also in
512-byte sub-chunks, the choice by size, naive, MPI's own) and the ring
reduce-scatter / all-gather, on random inputs spread over 2^-6..2^6, checked
element by element against the float64 sum of the inputs within the bound of
the accumulation rule (tests/support/mpi_progs/half_bound.py: N - 1 roundings, N
when averaging). Then the bug the rule excludes, the same collectives run on
the bit patterns (the buffers viewed as uint16, so integers are added), must
fail that bound, which shows the check can fail. A failed check raises,
which ends the job (python -m mpi4py); rank 0 prints
"PASS half <checks>", "BY SIZE <algorithms the choice reached>" and
"WORST <dtype> <largest error / bound>".
"""

from __future__ import annotations

import functools
import zlib

import ml_dtypes
import numpy as np
from half_bound import worst_ratio
from mpi4py import MPI
from rank_checks import RankChecks

from dtlab.collective import Communicator
from dtlab.collective.algorithms.ring import segment_bounds
from dtlab.collective.transport.link import mpi_sum

HALF = (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16))
# (name, Communicator.ours, chunk_bytes, algo)
PATHS = (("ring", "ring", 1 << 20, "ours"), ("ring-chunked", "ring", 512, "ours"),
         ("halving", "halving", 1 << 20, "ours"), ("doubling", "doubling", 1 << 20, "ours"),
         ("shm-one-shot", "shm-one-shot", 1 << 20, "ours"),
         ("shm-two-shot", "shm-two-shot", 1 << 20, "ours"),
         ("naive", None, 1 << 20, "naive"), ("mpi", None, 1 << 20, "mpi"))

comm = Communicator(timeout=60, check="always")
N, R = comm.size, comm.rank
LENGTHS = (1, N + 1, 1001, 20011)
# by size, from 2 KB to 2.2 MB: recursive doubling, shared memory, then halving or the ring
BY_SIZE = (1001, 20011, 150001, 1100003)
check = RankChecks(R, N)
worst = {d.name: 0.0 for d in HALF}


def rank_input(rank: int, length: int, dtype) -> np.ndarray:
    """Rank `rank`'s (length,) input: normal values times 2^-6..2^6, in `dtype`."""
    rng = np.random.default_rng([11, rank, length])
    return (rng.standard_normal(length) * 2.0 ** rng.integers(-6, 7, length)).astype(dtype)


@functools.lru_cache(maxsize=8)
def reference(length: int, dtype) -> tuple[np.ndarray, np.ndarray]:
    """(exact sum, sum of |x_r|) in float64 over every rank's input, (L,) each."""
    xs = [rank_input(r, length, dtype).astype(np.float64) for r in range(N)]
    return sum(xs), sum(np.abs(x) for x in xs)


def ratio(got: np.ndarray, dtype, length: int, average: bool, rows=slice(None)) -> float:
    exact, abs_sum = (a[rows] for a in reference(length, dtype))
    if average:
        return worst_ratio(got, exact / N, abs_sum / N, dtype, N)
    return worst_ratio(got, exact, abs_sum, dtype, N - 1)


def within(got: np.ndarray, dtype, length: int, what: str, average=False, rows=slice(None)):
    r = ratio(got, dtype, length, average, rows)
    worst[dtype.name] = max(worst[dtype.name], r)
    check(r <= 1.0, f"{what}: error {r:.3g} x the rule's bound")


def same_on_all_ranks(a: np.ndarray) -> bool:
    return len(set(comm.mpi.allgather(zlib.crc32(a.tobytes())))) == 1


def check_allreduce() -> set[str]:
    reached = set()
    for name, ours, chunk, algo in PATHS + (("by size", None, 1 << 20, "ours"),):
        comm.ours, comm.chunk_bytes = ours, chunk
        lengths = LENGTHS + (BY_SIZE[-1],) * (algo == "mpi") if ours or algo != "ours" \
            else BY_SIZE
        for dtype in HALF:
            for length in lengths:
                if name == "by size":
                    reached.add(comm.ours_for(length * dtype.itemsize))
                y = comm.allreduce(rank_input(R, length, dtype), algo=algo)
                what = f"allreduce {name} {dtype.name} L={length}"
                check(y.dtype == dtype, f"{what}: dtype became {y.dtype}")
                within(y, dtype, length, what)
                if algo != "mpi":
                    check(same_on_all_ranks(y), f"{what}: ranks hold different bits")
            y = comm.allreduce(rank_input(R, 1001, dtype), algo=algo, average=True)
            within(y, dtype, 1001, f"allreduce {name} {dtype.name} average", average=True)
    comm.ours, comm.chunk_bytes = None, 1 << 20
    return reached


def check_reduce_scatter_allgather() -> None:
    for dtype in HALF:
        for length in (N + 1, 20011):
            rows = segment_bounds(length, N)
            mine_rows = slice(rows[R], rows[R + 1])
            for average in (False, True):
                mine = comm.reduce_scatter(rank_input(R, length, dtype), average=average)
                within(mine, dtype, length, f"reduce_scatter {dtype.name} L={length}",
                       average=average, rows=mine_rows)
            counts = [rows[s + 1] - rows[s] for s in range(N)]
            part = rank_input(R, length, dtype)[mine_rows]
            out = comm.allgather(part, counts=counts)
            expected = np.concatenate([rank_input(s, length, dtype)[rows[s] : rows[s + 1]]
                                       for s in range(N)])
            check(np.array_equal(out.view(np.uint16), expected.view(np.uint16)),
                  f"allgather {dtype.name} L={length}: not the owners' bits")


def check_bit_pattern_sum_fails() -> None:
    """The bug: our ring and MPI's Allreduce on the buffer viewed as uint16 add the
    bit patterns as integers; the result, read back as floats, must break the bound."""
    comm.ours = "ring"
    for dtype in HALF:
        for algo in ("ours", "mpi"):
            bits = comm.allreduce(rank_input(R, 20011, dtype).view(np.uint16), algo=algo)
            r = ratio(bits.view(dtype), dtype, 20011, average=False)
            check(r > 1.0, f"a bit-pattern sum ({algo}, {dtype.name}) passed the float bound "
                           f"(error {r:.3g} x bound)")
    comm.ours = None


def check_mpi_messages() -> None:
    """What MPI's own Allreduce is handed: native types as they are, bfloat16 as
    2-byte elements with our op, a dtype with no sum refused by name."""
    f32 = np.zeros(3, np.float32)
    msg, op = mpi_sum(f32)
    check(msg is f32 and op == MPI.SUM, "float32 must go to MPI_SUM as it is")
    msg, op = mpi_sum(np.zeros(3, ml_dtypes.bfloat16))
    check(op != MPI.SUM and msg[1] == 3 and msg[2].Get_size() == 2, "bfloat16 message")
    try:
        mpi_sum(np.zeros(3, "V4"))
    except TypeError as e:
        check("V4" in str(e), f"the refusal names the dtype: {e}")
    else:
        check(False, "a dtype with no add was accepted")


check_mpi_messages()
reached = check_allreduce()
check_reduce_scatter_allgather()
if N > 1:
    check_bit_pattern_sum_fails()
total = comm.mpi.allreduce(check.passed)
if R == 0:
    print(f"PASS half {total}")
    print("BY SIZE " + ",".join(sorted(reached)))
    for name, r in worst.items():
        print(f"WORST {name} {r:.3f}")
