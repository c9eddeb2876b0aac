"""Train with dtlab.collective.train, then save the dense parameters the shards make up.

    mpiexec -n 8 python -m mpi4py tests/support/mpi_progs/grid_train.py OUT.npy \
        --dp 2 --pp 2 --tp 2 ...

Runs `train` with the given flags, rebuilds every dense tensor of this
rank's stage from its tp shards (dense_values, collective over the tp
group), gathers them from every rank (the stages of the pipeline, the
experts of the ep ranks) by name, and has world rank 0 write them,
concatenated in the dense model's parameter order, to OUT.npy: the layout
of a single-process run's flat parameters.
"""

from __future__ import annotations

import sys

from dense_out import save_dense

from dtlab.collective.train import parse_args, train

out, argv = sys.argv[1], sys.argv[2:]
setup = parse_args(argv)
session, grid, _ = train(setup)
save_dense(out, setup, session.params, grid)
