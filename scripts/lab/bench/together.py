"""A trainer's compute with the host's cores shared: N processes stepping at once.

    mpiexec -n 3 dtlab-bench together --config runs/x/config.json --role rank
    mpiexec -n 2 dtlab-bench together --tiny                # seconds (tests)

One process's step, timed alone, is not what N ranks or workers on one host
compute: they share the cores (models/run/threads.py gives each C / N of
them, at least one BLAS thread), their caches and memory bandwidth, and the
kernel's scheduler hands the cores round in slices, so the slowest of N
ends later than the typical one by more than its own spread. What every
step waits for in an all-reduce or a BSP round is that slowest one. So
every process here runs the trainer's own compute of one step between
barriers, as the all-reduce or the round holds them in step:

    rank    the batch, forward and backward, the gradient norm, the optimizer
            (models/run/trainer.py: a sync rank's compute_s); waits poll and
            yield the core when the host is oversubscribed (collective/transport/waits.py)
    worker  the batch, forward and backward, the gradient norm (pserver/worker/loop.py:
            the servers run the optimizer); waits asleep, as a worker blocked in gRPC

and per step records the makespan (the first process's start to the last
one's end, on CLOCK_MONOTONIC, which every process on the host shares) and
each process's wall and CPU time. The baseline is the same step of rank 0
alone, timed in the same launch while the others wait asleep:

    x alone  = makespan / alone step      (N / cores when the sharing is ideal)
    spread   = makespan - the typical process's step (the slowest one's lateness)

dtlab-simulate --validate runs it beside the measured runs and takes the
compute of its predictions from it (simulate/validate.py).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

from mpi4py import MPI

from dtlab.collective.transport.waits import resolve_yield
from dtlab.lab.bench import harness
from dtlab.lab.bench.harness import trainer_step
from dtlab.models.run.allocator import keep_freed_memory
from dtlab.models.run.session import build_session, parse, replica_cost
from dtlab.models.run.threads import share_cores

ROLES = ("rank", "worker")
TINY = ["--model", "mlp", "--d-in", "8", "--d-hidden", "16", "--n-classes", "4",
        "--n-samples", "512", "--batch-size", "8"]
SLEEP_S = 50e-6  # a worker's poll interval while it waits asleep


def barrier(comm: MPI.Comm, role: str, yield_waits: bool) -> None:
    """Every process of `comm` here, waiting as `role` does (see the module docstring)."""
    req = comm.Ibarrier()
    if role == "worker":
        while not req.Test():
            time.sleep(SLEEP_S)
    elif yield_waits:
        while not req.Test():
            os.sched_yield()
    else:
        req.Wait()


def timed(step, reps: int, warmup: int, sync) -> list[tuple[float, float, float]]:
    """(start, end, CPU seconds) of `reps` steps after `warmup`, each after sync()."""
    out = []
    for k in range(warmup + reps):
        sync()
        t0, c0 = time.perf_counter(), time.thread_time()
        step()
        if k >= warmup:
            out.append((t0, time.perf_counter(), time.thread_time() - c0))
    return out


def summarise(per_rank: list[list[tuple]], alone: list[tuple]) -> dict:
    """Makespan of every step over the processes, every process's wall and CPU times."""
    makespan = [max(end for _, end, _ in step) - min(start for start, _, _ in step)
                for step in zip(*per_rank, strict=True)]
    return {"alone_s_samples": [e - s for s, e, _ in alone],
            "makespan_s_samples": makespan,
            "wall_s_samples": [e - s for rank in per_rank for s, e, _ in rank],
            "cpu_s_samples": [c for rank in per_rank for _, _, c in rank]}


def medians_ms(row: dict) -> dict:
    """The row's figures in the table: medians over the steps (ms) and their ratios."""
    m = {f"{k.removesuffix('_s_samples')}_ms": 1e3 * statistics.median(row[k])
         for k in ("alone_s_samples", "makespan_s_samples", "wall_s_samples",
                   "cpu_s_samples")}
    return {**m, "x_alone": m["makespan_ms"] / m["alone_ms"],
            "ranks_per_core": max(1.0, row["ranks"] / row["cores"]),
            "spread_ms": m["makespan_ms"] - m["wall_ms"]}


TABLE = harness.Table(
    "alone: rank 0's step alone (the baseline); makespan: first start to last end of a step "
    "of all N; x alone = makespan / alone; N/cores: what sharing the cores alone would "
    "make it; own: one process's step (wall), spread = makespan - own; cpu: one process's "
    "CPU time in its step; medians over the steps, in ms",
    [harness.Column("N", 3, lambda r: r["ranks"]),
     harness.Column("role", 7, lambda r: r["role"]),
     harness.Column("threads", 7, lambda r: r["threads"]),
     harness.Column("alone", 8, lambda r: r["alone_ms"], ".3f"),
     harness.Column("makespan", 9, lambda r: r["makespan_ms"], ".3f"),
     harness.Column("x alone", 8, lambda r: r["x_alone"], ".2f"),
     harness.Column("N/cores", 8, lambda r: r["ranks_per_core"], ".2f"),
     harness.Column("own", 8, lambda r: r["wall_ms"], ".3f"),
     harness.Column("spread", 8, lambda r: r["spread_ms"], ".3f"),
     harness.Column("cpu", 8, lambda r: r["cpu_ms"], ".3f")])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--role", choices=ROLES, default="rank",
                   help="whose compute and waits: a sync rank's or a worker's (default rank)")
    p.add_argument("--reps", type=int, default=40, help="timed steps (default 40)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (default 5)")
    harness.common_flags(p, "a tiny MLP and 3 steps (tests)", "rank 0 writes the JSON here")
    o, rest = p.parse_known_args(argv)
    if o.reps < 1 or o.warmup < 0:
        p.error("--reps must be at least 1 and --warmup not negative")
    reps, warmup = (3, 1) if o.tiny else (o.reps, o.warmup)
    setup = parse((TINY if o.tiny else []) + rest, prog="bench together")
    comm = MPI.COMM_WORLD
    keep_freed_memory()  # what every trainer does first
    threads = share_cores()
    session = build_session(setup, comm.rank, comm.size)
    step = trainer_step(session, o.role)
    yield_waits = resolve_yield(None)

    def sync() -> None:
        barrier(comm, o.role, yield_waits)

    alone = timed(step, reps, warmup, lambda: None) if comm.rank == 0 else []
    barrier(comm, "worker", False)  # the others asleep until rank 0 is done alone
    together = comm.gather(timed(step, reps, warmup, sync), root=0)
    if comm.rank != 0:
        return 0
    cost = replica_cost(setup)
    row = {"model": setup.model_name, **harness.flatten("config", cost.config),
           "batch_size": cost.batch_size,
           "flops_step": cost.flops_step, "ranks": comm.size, "role": o.role,
           "cores": len(os.sched_getaffinity(0)), "threads": threads.threads,
           "yield_waits": o.role == "rank" and yield_waits, **summarise(together, alone)}
    row.update(medians_ms(row))
    print(f"# dtlab: one step's compute of {setup.model_name} in {comm.size} process(es) at "
          f"once, {reps} steps after {warmup}; {threads.describe()}; load average "
          f"{os.getloadavg()[0]:.2f}")
    print(TABLE.head())
    print(TABLE.line(row), flush=True)
    if o.json:
        harness.write(o.json, "together", [row], mpi=True, reps=reps, warmup=warmup,
                      threads=threads.as_dict())
    return 0


if __name__ == "__main__":
    sys.exit(main())
