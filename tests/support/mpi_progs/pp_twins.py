"""Pipelined (and pipelined + tensor-split) models against their dense serial twins, float64.

    mpiexec -n 2 python -m mpi4py tests/support/mpi_progs/pp_twins.py            # pp 2
    mpiexec -n 4 python -m mpi4py tests/support/mpi_progs/pp_twins.py --tp 2     # pp 2 x tp 2

The world is one pipeline of world / tp stages, each stage split over tp
ranks; the Mixture-of-Experts transformer (its balancing gradients included)
runs at tp 1. Every rank builds the dense model from the same seed, runs the same
micro-batches through it, and compares with its stage: the loss, every
gradient of the stage's parameters (rebuilt from the tp shards) and the
globally clipped gradient norm, for each schedule (interleaved 1F1B, ZB-V and
DualPipeV with 2 chunks per rank where the model has 2p modules; DualPipeV where
there are 2p micro-batches, so at pp 4 on a deeper MLP). At tp 1 every schedule but
GPipe (whose backwards run the micro-batches in reverse) accumulates each
gradient in the dense order: loss and gradients equal bit for bit (the norm
sums the stages' squares in another order). Rank 0 prints one line per
(model, schedule) with the worst relative error, then "PASS pp twins".
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
from dtlab.models.schedule import SCHEDULES, chunks, layout, make
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
    costs = module_costs(name.split()[0], dense.config, 2, n)
    D = FlatParams(dense.specs(), seed=11, dtype=np.float64, xp=np)
    dense_loss = Replica(dense, D).compute_grads(batches)
    dense_norm = dense.clip_grad_norm(D, 0.0)
    for schedule in sorted(SCHEDULES):
        n_stages = pp.size * chunks(schedule)
        try:
            make(schedule, pp.size, len(batches))
            short = f"{n_stages} stages, the model has {n} modules" if n_stages > n else ""
        except ValueError as e:
            short = str(e)
        if short:
            if grid.rank == 0:
                print(f"{name:28s} {schedule:11s} pp={pp.size}: {short}; skipped", flush=True)
            continue
        bounds = balance(costs, n_stages)
        stage = PipelineStage(split, bounds, pp, layout(schedule))
        S = FlatParams(stage.specs(), seed=11, dtype=np.float64, xp=np)
        loss = PipelineReplica(stage, S, schedule).compute_grads(batches)
        errors = {"loss": rel(loss, dense_loss),
                  "grad norm": rel(stage.clip_grad_norm(S, 0.0), dense_norm)}
        grads = dense_values(S, tp, grads=True) if tp is not None else \
            {k: S.grads[k] for k in S.grads}
        errors.update({f"d{k}": rel(v, D.grads[k]) for k, v in grads.items()})
        worst = max(errors, key=errors.get)
        assert errors[worst] <= TOL, f"{name} {schedule}: {worst} off by {errors[worst]:.3g}"
        if tp is None and schedule != "gpipe":  # micro-batches accumulate in the dense order
            inexact = [k for k, e in errors.items() if e and k != "grad norm"]
            assert not inexact, f"{name} {schedule}: not bit for bit in {inexact}"
        if grid.rank == 0:
            print(f"{name:28s} {schedule:11s} pp={pp.size} tp={opts.tp} bounds={bounds} "
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
if pp.size * 2 > 2 * c.n_layers + 1:  # the two-chunk schedules need 2p modules,
    c = MLPConfig(d_in=8, d_hidden=16, n_layers=pp.size, n_classes=4)  # DualPipeV m >= 2p
    batches = [(rng.standard_normal((3, c.d_in)), rng.integers(0, c.n_classes, 3))
               for _ in range(max(m, 2 * pp.size))]
    twin("mlp deep", MLP(c), MLP(c, tp=tp), batches)
if grid.rank == 0:
    print("PASS pp twins", flush=True)
