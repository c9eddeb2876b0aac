"""All-reduce benchmark: our ring vs the naive algorithm vs MPI's own Allreduce.

    mpiexec -n 4 python scripts/bench_allreduce.py --json allreduce-n4.json  # 4 KB..64 MB
    mpiexec -bind-to core -n 4 python scripts/bench_allreduce.py             # ranks pinned
    mpiexec -n 2 python scripts/bench_allreduce.py --max-bytes 1M            # shorter sweep
    mpiexec -n 3 python scripts/bench_allreduce.py --tiny                    # seconds (tests)

For every power-of-two size from --min-bytes to --max-bytes (float32 SUM,
in place) each algorithm is warmed up and then timed for a size-dependent
number of iterations (about 64 MB moved, between 3 and 1000 calls), in
--rounds rounds that interleave the algorithms, so noise from other
processes on a shared machine falls on all of them alike, in an order
rotated every round (on an oversubscribed host an algorithm's time depends
on which one ran just before it: a fixed order favoured whichever followed
the naive algorithm by up to 2x); a round's time is
the slowest rank's mean, the reported time the best round (the JSON also
has the median round, and the summary the ratio on medians). MPI's Allreduce
is called directly (MPI.IN_PLACE), without our wrapper's overhead.

With more ranks than cores, where the scheduler puts each rank moves the
result, for MPI and the ring alike; pinning (`-bind-to core`) makes launches
more comparable, and the ring then orders itself so that neighbours share a
core (collective/link.py). The ring/MPI ratio at 4 ranks once swung between
about 0.6 and 1.2 from one launch to the next, pinned or not: that was the
heap layout (scratch 16 bytes past the buffer, a slow case of the kernel's
CMA copy; see collective/link.py mirror()), not the scheduler.

    algbw = bytes / time        busbw = algbw * 2 (n - 1) / n        (GB = 1e9 B)

busbw is the bandwidth each rank's link carried in a bandwidth-optimal
all-reduce (nccl-tests' definition), comparable across n. #wrong counts
elements that differ from the exact rank sum after one verification call
with inputs x_r[i] = (r + 1) (1 + i mod 3), whose sum is exact in float.
The ring column's `via` says which path the ring took: "ring" or "rd"
(recursive doubling, below the communicator's small_bytes). The exit
status is 1 when any element was wrong.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import numpy as np
from mpi4py import MPI

from dtlab.collective.comm import DEFAULT_CHUNK_BYTES, DEFAULT_SMALL_BYTES, world

ALGOS = ("ring", "naive", "mpi")
MOVED_PER_SIZE = 64 << 20


def parse_bytes(text: str) -> int:
    """'4K' -> 4096, '64M' -> 67108864, '123' -> 123."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    text = text.strip().upper().removesuffix("B")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--min-bytes", type=parse_bytes, default=4 << 10)
    p.add_argument("--max-bytes", type=parse_bytes, default=64 << 20)
    p.add_argument("--dtype", default="float32", choices=("float16", "float32", "float64"))
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--chunk-bytes", type=parse_bytes, default=DEFAULT_CHUNK_BYTES)
    p.add_argument("--small-bytes", type=parse_bytes, default=DEFAULT_SMALL_BYTES)
    p.add_argument("--tiny", action="store_true", help="4-16 KB, 5 iterations, 1 round")
    p.add_argument("--json", help="write the rows (and run metadata) here")
    args = p.parse_args(argv)
    if args.tiny:
        args.min_bytes, args.max_bytes, args.rounds, args.warmup = 4 << 10, 16 << 10, 1, 1
    if args.min_bytes < 1 or args.max_bytes < args.min_bytes:
        p.error(f"need 0 < --min-bytes <= --max-bytes, got {args.min_bytes}, {args.max_bytes}")
    if args.rounds < 1 or args.warmup < 0:
        p.error("--rounds must be >= 1 and --warmup >= 0")
    return args


