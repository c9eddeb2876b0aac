"""Tensor-split ranks agree on skipping an overflowed mixed-precision step.

    mpiexec -n 2 python -m mpi4py tests/support/mpi_progs/precision_agree.py

The world is the tensor-parallel group of a split MLP under --precision fp16.
An overflow need not reach every shard (an activation gradient's inf spreads
through the split layers' all-reduces, a weight gradient's stays in its
shard): here the last rank's half gradient gets one inf after backward,
the others' stay finite, and yet every rank's finish_grads says skip, so the
shards never step apart. Without it every rank steps. Rank 0 prints
"PASS precision agree <size>".
"""

from __future__ import annotations

import numpy as np

from dtlab.collective import world
from dtlab.models.mlp import MLP, MLPConfig
from dtlab.models.precision import LossScaler, MixedReplica, finite

comm = world(timeout=60)
N, R = comm.size, comm.rank
model = MLP(MLPConfig(d_in=6, d_hidden=8, n_layers=2, n_classes=4), tp=comm)
rng = np.random.default_rng(3)  # the same batch on every rank
batch = (rng.standard_normal((16, 6)).astype(np.float32), rng.integers(0, 4, 16))

for overflow in (True, False):
    replica = MixedReplica(model, model.init_params(0), "fp16", LossScaler(scale=1024.0))
    replica.compute_grads([batch])
    assert finite(replica.work.grad.astype(np.float32)), f"rank {R}: an overflow at 1024"
    if overflow and R == N - 1:
        replica.work.grad[-1] = np.inf  # this shard's weight gradient overflowed
    ok, record = replica.finish_grads()
    assert ok is not overflow and record["skipped"] is overflow, (R, ok, record)
    assert replica.scaler.scale == (512.0 if overflow else 1024.0)
if R == 0:
    print(f"PASS precision agree {N}")
