"""Ring all-reduce step by step: where each of its 2(N - 1) steps spends its time, beside MPI's.

    mpiexec -n 4 dtlab-bench ring_steps                          # 64 KB..1 MB
    mpiexec -n 2 dtlab-bench ring_steps --min-bytes 256K --max-bytes 256K
    mpiexec -n 2 dtlab-bench ring_steps --tiny                   # seconds (tests)

One launch (under mpiexec). For every power-of-two size from --min-bytes to
--max-bytes (float32 SUM in place, the same array every call, as a training
step's buckets are; it starts 16 bytes into a page on every rank, where
NumPy's arrays from mmap start, so that runs compare across sizes whatever
the heap did) each of --reps repetitions times, in rotated order,

  ours   Communicator.allreduce with ours="ring" (what `dtlab-bench allreduce
         --ours ring` times), the mean of a size-dependent number of calls
         (about 64 MB moved, 3 to 1000), slowest rank;
  ring   ring_allreduce (collective/algorithms/ring.py) alone, on a Link of its
         own, the same way: `ours` less the Communicator's call layers;
  ring1  the same with turns=1: every rank reduces the same segment every call
         (at two ranks ring_allreduce swaps them each call; above two ranks ring1
         is ring, not timed again);
  mpi    MPI_Allreduce (MPI.IN_PLACE) on the same buffer, the same way;

and then runs the ring with `Link.stamps` set (collective/transport/stamps.py),
which records every call the ring's loop makes. Message m of the ring is its
Wait for the left neighbour's chunk, the add of a reduce step, the post of
the next receive and the Start of this chunk's send onward; per step (the C messages
of its sub-chunks summed), as the mean over the recorded calls no slower
than the median one (preempted calls left out) on each rank, then the mean
over ranks:

  wait   in the Wait: the peer's lateness, the copy of the bytes (within a node
         MPICH moves messages of 8 KB and more by CMA, a copy the receiver makes
         inside its wait) and the call itself
  add    np.add into the buffer (reduce steps)
  start  the Start of this chunk's send onward (a persistent request)
  post   posting the next receive: its Start, and for a gather receive first a
         Test of (or Wait for) our send of the same memory, i.e. for the right
         neighbour to have copied it
  py     the rest of the step: the loop's own Python, and the stamps' cost
  step   the sum, the time from this step's Wait to the next's

plus a "lead" row (from the call to the first Wait: the binding lookup, the
first receives posted, the first sends started) and a "tail" row (from the
last message to the return: the Waitall on our sends). Three costs measured
on their own in the same launch bound the pieces of a wait:

  call   the Wait of a persistent receive from MPI_PROC_NULL, complete when
         started: a Wait's fixed cost through mpi4py and MPICH, nothing to move
  copy   np.copyto of one step's bytes between buffers at the same page offset:
         the memory copy inside the wait cannot be cheaper
  stamp  what recording one call adds (on `py`)

and the closing lines give, per size, ours/mpi, the gap (ours - mpi) per
step, and how the stamped step splits into the neighbours' part (wait + post
- call - copy: their lateness and the transfer beyond a plain copy, what no
local cut removes) and our fixed part (call + start + py - stamps: the
Python and mpi4py costs a step pays whatever the size); `aligned` says
whether our buffer starts at the left neighbour's offset within a page, so
that every receive lands at its sender's page offset (collective/transport/pages.py;
buffers below glibc's mmap threshold, 128 KB, come from the heap at offsets
that differ by rank). #wrong counts elements of the stamped and the unstamped
ring unlike the exact rank sum (inputs x_r[i] = (r + 1)(1 + i mod 3)).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

from dtlab.lab.bench import harness
from dtlab.lab.bench.harness import Column, Table, iterations, parse_bytes

KINDS = ("wait", "add", "start", "post")
STAMPED_CALLS = 200  # recorded calls per repetition at most
BUF_OFFSET = 16  # the buffer's offset within a page on every rank (where mmap'd arrays start)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--min-bytes", type=parse_bytes, default=64 << 10,
                   help="smallest buffer, e.g. 64K (default: 64K); sizes double up to "
                        "--max-bytes")
    p.add_argument("--max-bytes", type=parse_bytes, default=1 << 20,
                   help="largest buffer, e.g. 1M (default: 1M)")
    p.add_argument("--reps", type=int, default=5,
                   help="repetitions per size; times are their medians (default: 5)")
    p.add_argument("--warmup", type=int, default=3,
                   help="untimed calls of each per size first (default: 3)")
    p.add_argument("--chunk-bytes", type=parse_bytes, default=None,
                   help="ring sub-chunk (default: the Communicator's)")
    harness.common_flags(p, "16-32 KB, 5 calls, 2 repetitions")
    args = p.parse_args(argv)
    if args.tiny:
        args.min_bytes, args.max_bytes, args.reps, args.warmup = 16 << 10, 32 << 10, 2, 1
    if args.min_bytes < 4 or args.max_bytes < args.min_bytes:
        p.error(f"need 4 <= --min-bytes <= --max-bytes (one float32), got {args.min_bytes}, "
                f"{args.max_bytes}")
    if args.reps < 1 or args.warmup < 0:
        p.error("--reps must be >= 1, --warmup >= 0")
    if args.chunk_bytes is not None and args.chunk_bytes < 1:
        p.error(f"--chunk-bytes must be positive, not {args.chunk_bytes}")
    return args


# ---- one stamped call, split into steps ---------------------------------------------------


def split_call(events: list[tuple[str, int, int]], begin: int, end: int,
               steps: int) -> dict[str, list[float]]:
    """One stamped ring call (its events, and the bench's clock at the call and the
    return, ns) as per-step seconds: {"wait": [steps], ..., "py": [steps], "step": [steps],
    "records": [steps] (calls recorded), "lead": [1], "tail": [1], "chunks": [C]}.
    Message m (step m // C, C = messages / steps) runs from its Wait to the next
    message's Wait; calls before the first Wait are the lead."""
    waits = [i for i, e in enumerate(events) if e[0] == "wait"]
    chunks = len(waits) // steps
    if not waits or len(waits) != chunks * steps:
        raise RuntimeError(f"ring_steps: {len(waits)} waits recorded, not a multiple of "
                           f"the {steps} steps")
    out = {k: [0.0] * steps for k in (*KINDS, "py", "step", "records")}
    for m, first in enumerate(waits):
        last = waits[m + 1] if m + 1 < len(waits) else len(events)
        span_end = events[waits[m + 1]][1] if m + 1 < len(waits) else events[-1][2]
        t = m // chunks
        recorded = 0
        for kind, t0, t1 in events[first:last]:
            out[kind][t] += (t1 - t0) * 1e-9
            out["records"][t] += 1
            recorded += t1 - t0
        span = span_end - events[first][1]
        out["step"][t] += span * 1e-9
        out["py"][t] += (span - recorded) * 1e-9
    out["lead"] = [(events[waits[0]][1] - begin) * 1e-9]
    out["tail"] = [(end - events[-1][2]) * 1e-9]
    out["chunks"] = [chunks]
    return out


# ---- the costs measured on their own --------------------------------------------------------


def wait_call_s(mpi, blocks: int = 20) -> float:
    """Median seconds of the Wait of a persistent receive from MPI_PROC_NULL (complete at
    its Start): a Wait's fixed cost through mpi4py and MPICH, with nothing to move. A
    block of 100 Start + Wait pairs less a block of 100 Starts alone."""
    from mpi4py import MPI

    reqs = [mpi.Recv_init([np.empty(1, np.uint8), MPI.BYTE], MPI.PROC_NULL, 0)
            for _ in range(100)]
    first, clock, times = reqs[0], time.perf_counter, []
    for _ in range(blocks):
        t0 = clock()
        for _ in range(100):
            first.Start()
            first.Wait()
        t1 = clock()
        for req in reqs:
            req.Start()
        t2 = clock()
        MPI.Request.Waitall(reqs)
        times.append(((t1 - t0) - (t2 - t1)) / 100)
    for req in reqs:
        req.Free()
    return statistics.median(times)


def copy_s(nbytes: int, reps: int = 50) -> float:
    """Median seconds of np.copyto of `nbytes` between buffers at the same page offset."""
    from dtlab.collective.transport.pages import PAGE, address

    src = np.ones(nbytes + PAGE, np.uint8)
    dst = np.empty(nbytes + 2 * PAGE, np.uint8)
    skip = (address(src) - address(dst)) % PAGE
    a, b = src[:nbytes], dst[skip : skip + nbytes]  # (nbytes,) each, same offset in a page
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        np.copyto(b, a)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# ---- one launch ----------------------------------------------------------------------------


def mean_s(fn, calls: int, mpi) -> float:
    """Mean seconds per fn() over `calls` calls, slowest rank."""
    from mpi4py import MPI

    mpi.Barrier()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return mpi.allreduce((time.perf_counter() - t0) / calls, op=MPI.MAX)


def stamped(link, run, calls: int, steps: int, mpi) -> list[dict[str, list]]:
    """`calls` ring calls with stamps on, each split into steps."""
    from dtlab.collective.transport.stamps import Stamps

    link.stamps = stamps = Stamps()
    clock, out = time.perf_counter_ns, []
    try:
        mpi.Barrier()
        for _ in range(calls):
            begin = clock()
            run()
            end = clock()
            out.append(split_call(stamps.take(), begin, end, steps))
    finally:
        link.stamps = None
    return out


def faster_half_mean(calls: list[dict[str, list]]) -> dict[str, list[float]]:
    """Each entry of split_call's dicts averaged over the calls no slower than the median
    call (a call the scheduler preempted is left out); a mean, so the parts of a step
    still add up to it."""
    total = [sum(c["step"]) + c["lead"][0] + c["tail"][0] for c in calls]
    cut = statistics.median(total)
    kept = [c for c, t in zip(calls, total, strict=True) if t <= cut]
    return {k: [statistics.fmean(c[k][i] for c in kept) for i in range(len(kept[0][k]))]
            for k in kept[0]}


def count_wrong(run, buf: np.ndarray, rank: int, n: int, mpi) -> int:
    """Elements of one run() over buf unlike the exact sum, over all ranks."""
    from mpi4py import MPI

    idx = np.arange(buf.size)
    buf[:] = (rank + 1) * (1 + idx % 3)
    run()
    wrong = int(np.count_nonzero(buf != (n * (n + 1) // 2) * (1 + idx % 3)))
    buf[:] = 0
    return mpi.allreduce(wrong, op=MPI.SUM)


def measure_size(comm, link, size: int, args) -> list[dict]:
    """The rows of one size: one per step, the lead and the tail, and the totals."""
    import functools

    from mpi4py import MPI

    from dtlab.collective.algorithms.ring import ring_allreduce
    from dtlab.collective.transport.pages import PAGE, address
    from dtlab.collective.transport.stamps import Stamps, overhead_ns

    mpi, n = comm.mpi, comm.size
    count = max(1, size // 4)
    raw = np.zeros(count + PAGE // 4, np.float32)
    skip = (BUF_OFFSET - address(raw)) % PAGE // 4
    buf = raw[skip : skip + count]  # (count,) zeros at BUF_OFFSET in a page, on every rank
    ours = functools.partial(comm.allreduce, buf)
    ring = functools.partial(ring_allreduce, link, buf, xp=np, sync=None,
                             chunk_bytes=comm.chunk_bytes, divide=None)
    ring1 = functools.partial(ring, turns=1)
    theirs = functools.partial(mpi.Allreduce, MPI.IN_PLACE, buf, op=MPI.SUM)
    steps = 2 * (n - 1)
    seg_bytes = -(-buf.size // n) * 4  # the largest segment
    calls = iterations(buf.nbytes, args.tiny)
    runs = {"ours": ours, "ring": ring, "mpi": theirs}
    if n == 2:  # above two ranks ring1 is ring
        runs["ring1"] = ring1
    for fn in runs.values():
        for _ in range(args.warmup):
            fn()
    timed: dict[str, list[float]] = {name: [] for name in runs}
    split: list[dict[str, list]] = []
    for k in range(args.reps):
        order = list(timed.items())
        shift = k % len(order)
        for name, out in order[shift:] + order[:shift]:  # rotated: no fixed predecessor
            out.append(mean_s(runs[name], calls, mpi))
        split += stamped(link, ring, min(calls, STAMPED_CALLS), steps, mpi)
    wrong = count_wrong(ring, buf, comm.rank, n, mpi) + count_wrong(ours, buf, comm.rank, n, mpi)
    link.stamps = Stamps()  # the stamped ring's sum too
    wrong += count_wrong(ring, buf, comm.rank, n, mpi)
    link.stamps = None
    every = mpi.gather(faster_half_mean(split), root=0)
    call, copy = wait_call_s(mpi), copy_s(seg_bytes)
    stamp = overhead_ns() * 1e-9
    fixed = mpi.gather((call, copy, stamp), root=0)
    offset = address(buf) % PAGE
    aligned = mpi.allreduce(int(offset == mpi.sendrecv(offset, dest=link.right(),
                                                         source=link.left())), op=MPI.MIN)
    if comm.rank != 0:
        return []
    mean = {k: [statistics.fmean(r[k][t] for r in every) for t in range(len(every[0][k]))]
            for k in every[0]}
    call, copy, stamp = (statistics.fmean(f[i] for f in fixed) for i in range(3))
    base = {"n": n, "bytes": buf.nbytes, "chunks": int(mean["chunks"][0]),
            "seg_bytes": seg_bytes}
    rows = []
    for t in range(steps):
        rows.append({**base, "table": "steps", "step": str(t),
                     "phase": "reduce" if t < n - 1 else "gather",
                     **{f"{k}_us": mean[k][t] * 1e6 for k in (*KINDS, "py", "step")}})
    for part in ("lead", "tail"):
        rows.append({**base, "table": "steps", "step": part, "phase": "-",
                     **{f"{k}_us": None for k in (*KINDS, "py")},
                     "step_us": mean[part][0] * 1e6})
    t_ours, t_ring, t_ring1, t_mpi = (statistics.median(timed.get(k, timed["ring"]))
                                      for k in ("ours", "ring", "ring1", "mpi"))
    stamped_total = sum(mean["step"]) + mean["lead"][0] + mean["tail"][0]
    per = {k: statistics.fmean(mean[k]) for k in (*KINDS, "py", "records")}
    rows.append({**base, "table": "totals", "ours_us": t_ours * 1e6, "ring_us": t_ring * 1e6,
                 "ring1_us": t_ring1 * 1e6, "mpi_us": t_mpi * 1e6,
                 "stamped_us": stamped_total * 1e6,
                 "gap_per_step_us": (t_ours - t_mpi) / steps * 1e6,
                 "call_us": call * 1e6, "copy_us": copy * 1e6, "stamp_us": stamp * 1e6,
                 "peer_us": (per["wait"] + per["post"] - call - copy) * 1e6,
                 "fixed_us": (call + per["start"] + per["py"] - per["records"] * stamp) * 1e6,
                 "aligned": bool(aligned),
                 "wrong": wrong, "calls": calls, "stamped_calls": len(split)})
    return rows


STEP_TABLE = Table(
    "per step of one ring all-reduce (mean over the faster half of stamped calls, then over "
    "ranks), us: "
    "wait = in Wait for the left's chunk (peer + copy + call); add = np.add into the buffer; "
    "start = the send's Start; post = the next receive's Start (a gather receive's after "
    "its Test or Wait of our send of that memory); py = the loop's "
    "own Python + stamps; step = their sum; lead = call to first Wait; tail = last message "
    "to return (Waitall on our sends)",
    [Column("size", 9, lambda r: r["bytes"]), Column("n", 2, lambda r: r["n"]),
     Column("C", 3, lambda r: r["chunks"]), Column("step", 5, lambda r: r["step"]),
     Column("phase", 6, lambda r: r["phase"]),
     *[Column(k, 8, lambda r, k=k: r[f"{k}_us"], ".1f") for k in (*KINDS, "py", "step")]])

TOTALS = Table(
    "per size, us: ours = Communicator.allreduce(ours=ring), ring = ring_allreduce alone, "
    "ring1 = the same with turns=1 (no swap of segments at two ranks), mpi = MPI_Allreduce "
    "(medians of each repetition's mean, slowest rank); stamped = the "
    "stamped call's steps + lead + tail; gap/step = (ours - mpi) / 2(N-1); call = a Wait "
    "with nothing to move; copy = np.copyto of a step's bytes; stamp = one record's cost; "
    "peer/step = wait + post - call - copy (the neighbours and the transfer beyond a copy); "
    "fixed/step = call + start + py - stamps (Python and mpi4py, whatever the size); "
    "aligned = every rank's buffer at its left neighbour's page offset",
    [Column("size", 9, lambda r: r["bytes"]), Column("n", 2, lambda r: r["n"]),
     Column("ours", 8, lambda r: r["ours_us"], ".1f"),
     Column("ring", 8, lambda r: r["ring_us"], ".1f"),
     Column("ring1", 8, lambda r: r["ring1_us"], ".1f"),
     Column("mpi", 8, lambda r: r["mpi_us"], ".1f"),
     Column("ours/mpi", 8, lambda r: r["ours_us"] / r["mpi_us"], ".2f"),
     Column("stamped", 8, lambda r: r["stamped_us"], ".1f"),
     Column("gap/step", 8, lambda r: r["gap_per_step_us"], ".2f"),
     Column("call", 6, lambda r: r["call_us"], ".2f"),
     Column("copy", 6, lambda r: r["copy_us"], ".2f"),
     Column("stamp", 6, lambda r: r["stamp_us"], ".2f"),
     Column("peer/step", 9, lambda r: r["peer_us"], ".2f"),
     Column("fixed/step", 10, lambda r: r["fixed_us"], ".2f"),
     Column("aligned", 7, lambda r: "yes" if r["aligned"] else "no"),
     Column("#wrong", 6, lambda r: r["wrong"])])


def main(argv=None) -> int:
    from dtlab.collective.comm import world
    from dtlab.collective.transport.link import Link

    args = parse_args(argv)
    settings = {"ours": "ring"}
    if args.chunk_bytes is not None:
        settings["chunk_bytes"] = args.chunk_bytes
    comm = world(**settings)
    if comm.size < 2:
        sys.stderr.write("dtlab-bench ring_steps: needs 2 or more ranks: run it under "
                         "mpiexec -n N (N >= 2)\n")
        return 2
    link = Link(comm.mpi.Dup(), "ring_steps", comm.timeout, comm.yield_waits)
    load_before = os.getloadavg()[0]
    rows, size = [], args.min_bytes
    while size <= args.max_bytes:
        rows += measure_size(comm, link, size, args)
        size *= 2
    if comm.rank != 0:
        return 0
    steps, totals = harness.tables(rows, "steps"), harness.tables(rows, "totals")
    print(f"# n={comm.size}  float32 SUM in place, chunk_bytes {comm.chunk_bytes}, yield waits "
          f"{comm.yield_waits}, {os.cpu_count()} cores")
    print(STEP_TABLE.head())
    for r in steps:
        print(STEP_TABLE.line(r))
    print(TOTALS.head())
    for r in totals:
        print(TOTALS.line(r))
    load_after = os.getloadavg()[0]
    print(f"# load average (1 min) before / after: {load_before:.2f} / {load_after:.2f}")
    if args.json:
        harness.write(args.json, "ring_steps", rows, mpi=True, n=comm.size,
                      chunk_bytes=comm.chunk_bytes, yield_waits=comm.yield_waits,
                      reps=args.reps, load_before=load_before, load_after=load_after)
    return harness.closing(totals)


if __name__ == "__main__":
    sys.exit(main())
