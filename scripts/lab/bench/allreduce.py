"""All-reduce benchmark: our algorithms vs the naive one vs MPI's own Allreduce.

    mpiexec -n 4 dtlab-bench allreduce --json allreduce-n4.json  # 4 KB..64 MB
    mpiexec -bind-to core -n 4 dtlab-bench allreduce             # ranks pinned
    mpiexec -n 2 dtlab-bench allreduce --max-bytes 1M            # shorter sweep
    mpiexec -n 3 dtlab-bench allreduce --tiny                    # seconds (tests)
    dtlab-bench allreduce --launches 5 --ranks 2,4 --algos ring,mpi  # medians

One launch (under mpiexec): for every power-of-two size from --min-bytes to
--max-bytes (float32 SUM, in place) each algorithm is warmed up and then
timed for a size-dependent number of iterations (about 64 MB moved, between
3 and 1000 calls), in --rounds rounds that interleave the algorithms, so
noise from other processes on a shared machine falls on all of them alike,
in an order rotated every round (on an oversubscribed host an algorithm's
time depends on which one ran just before it); a round's time is the
slowest rank's mean, the reported time the best round (the JSON also has
the median round). MPI's Allreduce is called directly (MPI.IN_PLACE),
without our wrapper's overhead.

--launches K (run without mpiexec): launches `mpiexec -n N` K times for each
N of --ranks, interleaved (N = 2, 4, 2, 4, ...), and prints per N the median
over launches of each launch's figure, ours against MPI's, the floors of the
mid-size issue checked on those medians, and writes every launch's rows to
--json. One launch can be lucky or unlucky on a shared machine; the median
of several is the figure to quote.

    algbw = bytes / time        busbw = algbw * 2 (n - 1) / n        (GB = 1e9 B)

busbw is the bandwidth each rank's link carried in a bandwidth-optimal
all-reduce (nccl-tests' definition), comparable across n. #wrong counts
elements that differ from the exact rank sum after one verification call
with inputs x_r[i] = (r + 1) (1 + i mod 3), whose sum is exact in float.
"ring" is `Communicator.allreduce(algo="ours")`, our point-to-point family;
its `via` says which algorithm the size took (collective/algorithms/choose.py): "rd"
recursive doubling, "shm1" / "shm2" shared-memory one-shot / two-shot, "hd"
halving-doubling, "ring" the ring. The exit status is 1 when any element was
wrong.

(figures: scripts/RESULTS.md)
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

import numpy as np

from dtlab.collective.algorithms.choose import OURS
from dtlab.lab.bench import harness
from dtlab.lab.bench.harness import VIA, count_wrong, iterations, parse_bytes, parse_list
from dtlab.models.run.launcher_env import mpiexec_path

ALGOS = ("ring", "naive", "mpi")
COMM_ALGO = {"ring": "ours"}  # the row "ring" is Communicator.allreduce(algo="ours")
MID = (64 << 10, 1 << 20)  # the mid-size issue's range for the time floor


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--min-bytes", type=parse_bytes, default=4 << 10,
                   help="smallest buffer, e.g. 4K (default: 4K); sizes double up to --max-bytes")
    p.add_argument("--max-bytes", type=parse_bytes, default=64 << 20,
                   help="largest buffer, e.g. 1M (default: 64M)")
    p.add_argument("--dtype", default="float32", choices=("float16", "float32", "float64"),
                   help="element type, summed (default: float32)")
    p.add_argument("--rounds", type=int, default=7,
                   help="timed rounds per size, the algorithms in rotated order (default: 7)")
    p.add_argument("--warmup", type=int, default=3,
                   help="untimed calls of each algorithm per size first (default: 3)")
    p.add_argument("--algos", default=",".join(ALGOS),
                   type=lambda t: parse_list(t, "--algos", ALGOS),
                   help="comma-separated subset of ring,naive,mpi (ring and mpi always run)")
    p.add_argument("--chunk-bytes", type=parse_bytes, default=None,
                   help="ring sub-chunk (default: the Communicator's)")
    p.add_argument("--ours", choices=OURS, default=None,
                   help="force one of our algorithms for every size (default: by size, "
                        "collective/algorithms/choose.py)")
    harness.common_flags(p, "4-16 KB, 5 iterations, 1 round")
    harness.launch_flags(p, "run without mpiexec: launch it this many times per --ranks and "
                            "print the median over launches", ranks="2,4")
    args = p.parse_args(argv)
    if args.tiny:
        args.min_bytes, args.max_bytes, args.rounds, args.warmup = 4 << 10, 16 << 10, 1, 1
    if args.min_bytes < 1 or args.max_bytes < args.min_bytes:
        p.error(f"need 0 < --min-bytes <= --max-bytes, got {args.min_bytes}, {args.max_bytes}")
    if args.rounds < 1 or args.warmup < 0 or args.launches < 0:
        p.error("--rounds must be >= 1, --warmup and --launches >= 0")
    args.algos = [a for a in ALGOS if a in {"ring", "mpi", *args.algos}]
    return args


# ---- one launch (under mpiexec) ---------------------------------------------


def run_algo(comm, algo: str, buf: np.ndarray, iters: int) -> float:
    """Mean seconds per call over `iters` calls, slowest rank."""
    from mpi4py import MPI

    if algo == "mpi":
        return harness.slowest(comm, lambda: comm.mpi.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM),
                               iters)
    ours = COMM_ALGO.get(algo, algo)
    return harness.slowest(comm, lambda: comm.allreduce(buf, algo=ours), iters)


def measure(comm, args) -> list[dict]:
    dtype = np.dtype(args.dtype)
    n, algos = comm.size, args.algos
    rows = []
    size = args.min_bytes
    while size <= args.max_bytes:
        count = max(1, size // dtype.itemsize)
        buf = np.zeros(count, dtype=dtype)  # (count,) zeros: values stay 0 while timing
        iters = iterations(buf.nbytes, args.tiny)
        for algo in algos:
            for _ in range(args.warmup):
                run_algo(comm, algo, buf, 1)
        rounds: dict[str, list[float]] = {algo: [] for algo in algos}
        for k in range(args.rounds):
            shift = k % len(algos)
            for algo in algos[shift:] + algos[:shift]:  # rotated: no fixed predecessor
                rounds[algo].append(run_algo(comm, algo, buf, iters))
        for algo in algos:
            wrong = count_wrong(comm, COMM_ALGO.get(algo, algo), buf)
            best = min(rounds[algo])
            algbw = buf.nbytes / best / 1e9
            via = algo
            if algo == "ring":
                via = VIA[comm.ours_for(buf.nbytes)]
            rows.append({
                "algo": algo, "n": n, "bytes": buf.nbytes, "count": count, "dtype": dtype.name,
                "time_us": best * 1e6, "algbw": algbw, "busbw": algbw * 2 * (n - 1) / n,
                "time_us_median": statistics.median(rounds[algo]) * 1e6,
                "wrong": wrong, "iters": iters, "via": via,
            })
            buf[:] = 0
        size *= 2
    return rows


def table(rows: list[dict], n: int, algos: list[str]) -> str:
    """One line per size: each algorithm's time, algbw, busbw, #wrong (ring: and via), then
    the busbw ratios; a column's title names its algorithm (nccl-tests' groups)."""
    by_size: dict[int, dict[str, dict]] = {}
    for r in rows:
        by_size.setdefault(r["bytes"], {})[r["algo"]] = r
    columns = [harness.Column("size", 10, lambda g: g["size"]),
               harness.Column("count", 10, lambda g: next(iter(g["algos"].values()))["count"]),
               harness.Column("type", 7, lambda g: next(iter(g["algos"].values()))["dtype"])]
    for a in algos:
        def of(key, a=a):
            return lambda g: g["algos"][a][key]
        columns += [harness.Column(f"{a} time(us)", len(a) + 9, of("time_us"), ".1f"),
                    harness.Column("algbw", 7, of("algbw"), ".2f"),
                    harness.Column("busbw", 7, of("busbw"), ".2f"),
                    harness.Column("#wrong", 6, of("wrong"))]
        if a == "ring":
            columns.append(harness.Column("via", 6, lambda g: f"({g['algos']['ring']['via']})"))
    for other in ("mpi", "naive"):
        if other in algos:
            columns.append(harness.Column(
                f"ring/{other}", 10, lambda g, o=other: g["algos"]["ring"]["busbw"]
                / g["algos"][o]["busbw"], ".2f"))
    t = harness.Table(
        "ring = our all-reduce, via = the algorithm it took (rd recursive doubling, shm1/shm2 "
        "shared-memory one-/two-shot, hd halving-doubling, ring); naive = reduce to rank 0 + "
        "broadcast; mpi = MPI_Allreduce; algbw = bytes/time; busbw = algbw * 2(n-1)/n; "
        "#wrong = elements unlike the exact sum; ring/mpi, ring/naive = busbw ratios (> 1 "
        "favours ours)", columns)
    lines = [f"# n={n}  float SUM in place; time = best round's mean, slowest rank; GB = 1e9 B",
             t.head(), *(t.line({"size": size, "algos": got})
                         for size, got in sorted(by_size.items()))]
    return "\n".join(lines) + "\n"


def summary(rows: list[dict]) -> str:
    by = {(r["algo"], r["bytes"]): r for r in rows}
    sizes = sorted({r["bytes"] for r in rows})
    big = [s for s in sizes if s >= 1 << 20]
    out = [f"# total #wrong: {sum(r['wrong'] for r in rows)}\n"]
    if big:
        vs_mpi = min(by["ring", s]["busbw"] / by["mpi", s]["busbw"] for s in big)
        med = min(by["mpi", s]["time_us_median"] / by["ring", s]["time_us_median"] for s in big)
        out.append(f"# >= 1 MB: worst ring/mpi busbw {vs_mpi:.2f} (on median rounds {med:.2f})\n")
    s = sizes[0]
    ratio = by["ring", s]["time_us"] / by["mpi", s]["time_us"]
    out.append(f"# {s} B: ring time / mpi time {ratio:.2f}\n")
    return "".join(out)


def one_launch(args) -> int:
    from dtlab.collective.comm import world

    settings = {"ours": args.ours}
    if args.chunk_bytes is not None:
        settings["chunk_bytes"] = args.chunk_bytes
    comm = world(**settings)
    load_before = os.getloadavg()[0]
    rows = measure(comm, args)
    if comm.rank == 0:
        load_after = os.getloadavg()[0]
        load = f"# load average (1 min) before / after: {load_before:.2f} / {load_after:.2f}\n"
        sys.stdout.write(table(rows, comm.size, args.algos) + summary(rows) + load)
        if args.json:
            harness.write(args.json, "allreduce", rows, mpi=True, n=comm.size,
                          chunk_bytes=comm.chunk_bytes, ours=comm.ours, rounds=args.rounds,
                          load_before=load_before, load_after=load_after)
    return 1 if any(r["wrong"] for r in rows) else 0


# ---- several launches, medians (no mpiexec around this process) --------------


def launch_args(argv: list[str]) -> list[str]:
    """argv without the options that only the launcher reads."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in ("--launches", "--ranks", "--json"):
            skip = True
        elif not a.startswith(("--launches=", "--ranks=", "--json=")):
            out.append(a)
    return out


