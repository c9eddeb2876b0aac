"""dtlab-sync configurations trained twice in one launch, on NumPy and under the CuPy-discipline
check's strict namespace (tests/support/strict_xp.py), which must agree bit for bit.

    mpiexec -n 2 python -m mpi4py tests/support/mpi_progs/discipline_cases.py CASES.json OUT.json

CASES.json is a list of {"name": ..., "argv": [...]} (and optionally "resume": [...], a
second run on the same checkpoint directory after the first). Each case runs through
`dtlab.collective.train`'s train() with DTLAB_ARRAY_MODULE unset, then set to
support.strict_xp (the backend reads it at every selection); every rank compares its own
final parameters and losses. World rank 0 writes per case: whether every rank agreed, and
the most device synchronisations (scalar reads, device-to-host copies) any rank made per
step under the strict namespace.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

import numpy as np
from mpi4py import MPI
from support import strict_xp

from dtlab.collective.train import parse_args, train
from dtlab.models import backend
from dtlab.models.run.metrics import read_metrics


def run(argv: list[str]) -> bytes:
    """Train `argv` on this rank: its final parameters' bytes."""
    session, _, _ = train(parse_args(argv))
    return backend.to_host(session.params.data).tobytes()


def case_runs(case: dict, tag: str, world: MPI.Comm) -> tuple[bytes, list]:
    """The case's run (and its resumed run), its files under per-rank names tagged `tag`."""
    rank = world.rank
    metrics = f"{case['dir']}/{tag}-metrics.jsonl"  # rank 0 writes the metrics
    ck = f"{case['dir']}/{tag}-ck"
    saves = ["--checkpoint-dir", ck] if "resume" in case else []
    params = run([*case["argv"], "--metrics", metrics, *saves])
    if "resume" in case:
        params = run([*case["resume"], "--metrics", metrics, "--checkpoint-dir", ck, "--resume"])
    world.Barrier()
    losses = [rec.get("loss") for rec in read_metrics(metrics)[1]]
    world.Barrier()
    if rank == 0:
        shutil.rmtree(ck, ignore_errors=True)
    return params, losses


def strict_run(case: dict, world: MPI.Comm) -> tuple[bytes, list, dict]:
    os.environ[backend.ARRAY_MODULE_ENV] = "support.strict_xp"
    try:
        strict_xp.SYNCS.clear()
        params, losses = case_runs(case, "strict", world)
        syncs = dict(strict_xp.SYNCS)
    finally:
        del os.environ[backend.ARRAY_MODULE_ENV]
    return params, losses, syncs


def main(cases_path: str, out: str) -> None:
    world = MPI.COMM_WORLD
    with open(cases_path) as f:
        cases = json.load(f)
    report = {}
    for case in cases:
        params_np, losses_np = case_runs(case, "numpy", world)
        params, losses, syncs = strict_run(case, world)
        same = params == params_np and losses == losses_np
        steps = case["steps"]
        mine = np.array([same, sum(syncs.get(k, 0) for k in strict_xp.SCALAR_READS) / steps,
                         syncs.get("get", 0) / steps], dtype=np.float64)
        every = world.gather(mine, root=0)
        if world.rank == 0:
            every = np.array(every)  # (ranks, 3)
            report[case["name"]] = {"equal": bool(every[:, 0].all()),
                                    "scalar_reads_per_step": float(every[:, 1].max()),
                                    "to_host_per_step": float(every[:, 2].max())}
    if world.rank == 0:
        with open(out, "w") as f:
            json.dump(report, f, indent=1)


main(sys.argv[1], sys.argv[2])
