"""The compressed exchange (collective/reducers/compress.py) carries exactly what the ranks'
error-feedback residuals do not hold.

    mpiexec -n 3 python -m mpi4py tests/support/mpi_progs/compress_check.py

For --compress topk:0.25 and randk:0.25, three steps on a tiny MLP's gradient layout, each
rank's gradient integer-valued and its own (so every sum is exact): with p_r the rank's
gradient plus its residual before the step and e_r the residual after, every rank ends
with (sum_r (p_r - e_r)) / W, the sum in rank order, bit for bit; sent_bytes is (W - 1)
payloads of k float32 values and int32 indices on every rank (top-k), or, summed over
the ranks, 2 (W - 1) k values (random-k: our ring's all-reduce). An assertion failing
ends the job (python -m mpi4py).
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from dtlab.collective.comm import Communicator
from dtlab.collective.reducers.compress import CompressReducer
from dtlab.models.compress import CompressConfig
from dtlab.models.mlp import MLPConfig
from dtlab.models.zoo import build_model

comm = Communicator(MPI.COMM_WORLD, name="check")
W, rank = comm.size, comm.rank
model = build_model("mlp", MLPConfig(d_in=5, d_hidden=6, n_layers=1, n_classes=3))
params = model.init_params(seed=0)
n = params.size
for kind in ("topk:0.25", "randk:0.25"):
    grad = np.zeros(n, np.float32)  # (n,)
    reducer = CompressReducer(comm, grad, CompressConfig(kind), params, seed=7)
    residual = reducer.c.residual
    rng = np.random.default_rng([rank, 1])
    for step in range(3):
        grad[...] = rng.integers(-50, 50, n)
        p = grad + residual  # (n,) what this rank offers: exact, small integers
        record = reducer.wait()
        sent_part = MPI.COMM_WORLD.allgather(p - residual)  # [W] (n,) each rank's sent part
        total = np.zeros(n, np.float32)
        for part in sent_part:
            total += part
        assert np.array_equal(grad, total / W), (kind, step, rank)
        k = reducer.c.k
        sent = MPI.COMM_WORLD.allgather(record["sent_bytes"])  # [W]
        if kind.startswith("topk"):
            assert np.count_nonzero(sent_part[rank]) <= k  # the k largest |p|, nothing else
            # the ring all-gather: every rank passes on W - 1 payloads of k float32 + int32
            assert sent == [(W - 1) * k * 8] * W, (kind, sent, k)
        else:
            # the ring all-reduce of k values: each of them sent 2 (W - 1) times in all
            assert sum(sent) == 2 * (W - 1) * k * 4, (kind, sent, k)
        assert record["comm_rounds"] == 1
    reducer.close()
    if rank == 0:
        print(f"{kind}: the exchange is exactly what the residuals do not hold on {W} ranks")
