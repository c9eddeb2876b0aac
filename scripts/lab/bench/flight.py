"""Flight recorder overhead: what recording each all-reduce
(collective/transport/flight.py) adds to it.

    mpiexec -n 2 dtlab-bench flight --json flight-n2.json    # 4 KB..16 MB
    mpiexec -n 4 dtlab-bench flight --max-bytes 1M           # shorter sweep
    mpiexec -n 2 dtlab-bench flight --tiny                   # seconds (tests)

One launch (under mpiexec). For every power-of-two size from --min-bytes to
--max-bytes (float32 SUM in place, `Communicator.allreduce` on the same array
every call, as a training step's buckets are: the call's fast path) each
repetition times, one right after the other on the same array,

  off  the all-reduce on a duplicate of the communicator made with
       flight=False (collective/transport/flight.py's Off recorder: nothing recorded),
       the mean of a size-dependent number of calls (about 64 MB moved, 3 to
       1000 calls), the slowest rank's;
  on   the same on the communicator as every run has it, recorder included;
  rec  the recorder's part of one call on its own, on every rank at once:
       the start/done pair `Communicator.allreduce` makes (Recorder.start with
       the call's op, bytes, dtype and algorithm into the process's ring, then
       Recorder.done), in blocks of 1000 pairs, each less the same loop
       empty; the median block (one the scheduler preempted on a shared host
       is an outlier), the slowest rank's;

and the table gives the medians over --reps repetitions and

    overhead = on - off        ratio = on / off

The difference of two timed runs is the recorder's cost plus the noise of
both (on a shared host a few tenths of a microsecond either way); `rec` is
the cost alone, with the ring and the clock warm, and the floor `overhead`
should come near. #wrong counts elements unlike the exact rank sum after one
verification call (inputs x_r[i] = (r + 1) (1 + i mod 3), exact in float).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

from dtlab.lab.bench import harness
from dtlab.lab.bench.harness import VIA, count_wrong, iterations, parse_bytes

BLOCK = 1000  # recorder pairs timed at a stretch


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--min-bytes", type=parse_bytes, default=4 << 10,
                   help="smallest buffer, e.g. 4K (default: 4K); sizes double up to --max-bytes")
    p.add_argument("--max-bytes", type=parse_bytes, default=16 << 20,
                   help="largest buffer, e.g. 1M (default: 16M)")
    p.add_argument("--reps", type=int, default=7,
                   help="repetitions per size, each timing the all-reduce and then the "
                        "recorder; the table gives their medians (default: 7)")
    p.add_argument("--pairs", type=int, default=20000,
                   help="recorder start/done pairs timed per repetition, in whole blocks of "
                        "1000 (the median block's time; default: 20000)")
    p.add_argument("--warmup", type=int, default=3,
                   help="untimed all-reduces per size first (default: 3)")
    harness.common_flags(p, "4-16 KB, 5 calls, 3 repetitions of 2000 pairs")
    args = p.parse_args(argv)
    if args.tiny:
        args.min_bytes, args.max_bytes, args.reps, args.pairs, args.warmup = (
            4 << 10, 16 << 10, 3, 2000, 1)
    if args.min_bytes < 4 or args.max_bytes < args.min_bytes:
        p.error(f"need 4 <= --min-bytes <= --max-bytes (one float32), got {args.min_bytes}, "
                f"{args.max_bytes}")
    if args.reps < 1 or args.pairs < 1 or args.warmup < 0:
        p.error("--reps and --pairs must be >= 1, --warmup >= 0")
    return args


def allreduce_s(comm, buf: np.ndarray, iters: int) -> float:
    """Mean seconds per `comm.allreduce(buf)` over `iters` calls, slowest rank."""
    return harness.slowest(comm, lambda: comm.allreduce(buf), iters)


def recorder_s(comm, recorder, buf: np.ndarray, algo: str, pairs: int) -> float:
    """Seconds per start/done pair of `recorder` (as Communicator.allreduce makes them for
    `buf`), less the empty loop's own time per turn: the median of blocks of BLOCK pairs
    (a block the scheduler preempted, on a shared host, is an outlier), slowest rank."""
    from mpi4py import MPI

    from dtlab.collective.transport.flight import Recorder

    nbytes, dtype, block = buf.nbytes, buf.dtype, min(BLOCK, pairs)
    comm.barrier()
    blocks = []
    for _ in range(max(1, pairs // block)):
        start = time.perf_counter()
        for _ in range(block):
            e = recorder.start("allreduce", nbytes, dtype, algo)
            Recorder.done(e)
        middle = time.perf_counter()
        for _ in range(block):
            pass
        end = time.perf_counter()
        blocks.append(((middle - start) - (end - middle)) / block)
    return comm.mpi.allreduce(statistics.median(blocks), op=MPI.MAX)


def measure(comm, args) -> list[dict]:
    from dtlab.collective.transport.flight import Recorder

    off_comm = comm.dup("bench-flight-off", flight=False)  # the same settings, no recorder
    # a recorder of its own (made on every rank alike): its entries share the ring
    recorder = Recorder("bench-flight", comm.rank, list(range(comm.size)))
    rows, size = [], args.min_bytes
    while size <= args.max_bytes:
        count = size // 4
        buf = np.zeros(count, np.float32)  # (count,) zeros: values stay 0 while timing
        iters = iterations(buf.nbytes, args.tiny)
        via = comm.ours_for(buf.nbytes)
        for _ in range(args.warmup):
            comm.allreduce(buf)
            off_comm.allreduce(buf)
        off, on, rec = [], [], []
        for _ in range(args.reps):
            off.append(allreduce_s(off_comm, buf, iters))
            on.append(allreduce_s(comm, buf, iters))
            rec.append(recorder_s(comm, recorder, buf, via, args.pairs))
        wrong = count_wrong(comm, "ours", buf)
        t_off, t_on = statistics.median(off) * 1e6, statistics.median(on) * 1e6
        rows.append({
            "n": comm.size, "bytes": buf.nbytes, "count": count, "dtype": "float32",
            "via": VIA[via], "time_off_us": t_off, "time_on_us": t_on,
            "overhead_us": t_on - t_off, "recorder_us": statistics.median(rec) * 1e6,
            "ratio": t_on / t_off,
            "time_off_us_reps": [t * 1e6 for t in off], "time_on_us_reps": [t * 1e6 for t in on],
            "recorder_us_reps": [t * 1e6 for t in rec],
            "iters": iters, "pairs": args.pairs, "wrong": wrong,
        })
        size *= 2
    off_comm.free()
    return rows


LEGEND = ("# legend: off = Communicator.allreduce with the recorder off (flight=False), "
          "on = with it (as every run has it), each the mean per call, slowest rank, median "
          "over repetitions; via = the algorithm it took (rd recursive doubling, shm1/shm2 "
          "shared-memory one-/two-shot, hd halving-doubling, ring); overhead = on - off; "
          "rec = the recorder's start/done pair per call timed on its own (median block of "
          "1000, slowest rank, median); ratio = on / off; #wrong = elements unlike the "
          "exact sum\n")


TABLE = harness.Table(
    LEGEND.removeprefix("# legend: ").rstrip("\n"),
    [harness.Column("size", 10, lambda r: r["bytes"]),
     harness.Column("count", 10, lambda r: r["count"]),
     harness.Column("type", 7, lambda r: r["dtype"]),
     harness.Column("via", 5, lambda r: r["via"]),
     harness.Column("off(us)", 10, lambda r: r["time_off_us"], ".2f"),
     harness.Column("on(us)", 10, lambda r: r["time_on_us"], ".2f"),
     harness.Column("overhead(us)", 12, lambda r: r["overhead_us"], ".3f"),
     harness.Column("rec(us)", 8, lambda r: r["recorder_us"], ".3f"),
     harness.Column("ratio", 8, lambda r: r["ratio"], ".4f"),
     harness.Column("#wrong", 6, lambda r: r["wrong"])])


def table(rows: list[dict], n: int, reps: int) -> str:
    lines = [f"# n={n}  float32 SUM in place; medians over {reps} repetitions; us = "
             "microseconds", TABLE.head(), *map(TABLE.line, rows)]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    args = parse_args(argv)

    from dtlab.collective.comm import world

    comm = world()
    load_before = os.getloadavg()[0]
    rows = measure(comm, args)
    if comm.rank == 0:
        load_after = os.getloadavg()[0]
        worst = max(r["recorder_us"] for r in rows)
        sys.stdout.write(table(rows, comm.size, args.reps)
                         + f"# total #wrong: {sum(r['wrong'] for r in rows)}\n"
                         + f"# largest recorder pair (rec): {worst:.3f} us per call\n"
                         + f"# load average (1 min) before / after: {load_before:.2f} / "
                           f"{load_after:.2f}\n")
        if args.json:
            harness.write(args.json, "flight", rows, mpi=True, n=comm.size, reps=args.reps,
                          pairs=args.pairs,
                          off="timed: a duplicate communicator with flight=False",
                          load_before=load_before, load_after=load_after)
    return 1 if any(r["wrong"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
