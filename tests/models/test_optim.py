"""Optimizers against direct transcriptions of their published update rules."""

import math

import numpy as np
import pytest

from dtlab.models.config import ConfigError, build
from dtlab.models.optim import (
    SGD,
    Adam,
    AdamW,
    OptimConfig,
    Schedule,
    clip_grad_norm,
    make_optimizer,
)

rng = np.random.default_rng(0)


def _grads(n_steps, size):
    return [rng.standard_normal(size) for _ in range(n_steps)]


def reference_sgd(p, grads, lr, mu, nesterov, wd, mask):
    p, v = p.copy(), np.zeros_like(p)
    for g in grads:
        g = g + wd * p * mask
        v = mu * v + g
        p = p - lr * ((g + mu * v) if nesterov else v)
    return p


def reference_adam(p, grads, lr, b1, b2, eps, wd, mask, decoupled):
    p, m, v = p.copy(), np.zeros_like(p), np.zeros_like(p)
    for t, g in enumerate(grads, start=1):
        if decoupled:
            p = p - lr * wd * p * mask
        else:
            g = g + wd * p * mask
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        mhat, vhat = m / (1 - b1**t), v / (1 - b2**t)
        p = p - lr * mhat / (np.sqrt(vhat) + eps)
    return p


@pytest.mark.parametrize("mu,nesterov,wd",
                         [(0.0, False, 0.0), (0.9, False, 0.1), (0.9, True, 0.01)])
def test_sgd_matches_reference(mu, nesterov, wd):
    p0, grads = rng.standard_normal(37), _grads(5, 37)
    mask = (np.arange(37) % 3 != 0).astype(float)
    opt = SGD(p0, lr=0.1, momentum=mu, nesterov=nesterov, weight_decay=wd, decay_mask=mask)
    p = p0.copy()
    for g in grads:
        opt.step(p, g.copy())
    np.testing.assert_allclose(p, reference_sgd(p0, grads, 0.1, mu, nesterov, wd, mask), rtol=1e-12)


@pytest.mark.parametrize("cls,decoupled", [(Adam, False), (AdamW, True)])
def test_adam_matches_reference(cls, decoupled):
    p0, grads = rng.standard_normal(41), _grads(6, 41)
    mask = (np.arange(41) % 2).astype(float)
    opt = cls(p0, lr=0.01, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.1, decay_mask=mask)
    p = p0.copy()
    for g in grads:
        opt.step(p, g.copy())
    ref = reference_adam(p0, grads, 0.01, 0.9, 0.99, 1e-8, 0.1, mask, decoupled)
    np.testing.assert_allclose(p, ref, rtol=1e-10, atol=1e-12)


def test_state_dict_round_trip_continues_identically():
    cfg = build(OptimConfig, {"optimizer": "adamw", "weight_decay": 0.1})
    p0, grads = rng.standard_normal(16).astype(np.float32), _grads(6, 16)
    a, pa = make_optimizer(cfg, p0), p0.copy()
    for g in grads[:3]:
        a.step(pa, g.astype(np.float32))
    b, pb = make_optimizer(cfg, p0), pa.copy()
    b.load_state_dict({k: np.copy(v) for k, v in a.state_dict().items()})
    for g in grads[3:]:
        a.step(pa, g.astype(np.float32))
        b.step(pb, g.astype(np.float32))
    np.testing.assert_array_equal(pa, pb)


def test_load_state_dict_rejects_wrong_shape():
    opt = Adam(np.zeros(4), lr=0.1)
    with pytest.raises(ValueError, match="optimizer state m"):
        opt.load_state_dict({"m": np.zeros(5), "v": np.zeros(4), "steps": 1})


def test_clip_grad_norm():
    g = np.array([3.0, 4.0])
    assert clip_grad_norm(g, 10.0) == pytest.approx(5.0)
    np.testing.assert_array_equal(g, [3.0, 4.0])
    assert clip_grad_norm(g, 1.0) == pytest.approx(5.0)
    assert math.hypot(*g) == pytest.approx(1.0, rel=1e-5)
    assert clip_grad_norm(g, 0.0) == pytest.approx(1.0, rel=1e-5)  # 0 disables


def test_schedule_warmup_then_cosine_to_floor():
    cfg = build(OptimConfig, {"lr": 1.0, "warmup": 10, "min_lr_ratio": 0.1})
    sched = Schedule(cfg, total_steps=110)
    assert sched(0) == pytest.approx(0.1)
    assert sched(9) == pytest.approx(1.0)
    assert sched(10) == pytest.approx(1.0)
    assert sched(60) == pytest.approx(0.55)
    assert sched(110) == pytest.approx(0.1)
    lrs = [sched(t) for t in range(10, 111)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:], strict=False))
    const = Schedule(build(OptimConfig, {"lr": 0.5, "warmup": 0, "schedule": "constant"}), 10)
    assert {const(t) for t in range(10)} == {0.5}


@pytest.mark.parametrize("values,flag", [
    ({"lr": 0.0}, "--lr"),
    ({"beta2": 1.0}, "--beta2"),
    ({"nesterov": True}, "--nesterov"),
    ({"warmup": -1}, "--warmup"),
    ({"optimizer": "lion"}, "--optimizer"),
    ({"lr": "fast"}, "--lr"),
])
def test_bad_optimizer_config_names_the_flag(values, flag):
    with pytest.raises(ConfigError, match=flag):
        build(OptimConfig, values)
