"""The expert-parallel part of dtlab.lab.bench.moe, run under mpiexec by it (one launch per
rank count):

    mpiexec -n 4 dtlab-bench moe_ep --json OUT.json --bytes 1000000 4000000 --reps 10
    mpiexec -n 2 dtlab-bench moe_ep --tiny --json OUT.json   # seconds (tests)

Two measurements, every rank taking part, each rep's time the slowest rank's (MPI_MAX):

  all-to-all: ours as the MoE layers call it (collective/train.py's posted_alltoallv:
      Communicator.ialltoallv, every pairwise exchange posted at once, one wait), our
      step-by-step pairwise alltoallv (collective/algorithms/alltoall.py) and MPI's Alltoallv on the
      same float32 buffers of B bytes per rank (B/n to every rank), taking turns rep by
      rep; median of the reps; bus bandwidth as nccl-tests defines it for all-to-all:
      busbw = (B / t) (n - 1) / n. Each result is checked against the blocks every rank
      sent (#wrong).
  MoE layer: one expert-parallel MoE step (zero grads, forward, backward; models/moe.py
      with models/moe_ep.py) over the n ranks, dropless top-2 of 2n experts, with each
      exchange (ours, MPI's) and 1 or `--chunks` overlap chunks, the four taking turns.

Rank 0 writes the rows to --json: the table "alltoall" (one row per B) and "ep_layer".
Wrong results are counted in the rows (bench moe reports them), not in the exit status.
"""

from __future__ import annotations

import argparse
import statistics
import sys

import numpy as np

from dtlab.collective.comm import world
from dtlab.collective.train import posted_alltoallv
from dtlab.lab.bench import harness
from dtlab.models.moe import MoE
from dtlab.models.moe_ep import ExpertParallel
from dtlab.models.params import FlatParams
from dtlab.models.router import RouterOptions
from dtlab.models.run.allocator import keep_freed_memory
from dtlab.models.run.threads import share_cores


def bench_alltoall(comm, nbytes: int, reps: int, warmup: int) -> dict:
    n, r = comm.size, comm.rank
    per = max(1, nbytes // 4 // n)  # float32 elements to each rank
    send = (np.arange(n * per, dtype=np.float32) + r * n * per).reshape(n * per, 1)  # (n per, 1)
    counts = [per] * n
    ours = posted_alltoallv(comm)
    outs = {k: np.empty_like(send) for k in ("ours", "pairwise", "mpi")}
    runs = {"ours": lambda: ours(send, counts, out=outs["ours"], recv_counts=counts),
            "pairwise": lambda: comm.alltoallv(send, counts, out=outs["pairwise"],
                                               recv_counts=counts),
            "mpi": lambda: comm.mpi_alltoallv(send, counts, out=outs["mpi"],
                                              recv_counts=counts)}
    times = {k: [] for k in runs}
    for i in range(warmup + reps):
        for k, fn in runs.items():
            t = harness.slowest(comm, fn)
            if i >= warmup:
                times[k].append(t)
    # block s of the result is rank s's block for r: its elements s n per + r per + [0, per)
    want = (np.arange(per, dtype=np.float32)[None, :] + r * per
            + (np.arange(n) * n * per)[:, None]).reshape(-1, 1)
    wrong = sum(int(not np.array_equal(o, want)) for o in outs.values())
    wrong = comm.mpi.allreduce(wrong)
    size = n * per * 4  # bytes this rank sends (its own block included, as nccl-tests)
    row = {"ranks": n, "bytes": size, "wrong": wrong}
    for k, ts in times.items():
        t = statistics.median(ts)
        row[f"{k}_s"] = t
        row[f"{k}_busbw"] = size / t * (n - 1) / n / 1e9
    row["ratio"] = row["ours_busbw"] / row["mpi_busbw"]
    return row


def bench_layer(comm, d: int, d_ff: int, rows: int, chunks: int, reps: int, warmup: int) -> dict:
    n = comm.size
    N = 2 * n
    rng = np.random.default_rng(comm.rank)
    x = rng.standard_normal((rows, d)).astype(np.float32)
    dy = rng.standard_normal((rows, d)).astype(np.float32)
    setups = {}
    for algo in ("ours", "mpi"):
        for k in (1, chunks):
            exchange = comm.mpi_alltoallv if algo == "mpi" else posted_alltoallv(comm)
            ep = ExpertParallel(comm, exchange, chunks=k)
            layer = MoE("moe", d, d_ff, RouterOptions(N, top_k=2), capacity_factor=None, ep=ep)
            setups[(algo, k)] = (layer, FlatParams(layer.specs(), seed=0))
    outputs = {}

    def step(key):
        layer, P = setups[key]

        def run():
            P.zero_grad()
            y, ctx = layer.forward(P, x)
            layer.backward(P, ctx, dy)
            outputs[key] = y
        return run

    times = {key: [] for key in setups}
    for i in range(warmup + reps):
        for key in setups:
            t = harness.slowest(comm, step(key))
            if i >= warmup:
                times[key].append(t)
    ref = outputs[("ours", 1)]
    wrong = sum(int(not np.allclose(y, ref, rtol=1e-5, atol=1e-6)) for y in outputs.values())
    row = {"ranks": n, "d": d, "d_ff": d_ff, "experts": N, "top_k": 2, "rows": rows,
           "chunks": chunks, "wrong": comm.mpi.allreduce(wrong)}
    for (algo, k), ts in times.items():
        row[f"{algo}_chunks{1 if k == 1 else 'k'}_s"] = statistics.median(ts)
    row["overlap_speedup_ours"] = row["ours_chunks1_s"] / row["ours_chunksk_s"]
    row["overlap_speedup_mpi"] = row["mpi_chunks1_s"] / row["mpi_chunksk_s"]
    return row


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    harness.common_flags(p, "64 KB, a 16-wide layer, 3 reps: a smoke run")
    p.add_argument("--bytes", type=int, nargs="+", default=[1_000_000, 4_000_000, 16_000_000],
                   help="all-to-all bytes per rank (default 1e6 4e6 16e6)")
    p.add_argument("--reps", type=int, default=10, help="timed calls (default 10)")
    p.add_argument("--warmup", type=int, default=3, help="untimed calls first (default 3)")
    p.add_argument("--layer", type=int, nargs=3, metavar=("D", "D_FF", "ROWS"),
                   default=(128, 256, 2048), help="the layer rows' width, expert width, rows")
    p.add_argument("--chunks", type=int, default=4, help="overlap chunks of the layer rows")
    args = p.parse_args(argv)
    if args.tiny:
        args.bytes, args.layer, args.reps, args.warmup = [65536], (16, 32, 64), 3, 1
    keep_freed_memory()
    share_cores()
    comm = world(timeout=120)
    rows = [{"table": "alltoall", **bench_alltoall(comm, b, args.reps, args.warmup)}
            for b in args.bytes]
    layer = bench_layer(comm, *args.layer, args.chunks, args.reps, args.warmup)
    rows.append({"table": "ep_layer", **layer})
    if comm.rank == 0 and args.json:
        harness.write(args.json, "moe_ep", rows, mpi=True, ranks=comm.size, reps=args.reps,
                      warmup=args.warmup)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
