"""The small all-reduces of dtlab-sync's steps, as the flight recorder saw them (see
tests/collective/test_step_scalars.py).

    mpiexec -n 2 python -m mpi4py tests/support/mpi_progs/step_scalars.py OUT.json \\
        [one,apart] --model mlp --steps 3 --metrics M.jsonl [--pp 2 ...]

Trains with the given dtlab-sync flags on every rank, once per mode named (default: one),
then writes to OUT.json (rank 0), per mode, the run's logged losses and, per rank, every
all-reduce that ran through MPI during that training (our scalar ones: the loss average
and the stop agreement; the gradients go through our own algorithms) as [communicator,
bytes, dtype]. `one`: the trainer as it is; `apart`: the trainer handed no step scalars
(collective/reducers/exchange.py step_scalars), so it averages the loss and agrees on a
stop in two all-reduces, as before they travelled in one. Each mode trains afresh from
the same flags in the same job (its metrics in M.<mode>.jsonl), so two modes cost one
MPI launch.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from mpi4py import MPI

from dtlab.collective import train
from dtlab.collective.transport import flight
from dtlab.models.run.metrics import read_metrics

MODES = ("one", "apart")


def trained(mode: str, argv: list[str]) -> dict:
    """Train with dtlab-sync flags `argv` in `mode`; the MPI all-reduces of every rank
    (gathered on rank 0) and the logged losses (rank 0)."""
    setup = train.parse_args(argv)
    setup.run.metrics = str(Path(setup.run.metrics).with_suffix(f".{mode}.jsonl"))
    scalars = train.step_scalars
    if mode == "apart":
        train.step_scalars = lambda exchange, world: None
    started = time.time()
    try:
        train.train(setup)
    finally:
        train.step_scalars = scalars
    calls = [[e["comm"].split("#")[0], e["bytes"], e["dtype"]]
             for e in flight.snapshot("test")["entries"]
             if e["op"] == "allreduce" and e["algo"] == "mpi" and e["start"] >= started]
    every = MPI.COMM_WORLD.gather(calls, root=0)
    losses = [r["loss"] for r in read_metrics(setup.run.metrics)[1]] \
        if MPI.COMM_WORLD.rank == 0 else None
    return {"calls": every, "losses": losses}


def main(out: str, argv: list[str]) -> None:
    named = argv[0].split(",")
    modes, flags = (named, argv[1:]) if set(named) <= set(MODES) else (["one"], argv)
    results = {mode: trained(mode, flags) for mode in modes}
    if MPI.COMM_WORLD.rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
