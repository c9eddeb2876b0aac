"""Expert-parallel MoE layers and transformers against their single-process twins, float64.

    mpiexec -n 2 python -m mpi4py tests/support/mpi_progs/moe_ep_twins.py

The world is the ep group. Every rank draws the same inputs for all e ranks (e n rows) and
builds the single-process twin: every expert, `groups` e (capacity and Switch term per
rank's rows, models/moe.py). Rank r runs the ep layer (its experts only) on rows
[r n, (r + 1) n) for its own objective J_r (the output's product with dy_r, plus its
balancing terms); the twin's objective is their mean (1/e) sum_r J_r, the mean of the
ranks' losses that data-parallel training minimises. Compared within TOL, relative to the
largest entry:

    outputs of rank r, and its dx / e        = the twin's rows of rank r
    gradients of rank r's experts / e        = the twin's (the trainer averages expert
                                               gradients over dp and divides by ep)
    dense gradients averaged over the ranks  = the twin's (router, shared experts, norms...)
    balancing terms' mean over the ranks     = the twin's; the selection bias = the twin's
    transformer loss averaged over the ranks = the twin's; the global gradient norm too

for drops and dropless, top-1/top-2/dynamic k, GELU and SwiGLU experts, one and three
overlap chunks, our all-to-all (pairwise, and posted at once) and MPI's; and the three
exchanges against the blocks sent. Rank 0 prints one line per case with the worst
relative error, then "PASS moe ep twins <e>".
"""

from __future__ import annotations

import numpy as np

from dtlab.collective import world
from dtlab.models.moe import MoE
from dtlab.models.moe_ep import ExpertParallel
from dtlab.models.params import FlatParams
from dtlab.models.router import RouterOptions
from dtlab.models.transformer import Transformer, TransformerConfig

TOL = 1e-6
comm = world(timeout=60)
E, R = comm.size, comm.rank
D, DFF, ROWS = 8, 12, 24  # ROWS per rank


