"""Train as parameter-server worker groups, then save the dense parameters group 0 holds.

    mpiexec -n 4 python -m mpi4py tests/support/mpi_progs/ps_group_train.py OUT.npy \\
        --servers 127.0.0.1:50051 --pp 2 --model mlp ...

Runs pserver.worker.group_worker's `run_group` with the given worker flags (every
rank ends holding the servers' parameters of its partition after its last
step), rebuilds every dense tensor of this rank's stage from its tp shards
(dense_out.save_dense: every group holds the servers' values after its last
pull), and has world rank 0 write them in the dense model's layout to OUT.npy.
"""

from __future__ import annotations

import sys

from dense_out import save_dense

from dtlab.models.config import from_namespace
from dtlab.pserver.common.config import ClientConfig
from dtlab.pserver.worker.group_worker import run_group
from dtlab.pserver.worker.loop import WorkerConfig, parse_args

out, argv = sys.argv[1], sys.argv[2:]
setup = parse_args(argv)
session, group, _ = run_group(setup, from_namespace(WorkerConfig, setup.extra),
                              from_namespace(ClientConfig, setup.extra))
save_dense(out, setup, session.params, group.grid)
