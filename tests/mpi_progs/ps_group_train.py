"""Train as parameter-server worker groups, then save the dense parameters group 0 holds.

    mpiexec -n 4 python -m mpi4py tests/mpi_progs/ps_group_train.py OUT.npy \\
        --servers 127.0.0.1:50051 --pp 2 --model mlp ...

Runs pserver.group_worker's `run_group` with the given worker flags (every
rank ends holding the servers' parameters of its partition after its last
step), rebuilds every dense tensor of this rank's stage from its tp shards
(dense_values, collective over the tp group), gathers the stages over the
pipeline, and has world rank 0 (group 0's partition 0) write them,
concatenated in the dense model's parameter order, to OUT.npy: the layout of
a single-process run's flat parameters.
"""

from __future__ import annotations

import sys

import numpy as np

from dtlab.models.config import from_namespace
from dtlab.models.tensor_parallel import dense_values
from dtlab.models.zoo import build_model
from dtlab.pserver.config import ClientConfig
from dtlab.pserver.group_worker import run_group
from dtlab.pserver.worker import WorkerConfig, parse_args

out, argv = sys.argv[1], sys.argv[2:]
setup = parse_args(argv)
session, group, _ = run_group(setup, from_namespace(WorkerConfig, setup.extra),
                              from_namespace(ClientConfig, setup.extra))
grid = group.grid
mine = dense_values(session.params, grid.tp_comm)
stages = grid.pp_comm.mpi.gather(mine, root=0)
if grid.rank == 0:
    dense = {name: value for stage in stages for name, value in stage.items()}
    order = build_model(setup.model_name, setup.model).specs()
    np.save(out, np.concatenate([dense[s.name].ravel() for s in order]))