def rel(a, b) -> float:
    """max |a - b| / max |b| (0 when both are zero)."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    scale = np.abs(b).max()
    return float(np.abs(a - b).max() / scale) if scale else float(np.abs(a).max())


def summed(x):
    return comm.allreduce(np.array(x, dtype=np.float64))


def report(name: str, errors: dict[str, float]) -> None:
    worst = max(errors, key=errors.get)
    assert errors[worst] <= TOL, f"{name} ep={E}: {worst} off by {errors[worst]:.3g} > {TOL}"
    if R == 0:
        print(f"{name:<44} worst {worst:<22} {errors[worst]:.2e}", flush=True)


def random_params(P, seed: int) -> None:
    """Every entry random and the same on every rank for one name (whatever the layout)."""
    for spec in P.specs:
        rng = np.random.default_rng([seed, sum(map(ord, spec.name))])
        P[spec.name][...] = rng.normal(0.0, 0.5, spec.shape)


def average_grads(P) -> None:
    """What the trainer does: dense gradients averaged over the ranks, experts' divided by
    e (their sum over the ranks' tokens is already here)."""
    for spec in P.specs:
        g = P.grads[spec.name]
        g[...] = g / E if spec.split == "ep" else summed(g) / E


def compare_grads(P, T, errors: dict) -> None:
    for spec in P.specs:
        errors[f"grad {spec.name}"] = rel(P.grads[spec.name], T.grads[spec.name])


def layer_case(name: str, opts: RouterOptions, factor, kind="gelu", chunks=1, algo="ours",
               shared=0) -> None:
    exchange = {"ours": None, "mpi": comm.mpi_alltoallv,
                "posted": lambda *a, **k: comm.ialltoallv(*a, **k).wait()}[algo]
    twin = MoE("m", D, DFF, opts, kind=kind, capacity_factor=factor, shared=shared,
               groups=E)
    ep = ExpertParallel(comm, alltoallv=exchange, chunks=chunks, loads=comm, group=R)
    layer = MoE("m", D, DFF, opts, kind=kind, capacity_factor=factor, shared=shared, ep=ep)
    T = FlatParams(twin.specs(), dtype="float64")
    P = FlatParams(layer.specs(), dtype="float64")
    random_params(T, 1)
    random_params(P, 1)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((E * ROWS, D))
    dy = rng.standard_normal((E * ROWS, D))
    mine = slice(R * ROWS, (R + 1) * ROWS)
    yt, ct = twin.forward(T, x)
    y, c = layer.forward(P, x[mine].copy())
    dxt = twin.backward(T, ct, dy / E)
    dx = layer.backward(P, c, dy[mine].copy())
    drops = int(comm.mpi.allreduce(len(c["slots"]))) < E * ROWS * opts.slots
    errors = {"output": rel(y, yt[mine]), "dx": rel(dx / E, dxt[mine]),
              "aux loss": abs(float(summed([layer.last_aux_loss])[0]) / E
                              - twin.last_aux_loss)}
    owned = {s.name for s in P.specs if s.split == "ep"}
    held = {int(n.split(".e")[1].split(".")[0]) for n in owned}
    assert held == set(ep.owned(opts.n_experts)), (held, ep.owned(opts.n_experts))
    average_grads(P)
    compare_grads(P, T, errors)
    if opts.bias_rate:
        errors["bias"] = rel(P["m.router.bias"], T["m.router.bias"])
    if factor is not None:
        assert drops or E == 1, f"{name}: the case should drop pairs"
    report(f"layer {name}", errors)


def model_case(name: str, chunks: int, **moe) -> None:
    c = TransformerConfig(vocab=16, seq_len=6, d_model=8, n_heads=2, n_layers=2, d_ff=12,
                          moe_experts=4 if E <= 4 else E, **moe)
    twin = Transformer(c)
    for m in twin.moe:
        m.groups = E
    model = Transformer(c, ep=ExpertParallel(comm, chunks=chunks, loads=comm, group=R))
    T, P = twin.init_params(seed=3, dtype="float64"), model.init_params(seed=3,
                                                                          dtype="float64")
    for spec in P.specs:  # same initial values whatever the layout
        assert np.array_equal(P[spec.name], T[spec.name]), spec.name
    experts = [s.split == "ep" for s in P.specs]
    assert experts == sorted(experts), "experts must come after the dense parameters"
    rng = np.random.default_rng(9)
    B = 2
    tokens = rng.integers(0, c.vocab, (E * B, c.seq_len))
    targets = rng.integers(0, c.vocab, (E * B, c.seq_len))
    mine = slice(R * B, (R + 1) * B)
    lt, ct = twin.forward(T, (tokens, targets), scale=1.0)
    twin.backward(T, ct)
    loss, ctx = model.forward(P, (tokens[mine], targets[mine]), scale=1.0)
    model.backward(P, ctx)
    aux_t = sum(m.last_aux_loss for m in twin.moe)
    aux = sum(m.last_aux_loss for m in model.moe)
    errors = {"loss": abs(float(summed([loss])[0]) / E - lt),
              "aux loss": abs(float(summed([aux])[0]) / E - aux_t)}
    average_grads(P)
    compare_grads(P, T, errors)
    # the clipping norm counts the dense gradients once and every rank's experts
    norm = model.clip_grad_norm(P, 0.0)
    errors["grad norm"] = rel(norm, twin.clip_grad_norm(T, 0.0))
    report(f"transformer {name}", errors)


def exchange_case() -> None:
    """ialltoallv (posted at once) and MPI's against the pairwise alltoallv and the blocks
    sent, with uneven counts including zeros."""
    counts = [(R + 2 * d) % 3 for d in range(E)]  # rows from R to d
    x = np.arange(sum(counts) * 3, dtype=np.float64).reshape(-1, 3) + 1000 * R  # (A, 3)
    want, got = comm.alltoallv(x, counts)
    posted, posted_counts = comm.ialltoallv(x, counts).wait()
    mpi, mpi_counts = comm.mpi_alltoallv(x, counts)
    assert got == posted_counts == mpi_counts == [(s + 2 * R) % 3 for s in range(E)]
    lo = 0
    for s in range(E):  # rank s's block for R: its rows after those for ranks < R
        block = want[lo:lo + got[s]]
        before = sum((s + 2 * d) % 3 for d in range(R))
        expect = np.arange(before * 3, (before + got[s]) * 3).reshape(-1, 3) + 1000 * s
        assert np.array_equal(block, expect), (s, block, expect)
        lo += got[s]
    assert np.array_equal(posted, want) and np.array_equal(mpi, want)
    if R == 0:
        print("exchanges: pairwise, posted and MPI's equal the blocks sent", flush=True)


exchange_case()
top2 = RouterOptions(4 if E <= 4 else E, top_k=2, aux_coef=0.1, z_coef=0.01)
layer_case("top-2 gelu dropless", top2, None)
layer_case("top-2 gelu drops 0.8", top2, 0.8)
layer_case("top-2 swiglu drops 0.8 chunks 3", top2, 0.8, kind="swiglu", chunks=3)
layer_case("top-2 gelu dropless mpi chunks 2", top2, None, algo="mpi", chunks=2)
layer_case("top-2 gelu drops 0.8 posted chunks 2", top2, 0.8, algo="posted", chunks=2)
layer_case("top-1 drops 1.0 bias shared", RouterOptions(top2.n_experts, top_k=1, aux_coef=0.1,
                                                        bias_rate=0.01), 1.0, shared=1)
layer_case("dynamic-p drops 0.9 noise", RouterOptions(top2.n_experts, top_k=1, dynamic_p=0.6,
                                                      k_max=3, noise="gumbel", aux_coef=0.1),
           0.9)
model_case("dropless", chunks=1, moe_dropless=True)
model_case("drops 1.0 chunks 2", chunks=2, moe_capacity_factor=1.0)
if R == 0:
    print(f"PASS moe ep twins {E}", flush=True)
