"""Train with dtlab.collective.train, then save the dense parameters the shards make up.

    mpiexec -n 8 python -m mpi4py tests/mpi_progs/grid_train.py OUT.npy --dp 2 --pp 2 --tp 2 ...

Runs `train` with the given flags, rebuilds every dense tensor of this
rank's stage from its tp shards (dense_values, collective over the tp
group), gathers them from every rank (the stages of the pipeline, the
experts of the ep ranks) by name, and has world rank 0 write them,
concatenated in the dense model's parameter order, to OUT.npy: the layout
of a single-process run's flat parameters.
"""

from __future__ import annotations

import sys

import numpy as np

from dtlab.collective.train import parse_args, train
from dtlab.models.tensor_parallel import dense_values
from dtlab.models.zoo import build_model

out, argv = sys.argv[1], sys.argv[2:]
setup = parse_args(argv)
session, grid, _ = train(setup)
mine = dense_values(session.params, grid.tp_comm)
every = grid.world.mpi.gather(mine, root=0)
if grid.rank == 0:
    dense = {name: value for part in every for name, value in part.items()}
    order = build_model(setup.model_name, setup.model).specs()
    np.save(out, np.concatenate([dense[s.name].ravel() for s in order]))
