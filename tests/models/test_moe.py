"""The Mixture-of-Experts layer (models/moe.py, models/router.py) on its own.

- hand-written router logits give the expected choice, dispatch, drops and combine;
- a 1-expert MoE is the dense FFN; top-k = N without a capacity limit is the dense soft
  mixture sum_e p_e FFN_e(x);
- the whole layer, router and balancing terms included, against central finite differences
  in float64 (tests/support/gradcheck.py), for top-k with drops, dynamic k, noise, shared experts;
- router noise: training only, the same for one noise step, another for the next;
- each balancing method flattens the load of a skewed input within a short run;
- the statistics are consistent with the routing;
- bias balancing over two MPI ranks sums their loads (against the direct sum).
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from support.gradcheck import assert_grad_close, numeric_grad
from support.mpirun import mpirun

from dtlab.models.memory import _arrays
from dtlab.models.moe import MoE, dispatch, expert_ffn, moe_aux_loss
from dtlab.models.moe_stats import MoEStats
from dtlab.models.params import FlatParams
from dtlab.models.router import RouterOptions

pytestmark = pytest.mark.usefixtures("mpiexec")

D, DFF = 6, 10


def params(module, seed=0, std=0.5, dtype="float64"):
    """Every entry random (biases and the selection bias too), float64 by default."""
    P = FlatParams(module.specs(), seed=seed, dtype=dtype, xp=np)
    P.data[...] = np.random.default_rng(seed + 1).normal(0.0, std, P.size)
    return P


def rows(n, d=D, seed=3):
    return np.random.default_rng(seed).standard_normal((n, d))


# ---- hand-written logits ----

def hand_layer(logits, top_k, capacity_factor, kind="gelu"):
    """A layer whose router logits for token t are logits[t]: x = I (one token per input
    unit), Wr = logits."""
    n, N = logits.shape
    m = MoE("m", n, DFF, RouterOptions(N, top_k=top_k), kind=kind,
            capacity_factor=capacity_factor, stats=MoEStats())
    P = params(m)
    P["m.router.W"][...] = logits
    return m, P, np.eye(n)


def test_hand_written_logits_dispatch_drops_and_combine():
    logits = np.log(np.array([
        [0.5, 0.3, 0.1, 0.1],   # token 0: experts 0, 1
        [0.6, 0.1, 0.25, 0.05],  # token 1: experts 0, 2
        [0.7, 0.2, 0.06, 0.04],  # token 2: experts 0, 1
        [0.1, 0.2, 0.3, 0.4],   # token 3: experts 3, 2
    ]))
    # capacity ceil(1.0 x 8 pairs / 4) = 2: expert 0 is chosen first by tokens 0, 1, 2 and
    # keeps tokens 0 and 1; expert 1 (second choice of 0 and 2) keeps both
    m, P, x = hand_layer(logits, top_k=2, capacity_factor=1.0)
    y, ctx = m.forward(P, x)
    r = ctx["route"]
    np.testing.assert_array_equal(r["sel"], [[0, 1], [0, 2], [0, 1], [3, 2]])
    p = np.exp(logits)  # rows already sum to 1
    np.testing.assert_allclose(r["p"], p, rtol=1e-12)
    expected_gates = np.array([[0.5, 0.3], [0.6, 0.25], [0.7, 0.2], [0.4, 0.3]])
    expected_gates /= expected_gates.sum(axis=1, keepdims=True)
    np.testing.assert_allclose(r["gates"], expected_gates, rtol=1e-12)
    # slots t k + j grouped by expert, first choices before second ones, then by token:
    # e0 {t0 j0, t1 j0} (t2 j0 dropped), e1 {t0 j1, t2 j1}, e2 {t1 j1, t3 j1}, e3 {t3 j0}
    np.testing.assert_array_equal(ctx["slots"], [0, 2, 1, 5, 3, 7, 6])
    assert ctx["counts"] == [2, 2, 2, 1]
    last = m.stats.last
    np.testing.assert_array_equal(last["tokens_per_expert"], [3, 2, 2, 1])
    assert last["dropped_pairs"] == 1 and last["dropped_tokens"] == 0
    # combine: y_t = sum of g_tj FFN_e(x_t) over the kept pairs; token 2 keeps only expert 1
    ffn = [lambda v, e=e: m.experts[e].forward(P, v[None])[0][0] for e in range(4)]
    g = expected_gates
    want = np.stack([g[0, 0] * ffn[0](x[0]) + g[0, 1] * ffn[1](x[0]),
                     g[1, 0] * ffn[0](x[1]) + g[1, 1] * ffn[2](x[1]),
                     g[2, 1] * ffn[1](x[2]),
                     g[3, 0] * ffn[3](x[3]) + g[3, 1] * ffn[2](x[3])])
    np.testing.assert_allclose(y, want, rtol=1e-12, atol=1e-14)


def test_a_token_dropped_everywhere_gets_zero():
    logits = np.log(np.array([[0.9, 0.1], [0.8, 0.2], [0.7, 0.3], [0.6, 0.4]]))
    m, P, x = hand_layer(logits, top_k=1, capacity_factor=1.0)  # capacity 2 per expert
    y, ctx = m.forward(P, x)
    np.testing.assert_array_equal(ctx["slots"], [0, 1])
    assert ctx["counts"] == [2, 0]
    np.testing.assert_array_equal(y[2:], 0.0)
    assert m.stats.last["dropped_tokens"] == 2 and m.stats.last["dropped_pairs"] == 2


def test_dispatch_groups_by_expert_with_counts():
    sel = np.array([[2, 0], [2, 1], [0, 2]])
    d = dispatch(sel, None, 3, None)
    np.testing.assert_array_equal(d.counts, [2, 1, 3])
    np.testing.assert_array_equal(d.load, [2, 1, 3])
    experts = sel.reshape(-1)[d.slots]
    np.testing.assert_array_equal(experts, [0, 0, 1, 2, 2, 2])
    # dynamic k: invalid slots are never dispatched
    valid = np.array([[True, False], [True, True], [True, False]])
    d = dispatch(sel, valid, 3, None)
    np.testing.assert_array_equal(np.sort(d.slots), [0, 2, 3, 4])


def test_dynamic_k_takes_the_fewest_experts_reaching_p():
    probs = np.array([[0.7, 0.2, 0.05, 0.05], [0.4, 0.3, 0.2, 0.1], [0.35, 0.3, 0.2, 0.15]])
    m = MoE("m", 3, DFF, RouterOptions(4, dynamic_p=0.6, k_max=3), capacity_factor=None,
            stats=MoEStats())
    P = params(m)
    P["m.router.W"][...] = np.log(probs)
    _, ctx = m.forward(P, np.eye(3))
    # 0.7 reaches 0.6 alone; 0.4 + 0.3; 0.35 + 0.3
    np.testing.assert_array_equal(ctx["route"]["valid"],
                                  [[True, False, False], [True, True, False],
                                   [True, True, False]])
    np.testing.assert_allclose(ctx["route"]["gates"][1], [4 / 7, 3 / 7, 0.0])
    assert m.stats.last["experts_per_token"] == pytest.approx(5 / 3)


# ---- equivalences ----

@pytest.mark.parametrize("kind", ["gelu", "swiglu"])
def test_one_expert_is_the_dense_ffn(kind):
    dense = expert_ffn(kind, "f", D, DFF)
    m = MoE("m", D, DFF, RouterOptions(1, top_k=1), kind=kind, capacity_factor=None)
    Pd, Pm = params(dense), params(m, seed=5)
    for s in dense.specs():
        Pm["m.e0" + s.name[1:]][...] = Pd[s.name]
    x, R = rows(7).reshape(7, 1, D), rows(7, seed=4).reshape(7, 1, D)
    yd, cd = dense.forward(Pd, x)
    ym, cm = m.forward(Pm, x)
    np.testing.assert_allclose(ym, yd, rtol=1e-13, atol=1e-15)
    Pd.zero_grad()
    Pm.zero_grad()
    dxd, dxm = dense.backward(Pd, cd, R), m.backward(Pm, cm, R)
    np.testing.assert_allclose(dxm, dxd, rtol=1e-12, atol=1e-14)
    for s in dense.specs():
        np.testing.assert_allclose(Pm.grads["m.e0" + s.name[1:]], Pd.grads[s.name], rtol=1e-12)
    np.testing.assert_array_equal(Pm.grads["m.router.W"], 0.0)  # the gate is always 1


@pytest.mark.parametrize("kind", ["gelu", "swiglu"])
def test_top_n_without_capacity_is_the_soft_mixture(kind):
    N = 4
    m = MoE("m", D, DFF, RouterOptions(N, top_k=N), kind=kind, capacity_factor=None)
    P = params(m)
    x = rows(9)
    y, _ = m.forward(P, x)
    z = x @ P["m.router.W"]
    p = np.exp(z - z.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    want = sum(p[:, e:e + 1] * m.experts[e].forward(P, x)[0] for e in range(N))
    np.testing.assert_allclose(y, want, rtol=1e-12, atol=1e-14)


# ---- finite differences ----

GRAD_CASES = {
    "gelu-top2-drops-aux-gumbel-shared": dict(
        kind="gelu", capacity_factor=0.8, shared=1,
        router=RouterOptions(4, top_k=2, aux_coef=0.3, z_coef=0.05, noise="gumbel")),
    "swiglu-dynamic-jitter-bias": dict(
        kind="swiglu", capacity_factor=None,
        router=RouterOptions(4, dynamic_p=0.5, k_max=3, noise="jitter", temperature=0.5,
                             aux_coef=0.2, z_coef=0.1, bias_rate=0.05)),
    "swiglu-top1-capacity": dict(
        kind="swiglu", capacity_factor=1.0,
        router=RouterOptions(3, top_k=1, aux_coef=0.5, z_coef=0.2)),
    "gelu-top3-of-3": dict(kind="gelu", capacity_factor=None,
                           router=RouterOptions(3, top_k=3, z_coef=0.3)),
}


@pytest.mark.parametrize("case", list(GRAD_CASES))
def test_layer_gradients_match_finite_differences(case):
    """L = sum(y R) + coefficient x balancing terms; every parameter and input element."""
    m = MoE("m", D, DFF, **GRAD_CASES[case])
    P = params(m)
    x, R = rows(8).reshape(2, 4, D), rows(8, seed=9).reshape(2, 4, D)

    def loss():
        y, ctx = m.forward(P, x)
        return float((y * R).sum()) + moe_aux_loss(ctx)

    y, ctx = m.forward(P, x)
    assert ctx["moe_aux_loss"] > 0
    before, step = P.data.copy(), m.noise_step
    P.zero_grad()
    dx = m.backward(P, ctx, R)
    if m.router.opts.bias_rate:  # backward nudged the bias; differentiate at the forward's
        assert not np.array_equal(P.data, before)
    assert m.noise_step == step + 1
    P.data[...], m.noise_step = before, step
    num = numeric_grad(loss, P.data, range(P.size))
    assert np.abs(num).max() > 1e-3
    assert_grad_close(P.grad, num, f"{case}: parameter gradients")
    assert_grad_close(dx, numeric_grad(loss, x, range(x.size)), f"{case}: input gradient")


# ---- noise ----

def test_noise_in_training_only_and_seeded_by_step():
    m = MoE("m", D, DFF, RouterOptions(4, top_k=2, noise="gumbel"), capacity_factor=None)
    P, x = params(m), rows(16)
    p0 = m.forward(P, x)[1]["route"]["p"]
    np.testing.assert_array_equal(m.forward(P, x)[1]["route"]["p"], p0)  # same step
    m.noise_step += 1
    assert not np.allclose(m.forward(P, x)[1]["route"]["p"], p0)
    m.training = False
    z = x @ P["m.router.W"]
    clean = np.exp(z - z.max(axis=1, keepdims=True))
    clean /= clean.sum(axis=1, keepdims=True)
    np.testing.assert_allclose(m.forward(P, x)[1]["route"]["p"], clean, rtol=1e-12)


# ---- balancing ----

def skewed_layer(method: str, N=8):
    """Top-2 of 8 with a router that sends most tokens to experts 0 and 1."""
    opts = {"none": {}, "aux": {"aux_coef": 1.0}, "bias": {"bias_rate": 0.005}}[method]
    m = MoE("m", 16, 8, RouterOptions(N, top_k=2, **opts), capacity_factor=None,
            stats=MoEStats())
    P = FlatParams(m.specs(), seed=0, dtype="float32", xp=np)
    P["m.router.W"][...] = np.random.default_rng(0).normal(0, 0.3, (16, N))
    P["m.router.W"][:, :2] += 0.15  # x has mean 0.5: experts 0 and 1 favoured
    return m, P


@pytest.mark.parametrize("method", ["none", "aux", "bias"])
def test_balancing_flattens_a_skewed_load(method):
    m, P = skewed_layer(method)
    x = (np.random.default_rng(1).standard_normal((512, 16)) * 0.5 + 0.5).astype(np.float32)
    zero = np.zeros_like(x)  # the balancing alone acts on the router
    imbalance = []
    for _ in range(60):
        P.zero_grad()
        _, ctx = m.forward(P, x)
        imbalance.append(m.stats.last["imbalance"])
        m.backward(P, ctx, zero)
        P["m.router.W"][...] -= 0.5 * P.grads["m.router.W"]
    print(f"{method}: load imbalance (max/mean) {imbalance[0]:.2f} -> {imbalance[-1]:.2f}")
    assert imbalance[0] > 2.5
    if method == "none":
        assert imbalance[-1] == imbalance[0]
    else:
        assert imbalance[-1] < 1.3


# ---- statistics and structure ----

def test_stats_are_consistent_with_the_routing():
    stats = MoEStats()
    m = MoE("m", D, DFF, RouterOptions(5, top_k=3), capacity_factor=1.0, stats=stats)
    P = params(m)
    for seed in range(4):
        m.forward(P, rows(20, seed=seed))
    last = stats.last
    C = last["coselect"]
    np.testing.assert_array_equal(C, C.T)
    np.testing.assert_array_equal(np.diag(C), last["tokens_per_expert"])
    assert C.sum() == 20 * 3 * 3  # each token: 3 chosen, 3 x 3 ordered pairs
    assert last["tokens_per_expert"].sum() == 60
    assert last["kept_per_expert"].max() <= 12  # ceil(1.0 x 60 / 5)
    assert last["dropped_pairs"] == 60 - last["kept_per_expert"].sum()
    assert 0 < last["entropy"] <= np.log(5)
    s = stats.summary()
    assert s["forwards"] == 4
    for phase in ("router", "dispatch", "compute", "combine"):
        t = s[f"{phase}_s"]
        assert 0 < t["p50"] <= t["p95"] <= t["p99"]
    assert s["experts_per_token"] == 3.0
    assert len(s["tokens_per_expert"]) == 5 and s["imbalance"] >= 1.0


def test_experts_are_named_per_expert():
    m = MoE("h0.moe", D, DFF, RouterOptions(4, top_k=1), kind="swiglu", shared=1)
    names = [s.name for s in m.specs()]
    assert names[0] == "h0.moe.router.W"
    assert {"h0.moe.e3.w1.W", "h0.moe.e3.w3.W", "h0.moe.e3.w2.W", "h0.moe.s0.w1.W"} <= set(names)
    with pytest.raises(ValueError, match="all-to-all"):
        MoE("h0.moe", D, DFF, RouterOptions(4, top_k=1), experts=range(2, 4))


def test_float32_layer_keeps_float32():
    m = MoE("m", D, DFF, RouterOptions(4, top_k=2, aux_coef=0.1, z_coef=0.1, bias_rate=0.1,
                                       noise="gumbel"), kind="swiglu")
    P = FlatParams(m.specs(), seed=0, dtype="float32", xp=np)
    y, ctx = m.forward(P, rows(12).astype(np.float32))
    assert y.dtype == np.float32
    kinds = {a.dtype for a in _arrays(ctx)}
    assert kinds <= {np.dtype(np.float32), np.dtype(np.int64), np.dtype(bool)}, kinds
    dx = m.backward(P, ctx, np.ones_like(y))
    assert dx.dtype == np.float32 and P.grad.dtype == np.float32


# ---- bias balancing over ranks ----

BIAS_OVER_RANKS = """
import json
import numpy as np
from dtlab.collective.comm import Communicator
from dtlab.models.moe import MoE
from dtlab.models.params import FlatParams
from dtlab.models.router import RouterOptions