def median_rows(launches: list[list[dict]]) -> list[dict]:
    """Per (algo, bytes): the median over launches of time_us, and busbw at that time
    (rows of the table "median")."""
    out = []
    for rows in zip(*launches, strict=True):
        first = rows[0]
        t = statistics.median(r["time_us"] for r in rows)
        n = first["n"]
        out.append({**first, "table": "median", "time_us": t, "algbw": first["bytes"] / t / 1e3,
                    "busbw": first["bytes"] / t / 1e3 * 2 * (n - 1) / n,
                    "time_us_launches": [r["time_us"] for r in rows],
                    "wrong": sum(r["wrong"] for r in rows)})
    return out


MEDIAN_TABLE = harness.Table(
    "ours = Communicator.allreduce (via: rd recursive doubling, shm1/shm2 shared-memory "
    "one-/two-shot, hd halving-doubling, ring); mpi = MPI_Allreduce; time o/m = ours/mpi "
    "time (< 1 favours ours); busbw = bytes/time * 2(n-1)/n, GB/s; busbw o/m = ours/mpi "
    "busbw (> 1 favours ours); spread = min..max of the per-launch time o/m; gap/step = "
    "(ours - mpi) / 2(n-1) us, what each of the ring's 2(n-1) steps costs beyond MPI's whole "
    "call (via ring only)",
    [harness.Column("size", 10, lambda p: p["ours"]["bytes"]),
     harness.Column("ours(us)", 9, lambda p: p["ours"]["time_us"], ".1f"),
     harness.Column("via", 5, lambda p: p["ours"]["via"]),
     harness.Column("mpi(us)", 9, lambda p: p["mpi"]["time_us"], ".1f"),
     harness.Column("time o/m", 9, lambda p: p["ours"]["time_us"] / p["mpi"]["time_us"], ".2f"),
     harness.Column("busbw ours", 10, lambda p: p["ours"]["busbw"], ".2f"),
     harness.Column("busbw mpi", 10, lambda p: p["mpi"]["busbw"], ".2f"),
     harness.Column("busbw o/m", 9, lambda p: p["ours"]["busbw"] / p["mpi"]["busbw"], ".2f"),
     harness.Column("spread", 11, lambda p: f"{min(p['each']):.2f}..{max(p['each']):.2f}"),
     harness.Column("gap/step", 8, lambda p: p["gap_step"], ".1f"),
     harness.Column("#wrong", 6, lambda p: p["ours"]["wrong"] + p["mpi"]["wrong"])])


