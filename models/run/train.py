"""Single-process training.

    python -m dtlab.models.run.train --model transformer --steps 600 --seed 0 --metrics runs/t.jsonl
    python -m dtlab.models.run.train --model mlp --data digits --d-hidden 128 --lr 3e-3
    python -m dtlab.models.run.train --model mlp --steps 200 --simulate-workers 4 --staleness 3

Writes JSON-lines metrics (header with config, versions, hardware and the
data's loss floor; then one object per step) and prints a summary: final
loss (mean of the last 10% of steps) against the floor, throughput and
achieved GFLOP/s from the cost estimator's FLOP count. --simulate-workers W
trains as W asynchronous workers would, each gradient --staleness updates
stale (models/run/simulated.py).
"""

from __future__ import annotations

import sys

from dtlab.models.data.dataset import in_words
from dtlab.models.run.allocator import keep_freed_memory
from dtlab.models.run.checkpoint import CheckpointError
from dtlab.models.run.cli import command_name, run_cli
from dtlab.models.run.metrics import MetricsLog, run_header
from dtlab.models.run.session import build_session, parse, replica_cost
from dtlab.models.run.simulated import SimulatedWorkers, add_simulate_flags, simulate_config
from dtlab.models.run.threads import share_cores
from dtlab.models.run.trainer import Trainer


def main(argv: list[str]) -> int:
    setup = parse(argv, prog=command_name("dtlab.models.run.train"),
                  description=__doc__.split("\n\n")[0], add_extra=add_simulate_flags)
    simulate = simulate_config(setup)  # None: plain training
    keep_freed_memory()
    threads = share_cores()
    session = build_session(setup)
    cost = replica_cost(setup)
    header = run_header(session, "single", flops_per_step=cost.flops_step,
                        threads=threads.as_dict(),
                        **(simulate.header(setup.run) if simulate else {}))
    log = MetricsLog(setup.run.metrics, header, append=setup.run.resume)
    print(f"{setup.model_name}: {session.params.size:,} parameters; data "
          f"{in_words(header['dataset'])}; {threads.describe()}", file=sys.stderr)
    try:
        trainer = SimulatedWorkers(session, log, simulate) if simulate else Trainer(session, log)
        summary = trainer.run()
    finally:
        log.close()
    for line in summary.lines(cost.flops_step):
        print(line)
    return summary.exit_code


def cli() -> int:
    return run_cli(main, command_name("dtlab.models.run.train"),
                   user_errors=(CheckpointError, FloatingPointError))


if __name__ == "__main__":
    sys.exit(cli())
