"""The outer optimizer of local SGD / DiLoCo (models/outer.py): against plain training where
the two must agree bit for bit (one replica, H = 1, outer SGD lr 1; anything in dyadic
arithmetic), against a hand-written loop of the published updates, and the exact extent
of the round trip theta - (theta - theta_1) in floating point."""

import numpy as np
import pytest

from dtlab.models.config import ConfigError, build
from dtlab.models.data import DataConfig, ShardedLoader, make_dataset
from dtlab.models.model import Replica
from dtlab.models.optim import SGD, OptimConfig, Schedule, make_optimizer
from dtlab.models.outer import LocalSGD, OuterConfig, make_outer, outer_gradient, round_ends
from dtlab.models.zoo import build_model, config_class


def outer(kind: str, lr: float = 1.0, momentum: float = 0.0) -> OuterConfig:
    return build(OuterConfig, {"outer_optimizer": kind, "outer_lr": lr,
                               "outer_momentum": momentum})


def quadratic_grad(theta, target):
    """The gradient of 1/2 |theta - target|^2: integer-valued at integer points."""
    return theta - target  # (n,)


def local_sgd(theta0, targets, rounds, H, inner_lr, cfg):
    """R = len(targets) replicas, one after another: H inner SGD steps each from the global
    parameters, then the outer step on their mean change (the twin of a parallel run)."""
    local = LocalSGD(theta0.copy(), make_outer(cfg, theta0))
    inner = [SGD(theta0, inner_lr) for _ in targets]
    for _ in range(rounds):
        total = np.zeros_like(theta0)
        for opt, target in zip(inner, targets, strict=True):
            theta = local.anchor.copy()
            for _ in range(H):
                opt.step(theta, quadratic_grad(theta, target))
            total += local.outer_gradient(theta)
        local.delta[...] = total / len(targets)
        local.step(np.empty_like(theta0))
    return local.anchor


@pytest.mark.parametrize("replicas, H", [(4, 1), (1, 5)])
def test_local_sgd_with_outer_sgd_lr_1_is_plain_sgd_bit_for_bit_in_dyadic_arithmetic(
        replicas, H):
    """H = 1 and R replicas: synchronous SGD on the mean gradient; R = 1 and H steps: plain
    SGD for H x rounds steps. Integer points, lr 1/2 and R a power of two keep every value
    dyadic, where the round trip is exact (models/outer.py, Exactness)."""
    rng = np.random.default_rng(0)
    n, rounds, lr = 257, 6, 0.5
    theta0 = rng.integers(-50, 50, n).astype(np.float64)
    targets = [rng.integers(-50, 50, n).astype(np.float64) for _ in range(replicas)]
    got = local_sgd(theta0, targets, rounds, H, lr, outer("sgd"))
    want, plain = theta0.copy(), SGD(theta0, lr)
    for _ in range(rounds * H):
        plain.step(want, np.mean([quadratic_grad(want, t) for t in targets], axis=0))
    np.testing.assert_array_equal(got, want)
    assert np.any(got != np.round(got))  # not trivially integer: the halvings are in there


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_one_subtraction_round_trips_exactly_and_two_need_not(dtype):
    """b = fl(a - x) for floats a, x: fl(a - fl(a - b)) == b, over 80 binades of both; after
    a second subtraction it fails for some (models/outer.py, Exactness)."""
    rng = np.random.default_rng(1)
    n = 200_000
    a, x, y = (rng.standard_normal((3, n)) * 2.0 ** rng.integers(-40, 40, (3, n))).astype(dtype)
    b = a - x
    np.testing.assert_array_equal(a - (a - b), b)
    c = b - y
    assert np.count_nonzero(a - (a - c) != c) > 100


