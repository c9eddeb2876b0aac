"""Train with dtlab.collective.train --ep, then save the whole model's parameters.

    mpiexec -n 4 python -m mpi4py tests/mpi_progs/moe_ep_train.py OUT.npy --dp 2 --ep 2 ...

Runs `train` with the given flags, gathers every rank's parameters by name (each ep rank's
experts, each pp rank's stage) and has world rank 0 write all of them, concatenated in the
single-process model's parameter order, to OUT.npy: the layout of a single-process run's
flat parameters.
"""

from __future__ import annotations

import sys

import numpy as np

from dtlab.collective.train import parse_args, train
from dtlab.models.backend import to_host
from dtlab.models.zoo import build_model

out, argv = sys.argv[1], sys.argv[2:]
setup = parse_args(argv)
session, grid, _ = train(setup)
P = session.params
mine = {s.name: to_host(P[s.name]) for s in P.specs}
held = grid.world.mpi.gather(mine, root=0)
if grid.rank == 0:
    whole = {name: value for part in held for name, value in part.items()}
    order = build_model(setup.model_name, setup.model).specs()
    np.save(out, np.concatenate([whole[s.name].ravel() for s in order]))