comm = Communicator()
opts = RouterOptions(6, top_k=2, bias_rate=0.1)

def layer(c):
    m = MoE("m", 8, 4, opts, capacity_factor=None, comm=c)
    return m, FlatParams(m.specs(), seed=0, dtype="float64", xp=np)

def data(rank):  # each rank its own rows, skewed differently
    x = np.random.default_rng(rank).standard_normal((40 + 10 * rank, 8))
    x[:, rank] += 3.0
    return x

m, P = layer(comm)
x = data(comm.rank)
y, ctx = m.forward(P, x)
m.backward(P, ctx, np.zeros_like(y))
# the same loads summed directly, in one process
local, Q = layer(None)
load = sum(local.router.load(local.forward(Q, data(r))[1]["route"]["sel"], None)
           for r in range(comm.size))
want = 0.1 * np.sign(load.mean() - load)
assert np.array_equal(P["m.router.bias"], want), (P["m.router.bias"], want)
every = comm.mpi.gather(P["m.router.bias"].tolist(), root=0)  # one line, from rank 0
if comm.rank == 0:
    print(json.dumps({"biases": every}), flush=True)
"""


def test_bias_balancing_sums_the_loads_over_ranks():
    """Two ranks with different data end with the same bias: the one the summed loads give."""
    r = mpirun(2, "-c", BIAS_OVER_RANKS, timeout=60)
    assert r.rc == 0, r
    (line,) = [line for line in r.stdout.splitlines() if line.startswith("{")]
    biases = json.loads(line)["biases"]
    assert len(biases) == 2 and biases[0] == biases[1] and any(biases[0])
