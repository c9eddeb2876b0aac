"""The small all-reduces of dtlab-sync's steps, as the flight recorder saw them (see
tests/collective/test_step_scalars.py).

    mpiexec -n 2 python -m mpi4py tests/support/mpi_progs/step_scalars.py OUT.json \\
        [apart] --model mlp --steps 3 --metrics M.jsonl [--pp 2 ...]

Trains with the given dtlab-sync flags on every rank, then writes to OUT.json (rank
0) the run's logged losses and, per rank, every all-reduce that ran through MPI during
training (our scalar ones: the loss average and the stop agreement; the gradients go
through our own algorithms) as [communicator, bytes, dtype]. `apart`: the trainer
handed no step scalars (collective/reducers/exchange.py step_scalars), so it averages
the loss and agrees on a stop in two all-reduces, as before they travelled in one.
"""

from __future__ import annotations

import json
import sys
import time

from mpi4py import MPI

from dtlab.collective import train
from dtlab.collective.transport import flight
from dtlab.models.run.metrics import read_metrics


def main(out: str, argv: list[str]) -> None:
    if argv[0] == "apart":
        train.step_scalars, argv = lambda exchange, world: None, argv[1:]
    setup = train.parse_args(argv)
    started = time.time()
    train.train(setup)
    calls = [[e["comm"].split("#")[0], e["bytes"], e["dtype"]]
             for e in flight.snapshot("test")["entries"]
             if e["op"] == "allreduce" and e["algo"] == "mpi" and e["start"] >= started]
    every = MPI.COMM_WORLD.gather(calls, root=0)
    if MPI.COMM_WORLD.rank == 0:
        losses = [r["loss"] for r in read_metrics(setup.run.metrics)[1]]
        with open(out, "w") as f:
            json.dump({"calls": every, "losses": losses}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
