"""Sync data-parallel training throughput for N = 1, 2, 4 ranks, and where the time goes.

    dtlab-bench sync --json bench-sync.json
    dtlab-bench sync --ranks 1,2 --allreduce ring,mpi --steps 40 -- --d-model 128

Runs `mpiexec -n N python -m dtlab.collective.train` on one fixed config (per-rank
batch fixed: weak scaling) for each N and all-reduce algorithm, reads the
rank-0 metrics and reports, over the steps after warm-up (medians):

    samples/s    global samples per second
    speedup      samples/s over the same run's N = 1 figure
    efficiency   speedup / N (1.0 is perfect weak scaling)
    comm %       time inside bucket all-reduces / step time (may overlap backward)
    wait %       time the step was blocked on communication / step time (exposed)
    MB/step      bytes each rank hands to the gradient all-reduce per step (--wire
                 fp16/bf16 halve them; the casts are inside comm %)
    dloss        mean loss of the last fifth of the steps minus the fp32 wire's
                 (same algorithm and N): the error the wire dtype introduces

BLAS threads per rank are chosen by the trainer (cores // N, at least 1,
models/run/threads.py; recorded in the `threads` column), so every N uses the
same cores. Extra arguments after `--` go to the trainer.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

from dtlab.lab.bench import harness
from dtlab.models.run.launcher_env import mpiexec_path
from dtlab.models.run.metrics import read_metrics

CONFIG = ["--model", "transformer", "--vocab", "64", "--seq-len", "64", "--d-model", "256",
          "--n-heads", "8", "--n-layers", "4", "--d-ff", "1024", "--batch-size", "8"]
TINY = ["--model", "mlp", "--d-in", "8", "--d-hidden", "16", "--n-classes", "4",
        "--n-samples", "1024", "--batch-size", "8"]


def run(n: int, algo: str, wire: str, steps: int, config: list[str], workdir: str,
        timeout: float) -> dict:
    metrics = os.path.join(workdir, f"sync-{n}-{algo}-{wire}.jsonl")
    cmd = [mpiexec_path(), "-n", str(n), sys.executable, "-m", "dtlab.collective.train", *config,
           "--steps", str(steps), "--allreduce", algo, "--wire", wire, "--metrics", metrics,
           "--log-every", str(steps), "--warmup", "0"]
    subprocess.run(cmd, check=True, timeout=timeout,
                   stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    header, records = read_metrics(metrics)
    kept = records[max(1, len(records) // 5):]  # drop warm-up steps
    step_s = statistics.median(r["step_s"] for r in kept)
    run_cfg = header["config"]["run"]
    samples = run_cfg["batch_size"] * run_cfg["grad_accum"] * n
    return {"n": n, "algo": algo, "wire": wire, "params": header["n_params"],
            "samples_per_step": samples, "wire_mb": kept[-1]["wire_bytes"] / 1e6,
            "tail_loss": statistics.mean(r["loss"] for r in kept),
            "threads": header["threads"]["threads"], "step_ms": step_s * 1e3,
            "samples_per_s": samples / step_s,
            "comm_frac": statistics.median(r["comm_s"] / r["step_s"] for r in kept),
            "wait_frac": statistics.median(r["wait_s"] / r["step_s"] for r in kept),
            "final_loss": records[-1]["loss"]}


TABLE = harness.Table(
    "threads: BLAS threads per rank; speedup: samples/s over the first n's; effic: speedup "
    "/ n; comm %: all-reduce time / step; wait %: exposed wait / step; MB/step: bytes into "
    "the all-reduce; dloss: tail loss minus the fp32 wire's",
    [harness.Column("algo", 6, lambda r: r["algo"]),
     harness.Column("wire", 5, lambda r: r["wire"]),
     harness.Column("n", 3, lambda r: r["n"]),
     harness.Column("threads", 7, lambda r: r["threads"]),
     harness.Column("step(ms)", 9, lambda r: r["step_ms"], ".1f"),
     harness.Column("samples/s", 10, lambda r: r["samples_per_s"], ".1f"),
     harness.Column("speedup", 8, lambda r: r["speedup"], ".2f"),
     harness.Column("effic", 6, lambda r: r["efficiency"], ".2f"),
     harness.Column("comm %", 7, lambda r: 100 * r["comm_frac"], ".1f"),
     harness.Column("wait %", 7, lambda r: 100 * r["wait_frac"], ".1f"),
     harness.Column("MB/step", 8, lambda r: r["wire_mb"], ".3f"),
     harness.Column("dloss", 8, lambda r: r["loss_vs_fp32"], "+.4f")])


def main() -> int:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    harness.launch_flags(p, None, ranks="1,2,4")
    p.add_argument("--allreduce", default="ring,mpi", help="comma-separated algorithms")
    p.add_argument("--wire", default="fp32", help="comma-separated gradient wire dtypes "
                                                  "(fp32, fp16, bf16)")
    p.add_argument("--steps", type=int, default=30)
    harness.common_flags(p, "a seconds-long run (for the test suite)")
    args = p.parse_args(own)
    ranks = args.ranks
    config = (TINY if args.tiny else CONFIG) + extra
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        for algo in args.allreduce.split(","):
            for wire in args.wire.split(","):
                for n in ranks:
                    rows.append(run(n, algo, wire, args.steps, config, workdir, timeout=600))
    base = {(r["algo"], r["wire"]): r["samples_per_s"] for r in rows if r["n"] == ranks[0]}
    fp32 = {(r["algo"], r["n"]): r["tail_loss"] for r in rows if r["wire"] == "fp32"}
    print(f"# sync data parallel, {rows[0]['params']:,} parameters, "
          f"{os.cpu_count()} cores, per-rank batch fixed")
    print(TABLE.head())
    for r in rows:
        r["speedup"] = r["samples_per_s"] / base[(r["algo"], r["wire"])]
        r["efficiency"] = r["speedup"] * ranks[0] / r["n"]
        ref = fp32.get((r["algo"], r["n"]))
        r["loss_vs_fp32"] = None if ref is None else r["tail_loss"] - ref
        print(TABLE.line(r))
    if args.json:
        harness.write(args.json, "sync", rows, mpi=True, config=config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
