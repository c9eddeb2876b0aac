"""Train several configurations in one launch and save each one's final parameters.

    mpiexec -n 2 python -m mpi4py tests/support/mpi_progs/zero_cases.py CASES.json OUT.npz

CASES.json is a list of {"name": ..., "argv": [...], "single": false, "copy": null}: each
case runs `dtlab.collective.train`'s train() on these ranks (plain data parallelism, or
--zero S), or with "single": true the single-process trainer (build_session + Trainer, as
dtlab-train runs it; launch it with -n 1); with "copy": [SRC, DST] world rank 0 first
copies the directory SRC to DST (a checkpoint directory to resume from in another way).
The cases run in order. World rank 0 saves every case's whole final parameters (ZeRO: the
shards gathered) under its name in OUT.npz, in the layout of a single-process run's flat
parameters.
"""

from __future__ import annotations

import json
import shutil
import sys

import numpy as np
from mpi4py import MPI

from dtlab.collective.train import parse_args, train
from dtlab.models import backend
from dtlab.models.run.metrics import MetricsLog
from dtlab.models.run.session import build_session, parse
from dtlab.models.run.trainer import Trainer


def single(argv: list[str]) -> np.ndarray:
    session = build_session(parse(argv, prog="single"))
    log = MetricsLog("", {})
    Trainer(session, log).run()
    log.close()
    return backend.to_host(session.params.data)


def sync(argv: list[str]) -> np.ndarray:
    session, _, _ = train(parse_args(argv))
    replica = session.replica
    values = replica.zero.full_values() if hasattr(replica, "zero") else session.params.data
    return backend.to_host(values)


def run(c: dict) -> np.ndarray:
    if c.get("copy"):
        if MPI.COMM_WORLD.rank == 0:
            shutil.copytree(*c["copy"])
        MPI.COMM_WORLD.Barrier()
    return (single if c.get("single") else sync)(c["argv"])


cases_path, out = sys.argv[1], sys.argv[2]
with open(cases_path) as f:
    cases = json.load(f)
results = {c["name"]: run(c) for c in cases}
if MPI.COMM_WORLD.rank == 0:
    np.savez(out, **results)
