"""PipeDream-2BW's K steps as one list against PipeDream-Flush's K flushed steps: bubble, time.

    dtlab-bench pipedream --json bench-pipedream.json              # pp 2, m 4 and 8, K 4
    dtlab-bench pipedream --pp 2 --micro-batches 8 --window 8 --repeats 5
    dtlab-bench pipedream --tiny --json out.json                   # seconds (tests)

One `mpiexec -n pp` launch builds one pipeline stage a rank (the transformer, dp 1,
models/pipeline.py) and, for each micro-batch count m, takes turns (--repeats rounds after
one warm-up round) between

    flush    K steps of 1F1B, each flushed: compute_grads, then the optimizer step
             (PipeDream-Flush: dtlab-sync --pp P --pipedream flush)
    2bw      the same K steps as one list without flushes on two weight buffers
             (models/pipedream.py TwoBufferedWindow; each stage's update inline after
             its last backward of a step): what dtlab-sync --pipedream 2bw runs, K
             steps a window (--pipedream-window)

and reports, medians over the rounds:

    ms        wall time of the K steps (slowest rank), and 2bw's over flush's
    bubble    measured idle fraction over the K steps (models/pipeline.py: blocked in
              receives or finished before the slowest rank, over the makespan; flush: its
              steps' idle over their makespans), against the formulas with equal passes:
              flush (p-1)/(m+p-1), 2bw (p-1)/(K m+p-1) (models/pipedream.py bubble_2bw),
              and `expected`: each list replayed with the stages' measured pass times
              (models/schedule.py simulate)
    versions  bytes of weights each rank keeps beyond its parameters (flush 0, 2bw one
              copy of its stage's parameters) and the versions the list holds at once
              (models/pipedream.py live_versions: 2)

2BW's updates inside the list count as the executor's overhead, not as idle. On 2 cores
two ranks each get one: the bubbles are meaningful at pp 2, not beyond.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

from dtlab.lab.bench import harness

CONFIG = ["--model", "transformer", "--vocab", "64", "--seq-len", "64", "--d-model", "128",
          "--n-heads", "4", "--n-layers", "4", "--d-ff", "512", "--batch-size", "4",
          "--clip", "0"]
TINY = ["--model", "mlp", "--d-in", "8", "--d-hidden", "32", "--n-layers", "3",
        "--n-classes", "4", "--n-samples", "2048", "--batch-size", "4", "--clip", "0"]


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pp", type=int, default=2, help="pipeline stages (ranks of the launch)")
    p.add_argument("--micro-batches", default="4,8", help="comma-separated m per step")
    p.add_argument("--window", type=int, default=4, help="K: steps run as one 2BW list")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds after one warm-up")
    harness.common_flags(p, "a seconds-long run (the test suite)")
    p.add_argument("--worker", metavar="OUT", help=argparse.SUPPRESS)
    args = p.parse_args(own)
    if args.tiny:
        args.micro_batches, args.window, args.repeats = "2", 3, 2
    try:
        args.micro_batches = [int(m) for m in args.micro_batches.split(",")]
    except ValueError:
        p.error(f"--micro-batches takes comma-separated integers, not {args.micro_batches!r}")
    if args.pp < 2 or args.window < 1 or args.repeats < 1 or min(args.micro_batches) < 1:
        p.error("--pp must be at least 2; --window, --repeats and --micro-batches positive")
    return args, extra if args.worker else (TINY if args.tiny else CONFIG) + extra


def worker(args, config: list[str]) -> None:
    """Inside mpiexec: every m in turn; rank 0 writes the rows."""
    from dtlab.collective.grid import ProcessGrid
    from dtlab.collective.train import parse_args as sync_args
    from dtlab.models.run.session import PipelineSpec, build_session

    harness.start("bench_pipedream")
    grid = ProcessGrid(dp=1, pp=args.pp, tp=1)
    rows = []
    for m in args.micro_batches:
        setup = sync_args([*config, "--pp", str(args.pp), "--grad-accum", str(m)])
        session = build_session(setup, pipeline=PipelineSpec(grid.pp_comm, "1f1b"))
        steps = [session.loader.next() for _ in range(args.window)]
        runs = {"flush": [], "2bw": []}
        for k in range(1 + args.repeats):
            for name, fn in (("flush", flushed), ("2bw", two_buffered)):
                grid.world.barrier()
                t0 = time.perf_counter()
                figures = fn(session, steps)
                figures["wall_s"] = max(grid.world.mpi.allgather(time.perf_counter() - t0))
                if k:
                    runs[name].append(figures)
        every = grid.world.mpi.gather(
            {"runs": runs, "param_bytes": session.params.nbytes}, root=0)
        if grid.rank == 0:
            rows += figures_rows(every, args.pp, m, args.window)
    if grid.rank == 0:
        harness.write(args.worker, "pipedream_launch", rows, mpi=True)
    grid.free()


def flushed(session, steps: list) -> dict:
    """K steps of 1F1B, each flushed and then updated; the idle over the K makespans."""
    replica, P = session.replica, session.params
    idle = makespan = 0.0
    passes = []
    for j, batches in enumerate(steps):
        replica.compute_grads(batches)
        session.optimizer.step(P.data, P.grad, session.schedule(j))
        idle += replica.timing["bubble"] * replica.timing["pipe_makespan_s"]
        makespan += replica.timing["pipe_makespan_s"]
        passes.append(replica.pass_times)
    return {"bubble": idle / makespan, "pass_s": per_pass(passes, len(steps[0]))}


def two_buffered(session, steps: list) -> dict:
    """The K steps as one 2BW list (from the current weights as W_0)."""
    from dtlab.models.pipedream import TwoBufferedWindow, live_versions, steady_state

    window = TwoBufferedWindow(session.replica, session.optimizer, session.schedule)
    window.run(steps)
    p, m = session.model.pp.size, len(steps[0])
    versions = live_versions(steady_state(p, m, len(steps)), m)
    return {"bubble": session.replica.timing["bubble"], "versions": max(versions),
            "pass_s": per_pass([session.replica.pass_times], len(steps) * len(steps[0]))}


def per_pass(times: list[list[dict]], micro_batches: int) -> dict:
    """Seconds of one micro-batch's F, B, W on this rank's chunk 0, from the steps' totals."""
    return {kind: sum(t[0][kind] for t in times) / micro_batches / len(times)
            for kind in "FBW"}


