"""Wall time of the README's sync and async examples, threads shared vs not.

    dtlab-bench threads --json runs/threads.json     # 100 steps each, ~3 min
    dtlab-bench threads --tiny                       # seconds (tests; sync-2 and async)

Each example runs twice in the same launch: as dtlab starts it (BLAS/OpenMP
threads = the host's cores / its processes, models/run/threads.py) and with
OMP_NUM_THREADS=OPENBLAS_NUM_THREADS=<cores>, every process taking every
core, which is what each process did before dtlab shared the cores (and
what NumPy does by default). The examples:

    sync-2   mpiexec -n 2 dtlab-sync --steps S
    sync-4   mpiexec -n 4 dtlab-sync --steps S
    async    2 dtlab-pserver shards + mpiexec -n 2 dtlab-worker --steps S

    wall     seconds from launch to exit (servers: until the workers exit)
    ratio    wall with every core per process / wall with the cores shared
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dtlab.lab.bench import harness
from dtlab.lab.compare.runner import wait_ready
from dtlab.lab.programs import program
from dtlab.models.run.launcher_env import mpiexec_path

TINY_MODEL = ["--model", "mlp", "--d-in", "8", "--d-hidden", "16", "--n-classes", "4",
              "--n-samples", "512"]  # model and data flags: the servers take these too
TINY_RUN = ["--batch-size", "8"]
THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def environment(shared: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in THREAD_VARS}
    if not shared:
        cores = str(len(os.sched_getaffinity(0)))
        env.update(OMP_NUM_THREADS=cores, OPENBLAS_NUM_THREADS=cores)
    return env


def timed(cmd: list[str], env: dict[str, str], timeout: float) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, env=env, check=True, timeout=timeout,
                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return time.perf_counter() - start


def sync(n: int, flags: list[str], env: dict[str, str], timeout: float) -> float:
    return timed([mpiexec_path(), "-n", str(n), *program("dtlab-sync"), *flags], env, timeout)


def serve(shard: int, flags: list[str], env: dict[str, str], ready: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [*program("dtlab-pserver"), "serve", *flags, "--shard", str(shard), "--num-shards", "2",
         "--port", "0", "--consistency", "ssp", "--staleness", "2", "--num-workers", "2",
         "--ready-file", str(ready)], env=env, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL)


def run_async(model: list[str], steps: list[str], env: dict[str, str], timeout: float,
              tmp: Path) -> float:
    """Two shards, then two workers under mpiexec: the wall time of the workers' launch."""
    ready = [tmp / f"ready-{time.monotonic_ns()}-{k}.json" for k in (0, 1)]
    servers = [serve(k, model, env, ready[k]) for k in (0, 1)]
    try:
        ports = wait_ready(servers, ready, 60.0)
        if isinstance(ports, str):
            raise RuntimeError(ports)
        addresses = ",".join(f"127.0.0.1:{p}" for p in ports)
        return timed([mpiexec_path(), "-n", "2", *program("dtlab-worker"), "--servers", addresses,
                      *model, *steps], env, timeout)
    finally:
        for s in servers:
            s.terminate()
            s.wait(timeout=30)


TABLE = harness.Table(
    "wall: seconds from launch to exit; ratio: all-cores wall / shared wall",
    [harness.Column("example", 8, lambda r: r["example"]),
     harness.Column("shared(s)", 10, lambda r: r["shared_s"], ".2f"),
     harness.Column("all-cores(s)", 13, lambda r: r["all_cores_s"], ".2f"),
     harness.Column("ratio", 7, lambda r: r["ratio"], ".2f")])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=100, help="steps of every example (default 100)")
    harness.common_flags(p, "a tiny model, 3 steps: a smoke run")
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error("--steps must be at least 1")
    model = TINY_MODEL if args.tiny else []
    steps = ["--steps", str(3 if args.tiny else args.steps)] + (TINY_RUN if args.tiny else [])
    rows = []
    print(f"# README examples, {steps[1]} steps; shared: dtlab's thread choice; "
          f"all-cores: OMP_NUM_THREADS={len(os.sched_getaffinity(0))} in every process")
    print(TABLE.head())
    with tempfile.TemporaryDirectory() as tmp:
        examples = {
            "sync-2": lambda env: sync(2, model + steps, env, 600),
            "sync-4": lambda env: sync(4, model + steps, env, 600),
            "async": lambda env: run_async(model, steps, env, 600, Path(tmp)),
        }
        if args.tiny:  # sync-4 is sync-2's code at 4 ranks: two launches the smoke run spares
            del examples["sync-4"]
        for name, run in examples.items():
            shared, alone = run(environment(True)), run(environment(False))
            rows.append({"example": name, "steps": int(steps[1]), "shared_s": shared,
                         "all_cores_s": alone, "ratio": alone / shared})
            print(TABLE.line(rows[-1]), flush=True)
    if args.json:
        harness.write(args.json, "threads", rows, mpi=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
