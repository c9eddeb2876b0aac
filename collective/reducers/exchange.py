"""What every data-parallel gradient exchange shares with the trainer, whose contract
with it is `Exchange` (models/run/exchange.py): a logged scalar averaged over the
ranks, the step records that are final, and the parts of the contract a data-parallel
exchange leaves as they are (nothing to pull before a step or to push after it; the
optimizer runs on every rank).

`loss` in the metrics is the mean over the step's global batch for every method: the
trainer averages each rank's loss with `average` (one MPI all-reduce of a float64), or,
where the ranks do not meet every step (local SGD), the exchange holds the records until
they do and averages the losses then (`settled`: collective/reducers/local_sgd.py).

The step's other scalar, the stop agreement (models/run/stop.py: each rank's caught
signals summed over every rank of the job), rides on the same all-reduce where the
ranks whose losses make the global batch are the whole job (plain data parallelism,
dp x ep, ZeRO, compression, 1-bit Adam, the quantized ring without pp or tp):
`scalars` sums [loss, SIGTERM count, SIGINT count] as float64 (the counts are small
integers, exact) with the same MPI call on the same ranks as `average`, and divides the
loss by the same size, so the logged loss keeps its bits. On a grid with pp or tp the
loss is averaged over the dp (x ep) ranks of each (pp, tp) position but the agreement
must reach every rank: it stays a second all-reduce over the world. One world call with
the other positions' losses zeroed would sum the dp losses in MPI's order over the
world's ranks, not over the dp group's (a binomial tree over dp 4 x pp 3 adds
((a0 + a1) + a2) + a3 where the dp group's adds (a0 + a1) + (a2 + a3)): with MPICH the
mean differed in the last bit in 96 of 400 random trials at that grid.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from dtlab.collective.comm import Communicator
from dtlab.models.run.exchange import Single

Scalars = Callable[[float, np.ndarray], tuple[float, np.ndarray]]


class Exchange(Single):
    """The base of DataParallelReducer, ZeroReducer, CompressReducer and LocalReducer:
    one process's exchange (Single: nothing to pull before a step or to push after it, the
    optimizer on every rank) whose logged loss is averaged over the ranks."""

    averages_every_step = True  # False: the losses meet at round ends (LocalReducer)

    def __init__(self, scalar_comm: Communicator):
        self.scalar_comm = scalar_comm  # the ranks whose losses make the global batch's
        # one buffer each: the same call goes to its prepared runner
        self._scalar = np.zeros(1)
        self._scalars = np.zeros(3)  # [loss, SIGTERM count, SIGINT count]

    def average(self, value: float) -> float:
        """The mean of `value` over the ranks."""
        self._scalar[0] = value
        return float(self.scalar_comm.allreduce(self._scalar, average=True, algo="mpi")[0])

    def scalars(self, value: float, counts: np.ndarray) -> tuple[float, np.ndarray]:
        """(the mean of `value` over the ranks, the (2,) stop `counts` summed over them) in
        one all-reduce: the sum `average` takes, divided by the same size, so the mean is
        average's bit for bit (each element of an MPI sum is reduced on its own)."""
        buf = self._scalars
        buf[0], buf[1:] = value, counts
        self.scalar_comm.allreduce(buf, algo="mpi")
        return float(buf[0] / self.scalar_comm.size), buf[1:].astype(np.int64)


def step_scalars(exchange, world: Communicator) -> Scalars | None:
    """The trainer's one all-reduce of a step's scalars (`Exchange.scalars`) where it can
    carry both the loss average and the stop agreement: a data-parallel exchange that
    averages the loss every step over ranks that are the whole job. None elsewhere (a
    pp or tp grid, local SGD's round ends, a windowed 2BW run): the trainer then averages
    the loss with `average` and agrees at the step's end apart (module docstring)."""
    if isinstance(exchange, Exchange) and exchange.averages_every_step and \
            exchange.scalar_comm.size == world.size:
        return exchange.scalars
    return None
