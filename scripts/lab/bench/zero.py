"""ZeRO stages 1-3 against plain data parallelism: memory and bytes per rank, step time.

    dtlab-bench zero --json bench-zero.json                  # dp 1, 2, 4; the transformer
    dtlab-bench zero --ranks 2 --steps 20 -- --d-model 512   # extra trainer flags after --
    dtlab-bench zero --tiny --json out.json                  # seconds (tests)

For each dp size N one mpiexec launch runs `dtlab-sync` (collective/train.py's train())
with --zero 0, 1, 2 and 3 in turn on one config (the same data, seed and steps), reads
rank 0's metrics and reports per stage:

    step ms       median step time after the first fifth of the steps
    vs DP         step ms over the same launch's --zero 0 (plain data parallelism)
    params, grads, optim
                  rank 0's persistent bytes (MB) by kind, as the trainer's header states
                  them (stage 0: collective/train.py memory_split; ZeRO: Zero.memory)
    formula       the paper's per-rank total, (4 + 4 + 8) Psi fp32 Adam with one term more
                  divided by N per stage (models/cost.py zero_memory), and measured/formula
    working       the per-unit buffer pools ZeRO 2 and 3 hold beside that (the gathered
                  units' parameters, the gradients in reduction), MB
    sent MB       bytes rank 0 sent per step, counted from our ring's schedule per
                  collective (collective/zero/layout.py), against the formula: (N-1)/N of
                  2 Psi-volumes (stages 0-2), 3 (stage 3) (models/cost.py zero_traffic)
    wait ms       time the step was blocked on communication: the reducer's wait plus,
                  stage 3, the forward and backward waits for a unit's all-gather (the
                  part of it prefetch did not hide)

A last line gives the paper's own example (7.5B parameters at N = 64, mixed-precision
Adam: 120, 31.4, 16.6, 1.9 GB) by the same formula.

The exit status is 1 when a byte count (memory or traffic) is off its formula by more than
the unevenness of the segments allows (1%, deterministic); step times are reported, not
judged. On 2 cores, N = 4 shares each core between two ranks: its times are shown only.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

from dtlab.lab.bench import harness
from dtlab.models.cost import PAPER_EXAMPLE, zero_memory

CONFIG = ["--model", "transformer", "--vocab", "64", "--seq-len", "64", "--d-model", "256",
          "--n-heads", "8", "--n-layers", "4", "--d-ff", "1024", "--batch-size", "8"]
TINY = ["--model", "mlp", "--d-in", "8", "--d-hidden", "32", "--n-layers", "3",
        "--n-classes", "4", "--n-samples", "2048", "--batch-size", "8"]
STAGES = (0, 1, 2, 3)
TOLERANCE = 0.01


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    harness.launch_flags(p, None, ranks="1,2,4")
    p.add_argument("--steps", type=int, default=30, help="steps per stage")
    harness.common_flags(p, "a seconds-long run (the test suite)")
    p.add_argument("--worker", nargs=2, metavar=("DIR", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args(own)
    if args.tiny:
        args.ranks, args.steps = [1, 2], 5
    if args.steps < 2:
        p.error("--steps must be at least 2")
    # a worker is handed the whole config after --
    return args, extra if args.worker else (TINY if args.tiny else CONFIG) + extra


def worker(args, config: list[str]) -> None:
    """Inside mpiexec: every stage in turn; rank 0 writes the rows."""
    from mpi4py import MPI

    from dtlab.collective.train import parse_args as sync_args
    from dtlab.collective.train import train

    workdir, out = args.worker
    rows = []
    for stage in STAGES:
        metrics = os.path.join(workdir, f"zero{stage}.jsonl")
        train(sync_args([*config, "--zero", str(stage), "--steps", str(args.steps),
                         "--metrics", metrics, "--log-every", str(args.steps)]))
        if MPI.COMM_WORLD.rank == 0:
            rows.append(row(metrics, stage, MPI.COMM_WORLD.size))
    if MPI.COMM_WORLD.rank == 0:
        harness.write(out, "zero_launch", rows, mpi=True)


def row(metrics: str, stage: int, n: int) -> dict:
    """One stage's figures from rank 0's metrics file."""
    from dtlab.models.cost import zero_traffic
    from dtlab.models.run.metrics import read_metrics

    header, records = read_metrics(metrics)
    kept = records[max(1, len(records) // 5):]
    psi, run = header["n_params"], header["config"]["run"]
    itemsize = 8 if run["dtype"] == "float64" else 4
    optimizer = header["config"]["optim"]["optimizer"]
    if stage == 0:
        params, grads, optim = (header["param_bytes"], header["grad_bytes"],
                                header["optimizer_bytes"])
    else:
        mem = header["zero_bytes"]
        params, grads, optim = mem["weight_bytes"], mem["grad_bytes"], mem["optimizer_bytes"]
    formula = zero_memory(psi, stage, n, run["precision"], optimizer, itemsize)
    sent_formula = zero_traffic(psi, stage, n, run["precision"], run["grad_accum"],
                                header.get("zero_reshard_after_forward") is not False,
                                itemsize)
    sent = statistics.median(r.get("sent_bytes", 0) for r in kept)
    return {"n": n, "stage": stage, "params": psi, "units": len(header.get("zero_units", [])),
            "step_ms": 1e3 * statistics.median(r["step_s"] for r in kept),
            "wait_ms": 1e3 * statistics.median(r["wait_s"] + r.get("gather_wait_s", 0.0)
                                               for r in kept),
            "param_bytes": params, "grad_bytes": grads, "optimizer_bytes": optim,
            "total_bytes": params + grads + optim, "formula_bytes": formula["total"],
            "memory_ratio": (params + grads + optim) / formula["total"],
            "working_bytes": max(r.get("working_bytes", 0) for r in kept),
            "sent_bytes": sent, "sent_formula": sent_formula,
            "sent_ratio": sent / sent_formula if sent_formula else (1.0 if sent == 0 else 0.0),
            "final_loss": records[-1]["loss"]}


def launch(n: int, args, config: list[str], workdir: str) -> list[dict]:
    from dtlab.models.run.launcher_env import mpiexec_path

    out = os.path.join(workdir, f"rows{n}.json")
    cmd = [mpiexec_path(), "-n", str(n), sys.executable, "-m", "mpi4py",
           "-m", "dtlab.lab.bench.zero", "--worker", workdir, out,
           "--steps", str(args.steps), "--ranks", str(n), "--", *config]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if r.returncode != 0:
        raise SystemExit(f"launch failed ({r.returncode}): {' '.join(cmd)}\n"
                         f"{r.stdout[-2000:]}{r.stderr[-3000:]}")
    return harness.read(out)[1]


def within(r: dict) -> bool:
    """Memory and traffic on their formulas, up to the segments' unevenness."""
    return abs(r["memory_ratio"] - 1) <= TOLERANCE and abs(r["sent_ratio"] - 1) <= TOLERANCE


