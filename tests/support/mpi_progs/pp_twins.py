"""Pipelined (and pipelined + tensor-split) models against their dense serial twins, float64.

    mpiexec -n 2 python -m mpi4py tests/support/mpi_progs/pp_twins.py            # pp 2
    mpiexec -n 4 python -m mpi4py tests/support/mpi_progs/pp_twins.py --tp 2     # pp 2 x tp 2

The world is one pipeline of world / tp stages, each stage split over tp
ranks; the Mixture-of-Experts transformer (its balancing gradients included)
runs at tp 1. Every rank builds the dense model from the same seed, runs the same
micro-batches through it, and compares with its stage: the loss, every
gradient of the stage's parameters (rebuilt from the tp shards) and the
globally clipped gradient norm, for each schedule. Rank 0 prints one line
per (model, schedule) with the worst relative error, then "PASS pp twins".
"""

from __future__ import annotations

import argparse

import numpy as np

from dtlab.collective.grid import ProcessGrid
from dtlab.models.mlp import MLP, MLPConfig
from dtlab.models.model import Replica
from dtlab.models.params import FlatParams
from dtlab.models.partition import balance, module_costs
from dtlab.models.pipeline import PipelineReplica, PipelineStage
from dtlab.models.schedule import SCHEDULES
from dtlab.models.tensor_parallel import dense_values
from dtlab.models.transformer import Transformer, TransformerConfig

TOL = 1e-6
parser = argparse.ArgumentParser()
parser.add_argument("--tp", type=int, default=1)
parser.add_argument("--micro-batches", type=int, default=4)
opts = parser.parse_args()
from mpi4py import MPI  # noqa: E402

grid = ProcessGrid(dp=1, pp=MPI.COMM_WORLD.Get_size() // opts.tp, tp=opts.tp, timeout=60)
pp, tp = grid.pp_comm, grid.tp_comm if opts.tp > 1 else None
rng = np.random.default_rng(3)  # the same stream on every rank: the same batches


def rel(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    scale = np.abs(b).max()
    return float(np.abs(a - b).max() / scale) if scale else float(np.abs(a).max())


def twin(name: str, dense, split, batches) -> None:
    n = len(dense.body.modules)
    bounds = balance(module_costs(name.split()[0], dense.config, 2, n), pp.size)
    D = FlatParams(dense.specs(), seed=11, dtype=np.float64, xp=np)
    dense_loss = Replica(dense, D).compute_grads(batches)
    dense_norm = dense.clip_grad_norm(D, 0.0)
    for schedule in sorted(SCHEDULES):
        stage = PipelineStage(split, bounds, pp)
        S = FlatParams(stage.specs(), seed=11, dtype=np.float64, xp=np)
        loss = PipelineReplica(stage, S, schedule).compute_grads(batches)
        errors = {"loss": rel(loss, dense_loss),
                  "grad norm": rel(stage.clip_grad_norm(S, 0.0), dense_norm)}
        grads = dense_values(S, tp, grads=True) if tp is not None else \
            {k: S.grads[k] for k in S.grads}
        errors.update({f"d{k}": rel(v, D.grads[k]) for k, v in grads.items()})
        worst = max(errors, key=errors.get)
        assert errors[worst] <= TOL, f"{name} {schedule}: {worst} off by {errors[worst]:.3g}"
        if grid.rank == 0:
            print(f"{name:28s} {schedule:6s} pp={pp.size} tp={opts.tp} bounds={bounds} "
                  f"worst {worst:18s} {errors[worst]:.2e}", flush=True)


m = opts.micro_batches
MOE = {"moe_experts": 4, "moe_top_k": 2, "moe_every": 2, "moe_dropless": True}
for ffn, norm, moe in (("gelu", "layernorm", {}), ("swiglu", "rmsnorm", {}),
                       ("swiglu", "layernorm", MOE)):
    if moe and tp is not None:
        continue  # MoE layers are not tensor-split yet
    c = TransformerConfig(vocab=16, seq_len=6, d_model=16, n_heads=4, n_layers=3, d_ff=32,
                          ffn=ffn, norm=norm, **moe)
    batches = [(rng.integers(0, c.vocab, (2, c.seq_len)), rng.integers(0, c.vocab, (2, c.seq_len)))
               for _ in range(m)]
    twin(f"transformer {ffn} {norm}{' moe' if moe else ''}", Transformer(c),
         Transformer(c, tp=tp), batches)

c = MLPConfig(d_in=8, d_hidden=16, n_layers=3, n_classes=4)
batches = [(rng.standard_normal((3, c.d_in)), rng.integers(0, c.n_classes, 3)) for _ in range(m)]
twin("mlp", MLP(c), MLP(c, tp=tp), batches)
if grid.rank == 0:
    print("PASS pp twins", flush=True)
