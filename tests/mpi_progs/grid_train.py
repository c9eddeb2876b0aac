"""Train with dtlab.collective.train, then save the dense parameters the shards make up.

    mpiexec -n 4 python -m mpi4py tests/mpi_progs/tp_train.py OUT.npy --dp 2 --tp 2 ...

Runs `train` with the given flags, rebuilds every dense tensor from the tp
shards (dense_values, collective over the tp group) and has world rank 0
write them, concatenated in the model's parameter order, to OUT.npy: the
layout of a single-process run's flat parameters.
"""

from __future__ import annotations

import sys

import numpy as np

from dtlab.collective.train import parse_args, train
from dtlab.models.tensor_parallel import dense_values

out, argv = sys.argv[1], sys.argv[2:]
session, grid = train(parse_args(argv))
dense = dense_values(session.params, grid.tp_comm)
if grid.rank == 0:
    np.save(out, np.concatenate([dense[s.name].ravel() for s in session.params.specs]))
