"""Train several configurations on a dp x pp x tp grid in one launch and save every
rank's final parameters.

    mpiexec -n 4 python -m mpi4py tests/support/mpi_progs/zero_grid_cases.py CASES.json OUT.npz

CASES.json is a list of {"name": ..., "argv": [...], "copy": null}: each case runs
`dtlab.collective.train`'s train() on these ranks (plain data parallelism, or --zero S,
with --tp / --pp); with "copy": [SRC, DST] world rank 0 first copies the directory SRC
to DST (a checkpoint to resume from elsewhere). The cases run in order. World rank 0
saves, under "<name>@<r>" in OUT.npz, world rank r's whole parameters of its (pp, tp)
shard (ZeRO: its dp group's slices gathered), in the layout of that shard's flat buffer.
"""

from __future__ import annotations

import json
import shutil
import sys

import numpy as np
from mpi4py import MPI

from dtlab.collective.train import parse_args, train
from dtlab.models import backend


def run(c: dict) -> np.ndarray:
    if c.get("copy"):
        if MPI.COMM_WORLD.rank == 0:
            shutil.copytree(*c["copy"])
        MPI.COMM_WORLD.Barrier()
    session, _, _ = train(parse_args(c["argv"]))
    replica = session.replica
    values = replica.zero.full_values() if hasattr(replica, "zero") else session.params.data
    return backend.to_host(values)


cases_path, out = sys.argv[1], sys.argv[2]
with open(cases_path) as f:
    cases = json.load(f)
results = {}
for c in cases:
    every = MPI.COMM_WORLD.gather(run(c), root=0)
    if MPI.COMM_WORLD.rank == 0:
        results.update({f"{c['name']}@{r}": values for r, values in enumerate(every)})
if MPI.COMM_WORLD.rank == 0:
    np.savez(out, **results)
