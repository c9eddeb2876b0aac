"""Save a split model's parameters in its dense twin's layout (the helper of the MPI
programs that train and then compare with one process).

Every rank rebuilds the dense tensors of its part from its tp shards (dense_values,
collective over the tp group); world rank 0 gathers every rank's by name (the stages of
a pipeline, the experts of the ep ranks; replicas hold the same values) and writes them,
concatenated in the dense model's parameter order, to OUT.npy: the layout of a
single-process run's flat parameters.
"""

from __future__ import annotations

import numpy as np

from dtlab.models.tensor_parallel import dense_values
from dtlab.models.zoo import build_model


def save_dense(out: str, setup, params, grid) -> None:
    """Collective over `grid`'s world; rank 0 writes `out`."""
    mine = dense_values(params, grid.tp_comm)
    every = grid.world.mpi.gather(mine, root=0)
    if grid.rank == 0:
        dense = {name: value for part in every for name, value in part.items()}
        order = build_model(setup.model_name, setup.model).specs()
        np.save(out, np.concatenate([dense[s.name].ravel() for s in order]))
