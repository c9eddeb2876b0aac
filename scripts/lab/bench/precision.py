"""Mixed-precision benchmark: memory, step time and the loss after a fixed budget, per
--precision, against fp32 trained in the same run.

    dtlab-bench precision --json bench-precision.json   # 2 models x 3, ~1 min
    dtlab-bench precision --tiny                        # seconds; run by the suite

For each model and precision (fp32, fp16, bf16; models/precision.py) it trains
the same run (seed, data, AdamW, --steps) with dtlab's trainer on a synthetic
source whose loss floor is exact (a teacher MLP; a Markov chain for the
transformer), and reports:

    step(ms)   median step time after the first 5 steps; x fp32 = that / fp32's
    act MB     bytes the forward context keeps for backward, measured
               (models/memory.py), beside models/cost.py's estimate for the precision
    grad MB    the gradient buffer backward writes (half under fp16/bf16), beside the
               estimate; +f32 grad MB: the float32 unscaled gradient the optimizer reads
               (mixed precision only; ZeRO's accounting has no such buffer)
    weight MB  the copy forward reads; master MB the float32 master copy (mixed only)
    opt MB     optimizer state (float32 at every precision)
    loss       mean training loss of the last 10% of steps; d fp32 = loss - fp32's;
               gap = loss - the data's floor; skipped = fp16 steps skipped on overflow

A mismatch between a measured and an estimated byte count, a non-finite loss or
a loss more than 0.05 nats above fp32's counts in #wrong and makes the exit
status 1. On the CPU half-precision arithmetic is emulated (half storage,
float32 compute: NumPy has no half BLAS), so the step-time column there shows
the cost of the casts, not a tensor-core speed-up; the memory columns are the
point.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys

from dtlab.lab.bench import harness
from dtlab.lab.bench.harness import start
from dtlab.lab.bench.model import finish, machine_header
from dtlab.models import backend
from dtlab.models.cost import OPTIMIZER_STATES, estimate
from dtlab.models.memory import context_bytes
from dtlab.models.precision import PRECISIONS
from dtlab.models.run.metrics import MetricsLog
from dtlab.models.run.session import build_session, parse
from dtlab.models.run.trainer import Trainer

# (name, flags): the data flags fix a source with an exact loss floor
RUNS = [
    ("mlp", ["--model", "mlp", "--d-in", "32", "--d-hidden", "512", "--n-layers", "3",
             "--n-classes", "8", "--batch-size", "256", "--lr", "3e-3"]),
    ("transformer", ["--model", "transformer", "--vocab", "32", "--seq-len", "64",
                     "--d-model", "128", "--n-heads", "4", "--n-layers", "2", "--d-ff", "512",
                     "--markov-order", "1", "--markov-support", "4", "--n-tokens", "400000",
                     "--batch-size", "16", "--lr", "3e-3"]),
]
TINY = [
    ("mlp", ["--model", "mlp", "--d-in", "8", "--d-hidden", "32", "--n-classes", "4",
             "--batch-size", "32", "--lr", "1e-2"]),
    ("transformer", ["--model", "transformer", "--vocab", "8", "--seq-len", "16",
                     "--d-model", "32", "--n-heads", "2", "--n-layers", "1", "--d-ff", "64",
                     "--markov-order", "1", "--markov-support", "2", "--n-tokens", "20000",
                     "--batch-size", "8", "--lr", "1e-2"]),
]
WORSE_NATS = 0.05  # a half-precision loss this far above fp32's counts as wrong


def bench_one(name: str, flags: list[str], precision: str, steps: int,
              fp32_loss: float | None) -> dict:
    setup = parse([*flags, "--steps", str(steps), "--warmup", "10", "--log-every",
                   str(10 * steps), "--precision", precision], prog="bench_precision")
    s = build_session(setup)
    trainer = Trainer(s, MetricsLog("", {}))
    records = [trainer.step(i) for i in range(steps)]
    losses = [r["loss"] for r in records]
    tail = losses[-max(1, steps // 10):]
    loss = sum(tail) / len(tail)
    work = s.replica.compute_params  # what forward and backward ran on
    _, ctx = s.model.forward(work, s.loader.next()[0])
    cost = estimate(name, setup.model, setup.run.batch_size, optimizer="adamw")
    est = cost.memory[precision]
    opt_bytes = sum(v.nbytes for k, v in s.optimizer.state_dict().items() if k != "steps")
    mixed = work is not s.params
    row = {
        "model": name, "precision": precision, **harness.flatten("config", cost.config),
        "batch_size": setup.run.batch_size, "params": s.params.size, "steps": steps,
        "step_s_median": statistics.median(r["step_s"] for r in records[min(5, steps - 1):]),
        "act_bytes": context_bytes(ctx), "act_bytes_est": est.activations,
        "grad_bytes": work.grad.nbytes, "grad_bytes_est": est.grads,
        "f32_grad_bytes": s.params.grad.nbytes if mixed else 0,
        "weight_bytes": work.data.nbytes, "weight_bytes_est": est.weights,
        "master_bytes": s.params.data.nbytes if mixed else 0, "master_bytes_est": est.master,
        "opt_bytes": opt_bytes, "opt_bytes_est": 4 * OPTIMIZER_STATES["adamw"] * s.params.size,
        "loss": loss, "floor": s.dataset.floor,
        "skipped_steps": records[-1].get("skipped_steps", 0),
        "loss_scale": records[-1].get("loss_scale"),
    }
    row["d_fp32"] = 0.0 if fp32_loss is None else loss - fp32_loss
    row["wrong"] = (sum(int(row[k] != row[f"{k}_est"]) for k in
                        ("act_bytes", "grad_bytes", "weight_bytes", "master_bytes", "opt_bytes"))
                    + int(not all(map(math.isfinite, losses))) + int(row["d_fp32"] > WORSE_NATS))
    return row


def columns(fp32_s: float) -> list[harness.Column]:
    """The table's columns; `fp32_s` the fp32 step of the same model, the baseline."""
    mb = 1e6

    def gap(r: dict) -> float:
        return r["loss"] - r["floor"] if r["floor"] is not None else math.nan

    return [harness.Column("model", 11, lambda r: r["model"]),
            harness.Column("prec", 5, lambda r: r["precision"]),
            harness.Column("params", 9, lambda r: f"{r['params'] / 1e6:.2f}M"),
            harness.Column("step(ms)", 9, lambda r: r["step_s_median"] * 1e3, ".2f"),
            harness.Column("x fp32", 7, lambda r: r["step_s_median"] / fp32_s, ".2f"),
            harness.Column("act MB", 8, lambda r: r["act_bytes"] / mb, ".3f"),
            harness.Column("est", 7, lambda r: r["act_bytes_est"] / mb, ".3f"),
            harness.Column("grad MB", 8, lambda r: r["grad_bytes"] / mb, ".3f"),
            harness.Column("est", 7, lambda r: r["grad_bytes_est"] / mb, ".3f"),
            harness.Column("+f32 grad", 9, lambda r: r["f32_grad_bytes"] / mb, ".3f"),
            harness.Column("weight MB", 9, lambda r: r["weight_bytes"] / mb, ".3f"),
            harness.Column("master", 7, lambda r: r["master_bytes"] / mb, ".3f"),
            harness.Column("opt MB", 7, lambda r: r["opt_bytes"] / mb, ".3f"),
            harness.Column("loss", 7, lambda r: r["loss"], ".4f"),
            harness.Column("d fp32", 7, lambda r: r["d_fp32"], "+.4f"),
            harness.Column("gap", 6, gap, "+.3f"),
            harness.Column("skipped", 7, lambda r: r["skipped_steps"]),
            harness.Column("#wrong", 6, lambda r: r["wrong"])]