def figures_rows(every: list[dict], p: int, m: int, K: int) -> list[dict]:
    """One row per method from every rank's rounds (`every`, in pp rank order)."""
    from dtlab.models.pipedream import bubble_2bw, steady_state
    from dtlab.models.schedule import bubble_formula, one_f_one_b, simulate

    rows = []
    for name in ("flush", "2bw"):
        rounds = [r["runs"][name] for r in every]
        n = len(rounds[0])
        stage_times = [{k: statistics.mean(x["pass_s"][k] for x in rank) for k in "FBW"}
                       for rank in rounds]
        ops = one_f_one_b(p, m) if name == "flush" else steady_state(p, m, K)
        rows.append({
            "method": name, "pp": p, "microbatches": m, "window": K,
            "ms": 1e3 * statistics.median(rounds[0][k]["wall_s"] for k in range(n)),
            "bubble": statistics.median(statistics.mean(rank[k]["bubble"] for rank in rounds)
                                        for k in range(n)),
            "bubble_formula": (bubble_formula("1f1b", p, m) if name == "flush"
                               else bubble_2bw(p, m, K)),
            "bubble_expected": simulate(ops, stage_times=stage_times).bubble,
            "version_bytes": [0 if name == "flush" else r["param_bytes"] for r in every],
            "versions": 1 if name == "flush" else rounds[0][0]["versions"]})
    rows[1]["vs_flush"] = rows[1]["ms"] / rows[0]["ms"]
    rows[0]["vs_flush"] = 1.0
    return rows


def launch(args, config: list[str], workdir: str) -> list[dict]:
    from dtlab.models.run.launcher_env import mpiexec_path

    out = os.path.join(workdir, "rows.json")
    cmd = [mpiexec_path(), "-n", str(args.pp), sys.executable, "-m", "mpi4py",
           "-m", "dtlab.lab.bench.pipedream", "--worker", out, "--pp", str(args.pp),
           "--micro-batches", ",".join(map(str, args.micro_batches)), "--window",
           str(args.window), "--repeats", str(args.repeats), "--", *config]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        raise SystemExit(f"launch failed ({r.returncode}): {' '.join(cmd)}\n"
                         f"{r.stdout[-2000:]}{r.stderr[-3000:]}")
    return harness.read(out)[1]


TABLE = harness.Table(
    "ms = wall time of the K steps (slowest rank), vs flush = over the flushed steps'; "
    "bubble measured, formula (equal passes), expected (replay with measured passes); kept = "
    "MB of weight versions beyond the parameters, per rank; versions = held at once",
    [harness.Column("method", 6, lambda r: r["method"]),
     harness.Column("pp", 3, lambda r: r["pp"]),
     harness.Column("m", 3, lambda r: r["microbatches"]),
     harness.Column("K", 3, lambda r: r["window"]),
     harness.Column("ms", 9, lambda r: r["ms"], ".2f"),
     harness.Column("vs flush", 8, lambda r: r["vs_flush"], ".2f"),
     harness.Column("bubble", 7, lambda r: r["bubble"], ".3f"),
     harness.Column("formula", 7, lambda r: r["bubble_formula"], ".3f"),
     harness.Column("expect", 7, lambda r: r["bubble_expected"], ".3f"),
     harness.Column("kept MB", 14,
                    lambda r: ",".join(f"{b / 1e6:.3g}" for b in r["version_bytes"])),
     harness.Column("versions", 8, lambda r: r["versions"])])


def table(rows: list[dict]) -> list[str]:
    return [f"# PipeDream-Flush vs PipeDream-2BW, K steps, {os.cpu_count()} cores",
            TABLE.head(), *map(TABLE.line, rows)]


def main(argv: list[str]) -> int:
    args, config = parse_args(argv)
    if args.worker:
        worker(args, config)
        return 0
    with tempfile.TemporaryDirectory() as workdir:
        rows = launch(args, config, workdir)
    print("\n".join(table(rows)))
    if args.json:
        harness.write(args.json, "pipedream", rows, mpi=True, config=config)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
