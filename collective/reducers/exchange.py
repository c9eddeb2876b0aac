"""What every data-parallel gradient exchange shares with the trainer, whose contract
with it is `Exchange` (models/run/exchange.py): a logged scalar averaged over the
ranks, the step records that are final, and the parts of the contract a data-parallel
exchange leaves as they are (nothing to pull before a step or to push after it; the
optimizer runs on every rank).

`loss` in the metrics is the mean over the step's global batch for every method: the
trainer averages each rank's loss with `average` (one MPI all-reduce of a float64), or,
where the ranks do not meet every step (local SGD), the exchange holds the records until
they do and averages the losses then (`settled`: collective/reducers/local_sgd.py).
"""

from __future__ import annotations

import numpy as np

from dtlab.collective.comm import Communicator


class Exchange:
    """The base of DataParallelReducer, ZeroReducer, CompressReducer and LocalReducer."""

    overlap = False  # ready() starts reducing while backward still runs
    optimizer_here = True  # every rank steps its optimizer on the reduced gradient

    def __init__(self, scalar_comm: Communicator):
        self.scalar_comm = scalar_comm  # the ranks whose losses make the global batch's
        self._scalar = np.zeros(1)  # one buffer: the same call goes to its prepared runner

    def begin(self, step: int) -> dict:
        """Nothing before a step: every rank holds the parameters."""
        return {}

    def refresh(self) -> None:
        """Nothing before an evaluation: every rank holds the parameters."""

    def finish(self, step: int, applied: bool) -> dict:
        """Nothing after the update: wait() brought the reduced gradient."""
        return {}

    def average(self, value: float) -> float:
        """The mean of `value` over the ranks."""
        self._scalar[0] = value
        return float(self.scalar_comm.allreduce(self._scalar, average=True, algo="mpi")[0])

    def settled(self, record: dict) -> list[dict]:
        """The step records final after this one: this one, its loss already averaged."""
        return [record]
