"""Single-process training.

    python -m models.train --model transformer --steps 600 --seed 0 --metrics runs/t.jsonl
    python -m models.train --model mlp --data digits --d-hidden 128 --lr 3e-3

Writes JSON-lines metrics (header with config, versions, hardware and the
data's loss floor; then one object per step) and prints a summary: final
loss (mean of the last 10% of steps) against the floor, throughput and
achieved GFLOP/s from the cost estimator's FLOP count.
"""

from __future__ import annotations

import sys

from models.checkpoint import CheckpointError
from models.config import run_cli
from models.cost import estimate
from models.metrics import MetricsLog, run_header
from models.session import Setup, build_session, parse
from models.threads import share_cores
from models.trainer import Summary, Trainer


def summary_lines(summary: Summary, flops_per_step: float | None) -> list[str]:
    seconds = max(summary.seconds, 1e-9)
    speed = f"steps {summary.steps} in {seconds:.1f} s, {summary.samples_per_s:,.0f} samples/s"
    if flops_per_step is not None:
        speed += f", {flops_per_step * summary.steps / seconds / 1e9:.1f} GFLOP/s"
    lines = [speed]
    loss = f"final loss {summary.final_loss:.4f}"
    if summary.floor is not None:
        loss += f"  floor {summary.floor:.4f}  gap {summary.gap:+.4f} nats"
    return lines + [loss]


def replica_cost(setup: Setup):
    """The cost estimate of one replica's step as `setup` configures it (all
    micro-batches; SGD with momentum keeps one state buffer, without none)."""
    optimizer = setup.optim.optimizer
    if optimizer == "sgd" and setup.optim.momentum > 0:
        optimizer = "sgd-momentum"
    return estimate(setup.model_name, setup.model,
                    setup.run.batch_size * setup.run.grad_accum, optimizer=optimizer)


def main(argv: list[str]) -> int:
    setup = parse(argv, prog="python -m models.train", description=__doc__.split("\n\n")[0])
    threads = share_cores()
    session = build_session(setup)
    cost = replica_cost(setup)
    header = run_header(session, "single", flops_per_step=cost.flops_step,
                        threads=threads.as_dict())
    log = MetricsLog(setup.run.metrics, header, append=setup.run.resume)
    print(f"{setup.model_name}: {session.params.size:,} parameters, data {header['dataset']}; "
          f"{threads.describe()}", file=sys.stderr)
    try:
        summary = Trainer(session, log).run()
    finally:
        log.close()
    for line in summary_lines(summary, cost.flops_step):
        print(line)
    return 0


def cli() -> int:
    return run_cli(main, user_errors=(CheckpointError, FloatingPointError))


if __name__ == "__main__":
    sys.exit(cli())