def median_table(rows: list[dict], n: int, k: int) -> str:
    by = {(r["algo"], r["bytes"]): r for r in rows}
    sizes = sorted({r["bytes"] for r in rows})
    lines = [f"# n={n}: median over {k} launches of each launch's time (its best round's mean, "
             "slowest rank)", MEDIAN_TABLE.head()]
    for s in sizes:
        ours, mpi = by["ring", s], by["mpi", s]
        each = [o / m for o, m in zip(ours["time_us_launches"], mpi["time_us_launches"],
                                      strict=True)]
        gap = (ours["time_us"] - mpi["time_us"]) / (2 * (n - 1)) if ours["via"] == "ring" \
            else None
        lines.append(MEDIAN_TABLE.line({"ours": ours, "mpi": mpi, "each": each,
                                        "gap_step": gap}))
    return "\n".join(lines) + "\n" + floors(by, sizes) + "\n"


def floors(by: dict, sizes: list[int]) -> str:
    """The mid-size issue's floors on the medians: time <= 1.25x MPI's from 64 KB to
    1 MB, busbw >= 1.0x MPI's from 1 MB, time <= 2x MPI's below 64 KB."""
    missed = []
    for s in sizes:
        ratio = by["ring", s]["time_us"] / by["mpi", s]["time_us"]
        limits = [2.0] if s < MID[0] else []
        limits += [1.25] if MID[0] <= s <= MID[1] else []
        limits += [1.0] if s >= MID[1] else []
        if ratio > min(limits):
            missed.append(f"{s} B at {ratio:.2f}x (limit {min(limits):.2f}x)")
    verdict = "all met" if not missed else "missed: " + ", ".join(missed)
    return f"# floors (time <= 2x below 64K, <= 1.25x 64K-1M, busbw >= 1x from 1M): {verdict}"