@pytest.mark.parametrize("inner", [
    {"optimizer": "adam", "lr": 1e-2},
    {"optimizer": "sgd", "lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 1e-3},
])
def test_one_replica_h_1_outer_sgd_lr_1_is_plain_training_bit_for_bit(inner):
    """A real model in float32: every step's round trip through the outer gradient gives
    the inner step's parameters back exactly."""
    cfg = build(config_class("mlp"), {"d_in": 4, "d_hidden": 16, "n_layers": 1,
                                      "n_classes": 3})
    dataset, cfg = make_dataset(DataConfig(), "mlp", cfg)
    model = build_model("mlp", cfg)
    ocfg = build(OptimConfig, {"warmup": 2, "clip": 0.0, **inner})
    runs = []
    for local_sgd_on in (False, True):
        params = model.init_params(seed=0, dtype="float32", xp=np)
        replica, schedule = Replica(model, params), Schedule(ocfg, 10)
        opt = make_optimizer(ocfg, params.data, decay_mask=params.decay_mask())
        loader = ShardedLoader(dataset, 8, seed=0)
        local = LocalSGD(params.data, make_outer(outer("sgd"), params.data))
        for step in range(10):
            replica.compute_grads(loader.next())
            opt.step(params.data, params.grad, schedule(step))
            if local_sgd_on:
                local.outer_gradient(params.data)
                local.step(params.data)
        runs.append(params.data.copy())
    np.testing.assert_array_equal(runs[1], runs[0])
    assert not np.array_equal(runs[0], model.init_params(seed=0, xp=np).data)


def test_nesterov_outer_step_against_a_hand_written_loop():
    """DiLoCo's outer Nesterov (L 0.7, M 0.9) in float32, element by element as written:
    v <- M v + Delta; theta <- theta - L (Delta + M v)."""
    rng = np.random.default_rng(2)
    n, rounds, L, M = 33, 7, 0.7, 0.9
    theta0 = rng.standard_normal(n).astype(np.float32)
    locals_ = [theta0 + rng.standard_normal(n).astype(np.float32) * 0.1 for _ in range(rounds)]
    local = LocalSGD(theta0, make_outer(outer("nesterov", L, M), theta0))
    for theta_r in locals_:
        local.outer_gradient(theta_r)
        local.step(np.empty_like(theta0))
    want, v = theta0.copy(), np.zeros(n, np.float32)
    f32 = np.float32
    for theta_r in locals_:
        for i in range(n):
            d = want[i] - theta_r[i]
            v[i] = f32(M) * v[i] + d
            want[i] = want[i] - f32(L) * (d + f32(M) * v[i])
    np.testing.assert_array_equal(local.anchor, want)
    np.testing.assert_array_equal(local.outer.velocity, v)


def test_heavy_ball_outer_sgd_and_the_outer_gradient():
    rng = np.random.default_rng(3)
    theta, theta_r = rng.standard_normal((2, 9))
    np.testing.assert_array_equal(outer_gradient(theta, theta_r), theta - theta_r)
    local = LocalSGD(theta, make_outer(outer("sgd", 0.5, 0.5), theta))
    params = theta_r.copy()
    for _ in range(2):
        local.outer_gradient(params)
        local.step(params)
        np.testing.assert_array_equal(params, local.anchor)  # the replica starts from it
    d1 = theta - theta_r  # v = d1, then v = d1 / 2 + d2 with d2 = 0 (params == anchor)
    np.testing.assert_array_equal(local.anchor, theta - 0.5 * d1 - 0.5 * (0.5 * d1))


def test_a_resumed_local_sgd_continues_bit_for_bit():
    rng = np.random.default_rng(4)
    theta = rng.standard_normal(17).astype(np.float32)
    deltas = rng.standard_normal((6, 17)).astype(np.float32)
    cfg = outer("nesterov", 0.7, 0.9)
    a = LocalSGD(theta, make_outer(cfg, theta))
    for k, d in enumerate(deltas):
        if k == 3:
            state = {k: v.copy() if hasattr(v, "copy") else v for k, v in a.state_dict().items()}
            b = LocalSGD(np.zeros_like(theta), make_outer(cfg, theta))
            b.load_state_dict(state)
        for x in (a, b) if k >= 3 else (a,):
            x.delta[...] = d
            x.step(np.empty_like(theta))
    np.testing.assert_array_equal(a.anchor, b.anchor)
    with pytest.raises(ValueError, match="anchor"):
        b.load_state_dict({**state, "anchor": np.zeros(3, np.float32)})


def test_round_ends_and_bad_configs_are_named():
    assert [s for s in range(7) if round_ends(s, 3, 7)] == [2, 5, 6]
    o = outer("nesterov", 0.7, 0.9).as_optim()
    assert (o.optimizer, o.lr, o.momentum, o.nesterov, o.warmup, o.schedule) == \
           ("sgd", 0.7, 0.9, True, 0, "constant")
    for values, message in [({"outer_optimizer": "nesterov"}, "--outer-momentum > 0"),
                            ({"outer_optimizer": "sgd", "outer_lr": 0.0}, "--outer-lr"),
                            ({"outer_optimizer": "sgd", "outer_momentum": 1.0}, r"\[0, 1\)"),
                            ({"outer_lr": 0.7}, "need --outer-optimizer")]:
        with pytest.raises(ConfigError, match=message):
            build(OuterConfig, values)
    with pytest.raises(ConfigError, match="no outer optimizer"):
        OuterConfig().as_optim()
