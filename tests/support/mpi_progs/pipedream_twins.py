"""dtlab-sync --pp 2 --pipedream MODE against its one-process twins (models/pipedream.py).

    mpiexec -n 2 python -m mpi4py tests/support/mpi_progs/pipedream_twins.py DIR FLAGS...
    mpiexec -n 4 python -m mpi4py tests/support/mpi_progs/pipedream_twins.py DIR FLAGS...

Trains dtlab-sync's `train` on FLAGS with --pp 2, once per run of RUNS (plain 1F1B and
--pipedream flush, 2bw in windows of up to 3 steps without flushes, 2bw step by step
(--pipedream-window 1), stash; both 2bw runs evaluate after step 4, which ends a
window there), each writing DIR/<run>.jsonl (rank 0's metrics) and the
dense parameters its stages make up, DIR/<run>.npy; then the same 2BW steps as one list
without flushes on two weight buffers (TwoBufferedWindow): DIR/window.npy and its losses,
DIR/window-losses.npy. World rank 0 then trains, in this
process, the one-process twins on FLAGS (the dense model, the same micro-batches):

    sim.npy          models/run/simulated.py's asynchronous workers with W = 1, S = 1: each
                     gradient on the parameters before the last update, W_{t+1} = W_t -
                     lr grad f(W_{t-1}), written independently of models/pipedream.py
    stash-twin.npy   the dense replica with each stage's range of its parameters p - 1 - s
                     versions back (models/pipedream.py VersionedReplica on the ranges)

On 4 ranks it trains the two 2bw runs only, with --dp 2 (each stage's gradient averaged
over its two replicas inside the window, at each update), DIR/dp-2bw.* and
DIR/dp-2bw-steps.*.
"""

from __future__ import annotations

import os
import sys

import numpy as np
from dense_out import save_dense
from mpi4py import MPI

from dtlab.collective.train import parse_args, train
from dtlab.models.pipedream import (
    TwoBufferedWindow,
    VersionedReplica,
    WeightVersions,
    bubble_2bw,
    delay,
)
from dtlab.models.run.metrics import MetricsLog
from dtlab.models.run.session import PipelineSpec, build_session, parse
from dtlab.models.run.simulated import SimulateConfig, SimulatedWorkers
from dtlab.models.run.trainer import Trainer

RUNS = {"1f1b": [], "flush": ["--pipedream", "flush"],
        "2bw": ["--pipedream", "2bw", "--pipedream-window", "3", "--eval-every", "4"],
        "2bw-steps": ["--pipedream", "2bw", "--pipedream-window", "1", "--eval-every", "4"],
        "stash": ["--pipedream", "stash", "--grad-accum", "1"]}
out, argv = sys.argv[1], sys.argv[2:]
if MPI.COMM_WORLD.Get_size() == 4:  # dp 2 x pp 2: the windows against the steps
    for name in ("2bw", "2bw-steps"):
        setup = parse_args([*argv, "--pp", "2", "--dp", "2", *RUNS[name], "--metrics",
                            os.path.join(out, f"dp-{name}.jsonl")])
        session, grid, _ = train(setup)
        save_dense(os.path.join(out, f"dp-{name}.npy"), setup, session.params, grid)
    if grid.rank == 0:
        print("PASS pipedream dp runs", flush=True)
    sys.exit(0)
bounds = None
for name, flags in RUNS.items():
    setup = parse_args([*argv, "--pp", "2", *flags, "--metrics",
                        os.path.join(out, f"{name}.jsonl")])
    session, grid, _ = train(setup)
    save_dense(os.path.join(out, f"{name}.npy"), setup, session.params, grid)
    bounds = session.model.bounds

# the same 2BW steps as one cross-step list with two weight buffers (TwoBufferedWindow)
setup = parse_args([*argv, "--pp", "2"])
session = build_session(setup, pipeline=PipelineSpec(grid.pp_comm, "1f1b"))
steps = [session.loader.next() for _ in range(setup.run.steps)]
window = TwoBufferedWindow(session.replica, session.optimizer, session.schedule)
losses = window.run(steps)
save_dense(os.path.join(out, "window.npy"), setup, session.params, grid)
if grid.rank == 0:
    np.save(os.path.join(out, "window-losses.npy"), np.array(losses))
    m = setup.run.grad_accum
    print(f"2BW window of {len(steps)} steps, m {m}: bubble measured "
          f"{session.replica.timing['bubble']:.3f}, formula {bubble_2bw(2, m, len(steps)):.3f}",
          flush=True)

if grid.rank == 0:
    session = build_session(parse(argv, "twin"))
    SimulatedWorkers(session, MetricsLog("", {}), SimulateConfig(1, 1)).run()
    np.save(os.path.join(out, "sim.npy"), session.params.data)

    session = build_session(parse([*argv, "--grad-accum", "1"], "twin"))
    modules = session.model.body.modules
    offset = [sum(s.size for m in modules[:b] for s in m.specs()) for b in bounds]  # (p + 1,)
    p = len(bounds) - 1
    data = session.params.data
    versions = [WeightVersions(data[offset[s]:offset[s + 1]], delay("stash", p, s))
                for s in range(p)]
    session.replica = VersionedReplica(session.replica, [v.d for v in versions], versions)
    Trainer(session, MetricsLog("", {})).run()
    np.save(os.path.join(out, "stash-twin.npy"), session.params.data)
    print("PASS pipedream runs", flush=True)