TABLE = harness.Table(
    "vs DP = step ms / stage 0's in the same launch; params grads optim = persistent bytes; "
    "formula = the paper's total, ratio = measured / formula; working = ZeRO 2/3's unit "
    "buffer pools; sent = bytes sent per step vs (N-1)/N x 2 (stages 0-2) or 3 (stage 3) "
    "parameter volumes; wait = blocked on communication",
    [harness.Column("N", 3, lambda r: r["n"]),
     harness.Column("stage", 5, lambda r: r["stage"]),
     harness.Column("step ms", 8, lambda r: r["step_ms"], ".2f"),
     harness.Column("vs DP", 6, lambda r: r["vs_dp"], ".2f"),
     harness.Column("params", 8, lambda r: r["param_bytes"] / 1e6, ".4f"),
     harness.Column("grads", 8, lambda r: r["grad_bytes"] / 1e6, ".4f"),
     harness.Column("optim", 8, lambda r: r["optimizer_bytes"] / 1e6, ".4f"),
     harness.Column("formula", 8, lambda r: r["formula_bytes"] / 1e6, ".4f"),
     harness.Column("ratio", 6, lambda r: r["memory_ratio"], ".3f"),
     harness.Column("working", 8, lambda r: r["working_bytes"] / 1e6, ".4f"),
     harness.Column("sent", 8, lambda r: r["sent_bytes"] / 1e6, ".4f"),
     harness.Column("formula", 8, lambda r: r["sent_formula"] / 1e6, ".4f"),
     harness.Column("wait ms", 8, lambda r: r["wait_ms"], ".2f")])


def table(rows: list[dict]) -> list[str]:
    """The title, TABLE's head and a line per row (each row's vs_dp set)."""
    base = {r["n"]: r["step_ms"] for r in rows if r["stage"] == 0}
    for r in rows:
        r["vs_dp"] = r["step_ms"] / base[r["n"]]
    return [f"# ZeRO vs plain data parallelism, {rows[0]['params']:,} parameters, "
            f"{os.cpu_count()} cores; per rank 0, bytes in MB", TABLE.head(),
            *map(TABLE.line, rows)]


def main(argv: list[str]) -> int:
    args, config = parse_args(argv)
    if args.worker:
        worker(args, config)
        return 0
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        for n in args.ranks:
            rows += launch(n, args, config, workdir)
    print("\n".join(table(rows)))
    psi, n, precision = PAPER_EXAMPLE
    paper = [zero_memory(psi, s, n, precision, "adam")["total"] / 1e9 for s in STAGES]
    print(f"# the paper's example by the same formula (7.5B parameters, N = {n}, {precision} "
          f"Adam, K = 12), GB per rank, stages 0-3: " + ", ".join(f"{t:.3g}" for t in paper))
    bad = [f"N {r['n']} stage {r['stage']}" for r in rows if not within(r)]
    print(f"# floors (memory and bytes sent within {TOLERANCE:.0%} of the formulas): "
          + ("met" if not bad else "MISSED by " + ", ".join(bad)))
    if args.json:
        harness.write(args.json, "zero", rows, mpi=True, config=config)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
