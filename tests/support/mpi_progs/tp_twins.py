"""Tensor-split layers and models against their dense serial twins, in float64.

    mpiexec -n 2 python -m mpi4py tests/support/mpi_progs/tp_twins.py

The world is the tensor-parallel group (size 1 included: a real
communicator). Every rank builds the dense twin from the same seed and the
same inputs, runs the split layer on its shard, and compares: the split
parameters rebuilt (dense_values) equal the dense ones exactly; outputs,
losses and every gradient (rebuilt from the shards) within the stated
tolerance. Rank 0 prints one line per twin with the worst relative error,
then "PASS tp twins <size>".
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from dtlab.collective import world
from dtlab.models.attention import CausalSelfAttention
from dtlab.models.comm import Comm
from dtlab.models.layers import Embedding, Linear, SwiGLU
from dtlab.models.loss import softmax_cross_entropy
from dtlab.models.mlp import MLP, MLPConfig
from dtlab.models.params import FlatParams
from dtlab.models.tensor_parallel import (
    SPLIT,
    ColumnParallelLinear,
    ParallelSwiGLU,
    RowParallelLinear,
    VocabParallelCrossEntropy,
    VocabParallelEmbedding,
    dense_values,
)
from dtlab.models.transformer import Transformer, TransformerConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/
from support.gradcheck import numeric_grad

TOL = 1e-6
comm = world(timeout=60)
assert isinstance(comm, Comm), "collective.comm.Communicator is not a models.comm.Comm"
N, R = comm.size, comm.rank
rng = np.random.default_rng(7)  # the same stream on every rank: the same inputs


def rel(a, b) -> float:
    """max |a - b| / max |b| (0 when both are zero)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    scale = np.abs(b).max()
    return float(np.abs(a - b).max() / scale) if scale else float(np.abs(a).max())


def report(name: str, errors: dict[str, float], tol: float = TOL) -> None:
    worst = max(errors, key=errors.get)
    assert errors[worst] <= tol, f"{name} tp={N}: {worst} off by {errors[worst]:.3g} > {tol}"
    if R == 0:
        print(f"{name:32s} tp={N}  worst {worst:22s} {errors[worst]:.2e}")


def pair(dense_module, split_module):
    """(dense FlatParams, split FlatParams), same seed, float64; the split ones
    rebuilt must equal the dense ones exactly."""
    D = FlatParams(dense_module.specs(), seed=5, dtype=np.float64, xp=np)
    S = FlatParams(split_module.specs(), seed=5, dtype=np.float64, xp=np)
    rebuilt = dense_values(S, comm)
    for name, value in rebuilt.items():
        assert np.array_equal(value, D[name]), f"initial {name} differs from its dense twin"
    return D, S


def grad_errors(D, S) -> dict[str, float]:
    return {f"d{k}": rel(v, D.grads[k]) for k, v in dense_values(S, comm, grads=True).items()}


def columns(y, lo, hi, groups=1):
    """Columns [lo, hi) of each of `groups` blocks of y's last axis."""
    blocks = y.reshape(*y.shape[:-1], groups, -1)[..., lo:hi]
    return blocks.reshape(*y.shape[:-1], -1)


def column_twin(groups: int) -> None:
    d_in, d_out = 6, 12 * groups
    dense = Linear("c", d_in, d_out)
    split = ColumnParallelLinear("c", d_in, d_out, comm, groups=groups)
    D, S = pair(dense, split)
    D["c.b"][:] = rng.standard_normal(d_out)
    S.load(np.concatenate([columns(D[s.name], split.lo, split.hi, groups).ravel()
                           for s in S.specs]))
    x = rng.standard_normal((3, 4, d_in))
    dy = rng.standard_normal((3, 4, d_out))
    y, ctx = dense.forward(D, x)
    ys, ctxs = split.forward(S, x)
    assert np.array_equal(ys, columns(y, split.lo, split.hi, groups)), "column split output"
    dx = dense.backward(D, ctx, dy)
    dxs = split.backward(S, ctxs, np.ascontiguousarray(columns(dy, split.lo, split.hi, groups)))
    report(f"ColumnParallelLinear groups={groups}", {"y": 0.0, "dx": rel(dxs, dx),
                                                     **grad_errors(D, S)})


def row_twin() -> None:
    d_in, d_out = 12, 5
    dense, split = Linear("r", d_in, d_out), RowParallelLinear("r", d_in, d_out, comm)
    D, S = pair(dense, split)
    x = rng.standard_normal((3, 4, d_in))
    dy = rng.standard_normal((3, 4, d_out))
    y, ctx = dense.forward(D, x)
    ys, ctxs = split.forward(S, np.ascontiguousarray(x[..., split.lo:split.hi]))
    dx = dense.backward(D, ctx, dy)
    dxs = split.backward(S, ctxs, dy)
    report("RowParallelLinear", {"y": rel(ys, y), "dx": rel(dxs, dx[..., split.lo:split.hi]),
                                 **grad_errors(D, S)})


def embedding_twin() -> None:
    vocab, d, T = 16, 6, 5
    dense = Embedding("e", vocab, d, max_len=T)
    split = VocabParallelEmbedding("e", vocab, d, comm, max_len=T)
    D, S = pair(dense, split)
    tokens = rng.integers(0, vocab, size=(3, T))
    tokens[0, :3] = 1  # repeated tokens accumulate
    dy = rng.standard_normal((3, T, d))
    y, ctx = dense.forward(D, tokens)
    ys, ctxs = split.forward(S, tokens)
    assert np.array_equal(ys, y), "embedding output"
    dense.backward(D, ctx, dy)
    split.backward(S, ctxs, dy)
    report("VocabParallelEmbedding", {"y": 0.0, **grad_errors(D, S)})