LEGEND = ("x fp32 = step time / fp32's; act, grad, weight, master, opt MB measured, est = "
          "models/cost.py for the precision; +f32 grad = the float32 unscaled gradient (mixed "
          "only); loss = mean of the last 10% of steps; d fp32 = loss - fp32's; gap = loss - "
          f"the data's floor; #wrong = a byte mismatch, a non-finite loss or d fp32 > {WORSE_NATS}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    harness.common_flags(p, "tiny sizes, few steps: a smoke run")
    p.add_argument("--steps", type=int, default=None,
                   help="training steps per run, the fixed budget (default 300; --tiny 20)")
    args = p.parse_args(argv)
    steps = args.steps if args.steps is not None else (20 if args.tiny else 300)
    if steps < 1:
        p.error("--steps must be at least 1")
    started = start(p.prog)
    if started is None:
        return 2
    threads, device = started
    header = machine_header("precision", device, threads, steps=steps, timing="median step after 5")
    print(f"# dtlab mixed-precision benchmark on {device}: {steps} steps per run, AdamW, "
          f"{threads.describe()}; fp32 trained in the same run is the baseline")
    print(harness.Table(LEGEND, columns(1.0)).head())
    rows = []
    for name, flags in TINY if args.tiny else RUNS:
        base = None
        for precision in PRECISIONS:
            if precision == "bf16" and backend.on_gpu():
                print(f"# {name} bf16: skipped on the GPU (CuPy has no bfloat16)")
                continue
            row = bench_one(name, flags, precision, steps, base and base["loss"])
            base = base or row
            rows.append(row)
            print(harness.Table(LEGEND, columns(base["step_s_median"])).line(row), flush=True)
    return finish(rows, header, args.json)


if __name__ == "__main__":
    sys.exit(main())