def iterations(nbytes: int, tiny: bool) -> int:
    return 5 if tiny else max(3, min(1000, MOVED_PER_SIZE // nbytes))


def run_algo(comm, algo: str, buf: np.ndarray, iters: int) -> float:
    """Mean seconds per call over `iters` calls, slowest rank."""
    mpi = comm.mpi
    comm.barrier()
    start = time.perf_counter()
    if algo == "mpi":
        for _ in range(iters):
            mpi.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
    else:
        for _ in range(iters):
            comm.allreduce(buf, algo=algo)
    mean = (time.perf_counter() - start) / iters
    return mpi.allreduce(mean, op=MPI.MAX)


def count_wrong(comm, algo: str, buf: np.ndarray) -> int:
    n, idx = comm.size, np.arange(buf.size)
    buf[:] = (comm.rank + 1) * (1 + idx % 3)
    if algo == "mpi":
        comm.mpi.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
    else:
        comm.allreduce(buf, algo=algo)
    expected = (n * (n + 1) // 2) * (1 + idx % 3)
    return comm.mpi.allreduce(int(np.count_nonzero(buf != expected)), op=MPI.SUM)


def measure(comm, args) -> list[dict]:
    dtype = np.dtype(args.dtype)
    n = comm.size
    rows = []
    size = args.min_bytes
    while size <= args.max_bytes:
        count = max(1, size // dtype.itemsize)
        buf = np.zeros(count, dtype=dtype)  # (count,) zeros: values stay 0 while timing
        iters = iterations(buf.nbytes, args.tiny)
        for algo in ALGOS:
            for _ in range(args.warmup):
                run_algo(comm, algo, buf, 1)
        rounds: dict[str, list[float]] = {algo: [] for algo in ALGOS}
        for k in range(args.rounds):
            for algo in ALGOS[k % 3:] + ALGOS[:k % 3]:  # rotated: no fixed predecessor
                rounds[algo].append(run_algo(comm, algo, buf, iters))
        for algo in ALGOS:
            wrong = count_wrong(comm, algo, buf)
            best = min(rounds[algo])
            algbw = buf.nbytes / best / 1e9
            via = algo
            if algo == "ring":
                via = "rd" if buf.nbytes <= comm.small_bytes else "ring"
            rows.append({
                "algo": algo, "n": n, "bytes": buf.nbytes, "count": count, "dtype": dtype.name,
                "time_us": best * 1e6, "algbw": algbw, "busbw": algbw * 2 * (n - 1) / n,
                "time_us_median": statistics.median(rounds[algo]) * 1e6,
                "wrong": wrong, "iters": iters,
                "via": via,
            })
            buf[:] = 0
        size *= 2
    return rows


def table(rows: list[dict], n: int) -> str:
    by_size: dict[int, dict[str, dict]] = {}
    for r in rows:
        by_size.setdefault(r["bytes"], {})[r["algo"]] = r
    group = "{:>9} {:>7} {:>7} {:>6} {:>5}"
    head1 = f"# n={n}  float SUM in place; time = best round's mean, slowest rank; GB = 1e9 B\n"
    head2 = (f"# {'':>10} {'':>10} {'':>7}  "
             + "  ".join(f"{a + ('(via)' if a == 'ring' else ''):^{40 if a == 'ring' else 37}}"
                         for a in ALGOS)
             + "   ring/mpi  ring/naive\n")
    cols = group.format("time(us)", "algbw", "busbw", "#wrong", "")
    head3 = (f"# {'size':>10} {'count':>10} {'type':>7}  "
             + "  ".join(cols if a == "ring" else cols[:-6] for a in ALGOS)
             + "   busbw     busbw\n")
    lines = [head1, head2, head3]
    for size, algos in sorted(by_size.items()):
        first = next(iter(algos.values()))
        cells = []
        for a in ALGOS:
            r = algos[a]
            cell = group.format(f"{r['time_us']:.1f}", f"{r['algbw']:.2f}", f"{r['busbw']:.2f}",
                                r["wrong"], f"({r['via']})" if a == "ring" else "")
            cells.append(cell if a == "ring" else cell[:-6])
        ratio_mpi = algos["ring"]["busbw"] / algos["mpi"]["busbw"]
        ratio_naive = algos["ring"]["busbw"] / algos["naive"]["busbw"]
        lines.append(f"  {size:>10} {first['count']:>10} {first['dtype']:>7}  " + "  ".join(cells)
                     + f"   {ratio_mpi:7.2f}   {ratio_naive:7.2f}\n")
    return "".join(lines)


def summary(rows: list[dict]) -> str:
    by = {(r["algo"], r["bytes"]): r for r in rows}
    sizes = sorted({r["bytes"] for r in rows})
    big = [s for s in sizes if s >= 1 << 20]
    out = [f"# total #wrong: {sum(r['wrong'] for r in rows)}\n"]
    if big:
        vs_mpi = min(by["ring", s]["busbw"] / by["mpi", s]["busbw"] for s in big)
        vs_naive = min(by["ring", s]["busbw"] / by["naive", s]["busbw"] for s in big)
        med = min(by["mpi", s]["time_us_median"] / by["ring", s]["time_us_median"] for s in big)
        out.append(f"# >= 1 MB: worst ring/mpi busbw {vs_mpi:.2f} (on median rounds {med:.2f}), "
                   f"worst ring/naive busbw {vs_naive:.2f}\n")
    s = sizes[0]
    ratio = by["ring", s]["time_us"] / by["mpi", s]["time_us"]
    out.append(f"# {s} B: ring time / mpi time {ratio:.2f}\n")
    return "".join(out)


def main(argv=None) -> int:
    args = parse_args(argv)
    comm = world(chunk_bytes=args.chunk_bytes, small_bytes=args.small_bytes)
    load_before = os.getloadavg()[0]
    rows = measure(comm, args)
    if comm.rank == 0:
        load_after = os.getloadavg()[0]
        load = f"# load average (1 min) before / after: {load_before:.2f} / {load_after:.2f}\n"
        sys.stdout.write(table(rows, comm.size) + summary(rows) + load)
        if args.json:
            meta = {
                "n": comm.size, "host": platform.node(), "python": platform.python_version(),
                "numpy": np.__version__, "mpi": MPI.Get_library_version().splitlines()[0],
                "chunk_bytes": comm.chunk_bytes, "small_bytes": comm.small_bytes,
                "rounds": args.rounds, "argv": sys.argv[1:],
                "load_before": load_before, "load_after": os.getloadavg()[0],
            }
            with open(args.json, "w") as f:
                json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 1 if any(r["wrong"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