def cross_entropy_twin() -> None:
    vocab = 24
    ce = VocabParallelCrossEntropy(comm, vocab)
    logits = rng.standard_normal((3, 5, vocab)) * 4
    logits[0, 0, 3] = 300.0  # the max on one rank only: no overflow anywhere
    targets = rng.integers(0, vocab, size=(3, 5))
    loss, dz = softmax_cross_entropy(logits, targets, scale=0.5)
    loss_s, dz_s = ce(np.ascontiguousarray(logits[..., ce.lo:ce.hi]), targets, scale=0.5)
    full = comm.allgather(np.ascontiguousarray(np.moveaxis(dz_s, -1, 0)))  # (vocab, 3, 5)
    report("VocabParallelCrossEntropy", {"loss": rel(loss_s, loss),
                                         "dlogits": rel(np.moveaxis(full, 0, -1), dz)})


def module_twin(name: str, dense, split, x, dy_shape) -> None:
    """A module whose input and output are whole on every rank."""
    D, S = pair(dense, split)
    dy = rng.standard_normal(dy_shape)
    y, ctx = dense.forward(D, x)
    ys, ctxs = split.forward(S, x)
    dx = dense.backward(D, ctx, dy)
    dxs = split.backward(S, ctxs, dy)
    report(name, {"y": rel(ys, y), "dx": rel(dxs, dx), **grad_errors(D, S)})


def model_twin(name: str, dense, split, batch) -> None:
    """Loss and every gradient of a whole model; then the global gradient norm."""
    D = dense.init_params(seed=5, dtype="float64", xp=np)
    S = split.init_params(seed=5, dtype="float64", xp=np)
    for k, v in dense_values(S, comm).items():
        assert np.array_equal(v, D[k]), f"{name}: initial {k} differs from its dense twin"
    loss = dense.loss_and_grad(D, batch, scale=1.0)
    loss_s = split.loss_and_grad(S, batch, scale=1.0)
    norm = dense.clip_grad_norm(D, 0.0)
    norm_s = split.clip_grad_norm(S, 0.0)
    report(name, {"loss": rel(loss_s, loss), "grad norm": rel(norm_s, norm),
                  **grad_errors(D, S)})


def finite_differences(name: str, model, batch, per_rank: int = 4) -> None:
    """Analytic gradients of the split model against central differences at a few
    offsets of each rank's buffer. Every rank runs each forward (it is collective);
    a shard is perturbed on its own rank, a replicated tensor on every rank."""
    P = model.init_params(seed=5, dtype="float64", xp=np)
    model.loss_and_grad(P, batch)
    split = np.zeros(P.size, dtype=bool)
    for lo, hi in P.ranges(SPLIT):
        split[lo:hi] = True
    picks = np.random.default_rng(R).choice(P.size, size=per_rank, replace=False)
    worst = 0.0
    for owner in range(N):
        for i in comm.broadcast(picks.copy(), root=owner).tolist():
            mine = R == owner or not split[i]
            num = numeric_grad(lambda: model.forward(P, batch)[0],
                               P.data if mine else np.zeros(1), [i if mine else 0])[0]
            if R == owner:
                ana = P.grad[i]
                assert abs(ana - num) <= 1e-8 + 1e-6 * abs(num), (
                    f"{name}: offset {i}: finite differences {num} vs analytic {ana}")
                worst = max(worst, abs(ana - num))
    worst = comm.allgather(np.array([worst])).max()
    report(f"{name} finite diff", {"abs err": float(worst)}, tol=1e-7)


def main() -> None:
    column_twin(1)
    column_twin(3)
    row_twin()
    embedding_twin()
    cross_entropy_twin()
    d, T, h, d_ff = 8, 5, 4, 16
    x = rng.standard_normal((2, T, d))
    module_twin("ParallelSwiGLU", SwiGLU("s", d, d_ff), ParallelSwiGLU("s", d, d_ff, comm), x,
                (2, T, d))
    module_twin("attention (heads split)", CausalSelfAttention("a", d, h),
                CausalSelfAttention("a", d, h, tp=comm), x, (2, T, d))
    tokens = rng.integers(0, 16, size=(2, T + 1))
    lm_batch = (tokens[:, :-1], tokens[:, 1:])
    for ffn, norm in (("gelu", "layernorm"), ("swiglu", "rmsnorm")):
        for recompute in (False, True):
            c = TransformerConfig(vocab=16, seq_len=T, d_model=d, n_heads=h, n_layers=2,
                                  d_ff=d_ff, ffn=ffn, norm=norm, recompute=recompute)
            model_twin(f"transformer {ffn} {norm}{' recompute' * recompute}", Transformer(c),
                       Transformer(c, tp=comm), lm_batch)
    xs = rng.standard_normal((6, 5))
    ys = rng.integers(0, 8, size=6)
    for layers in (0, 1, 2, 3):
        c = MLPConfig(d_in=5, d_hidden=8, n_layers=layers, n_classes=8)
        model_twin(f"mlp n_layers={layers}", MLP(c), MLP(c, tp=comm), (xs, ys))
    c = TransformerConfig(vocab=8, seq_len=3, d_model=4, n_heads=4, n_layers=1, d_ff=8,
                          ffn="swiglu")
    finite_differences("transformer swiglu", Transformer(c, tp=comm),
                       (tokens[:, :3] % 8, tokens[:, 1:4] % 8))
    c = MLPConfig(d_in=5, d_hidden=8, n_layers=2, n_classes=8)
    finite_differences("mlp n_layers=2", MLP(c, tp=comm), (xs, ys))
    if R == 0:
        print(f"PASS tp twins {N}")


main()