def many_launches(args, argv: list[str]) -> int:
    passed = launch_args(argv)
    launches: dict[int, list[list[dict]]] = {n: [] for n in args.ranks}
    metas: dict[int, list[dict]] = {n: [] for n in args.ranks}
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(args.launches):
            for n in launches:
                out = os.path.join(tmp, f"n{n}-{k}.json")
                cmd = [mpiexec_path(), "-n", str(n), sys.executable, "-m",
                       "dtlab.lab.bench.allreduce", *passed, "--json", out]
                run = subprocess.run(cmd, env=env, capture_output=True, text=True)
                if run.returncode != 0:
                    sys.stderr.write(f"launch {k + 1} at n={n} failed ({run.returncode}): "
                                     f"{' '.join(cmd)}\n{run.stdout[-2000:]}{run.stderr[-2000:]}")
                    return 1
                meta, rows = harness.read(out)
                launches[n].append(rows)
                metas[n].append(meta)
    medians = {n: median_rows(runs) for n, runs in launches.items()}
    for n, rows in medians.items():
        sys.stdout.write(median_table(rows, n, args.launches))
    if args.json:
        each = [{**r, "table": "launch", "launch": k} for runs in launches.values()
                for k, rows in enumerate(runs) for r in rows]
        harness.write(args.json, "allreduce", each + [r for rows in medians.values()
                                                      for r in rows], mpi=True,
                      launches=args.launches, ranks=[int(n) for n in launches],
                      launch_meta={n: m for n, m in metas.items()})
    return 1 if any(r["wrong"] for rows in medians.values() for r in rows) else 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.launches:
        if any(v in os.environ for v in ("PMI_RANK", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE")):
            sys.stderr.write("--launches runs mpiexec itself: start it without mpiexec\n")
            return 2
        return many_launches(args, argv)
    return one_launch(args)


if __name__ == "__main__":
    sys.exit(main())
