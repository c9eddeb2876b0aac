"""Delayed Nesterov (Liu et al. 2024; models.outer.DelayedNesterov, --outer-optimizer
delayed-nesterov --outer-period N): at N = 1 it is plain Nesterov bit for bit; at N > 1 a
small case computed by hand in dyadic numbers (exact in floats); a real shard running it
equals the optimizer stepped in one process on the same outer gradients."""

from __future__ import annotations

import numpy as np
import pytest
from support.pserver_util import addresses, connect, initial_params, serve

from dtlab.models.config import ConfigError, build
from dtlab.models.optim import SGD
from dtlab.models.outer import DelayedNesterov, OuterConfig, make_outer
from dtlab.pserver.common.config import ServerConfig


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_period_1_is_nesterov_bit_for_bit(dtype):
    rng = np.random.default_rng(0)
    start = rng.standard_normal(1000).astype(dtype)
    dn_p, sgd_p = start.copy(), start.copy()
    dn = make_outer(build(OuterConfig, {"outer_optimizer": "delayed-nesterov", "outer_lr": 0.7,
                                        "outer_momentum": 0.9}), dn_p)
    nesterov = SGD(sgd_p, 0.7, 0.9, nesterov=True)
    assert isinstance(dn, DelayedNesterov) and dn.period == 1
    for _ in range(6):
        g = rng.standard_normal(1000).astype(dtype)
        dn.step(dn_p, g)
        nesterov.step(sgd_p, g)
        np.testing.assert_array_equal(dn_p, sgd_p)
        np.testing.assert_array_equal(dn.velocity, nesterov.velocity)


def test_period_2_by_hand():
    """L = 0.5, M = 0.5, N = 2, theta_0 = (1, 1); outer gradients (1, 0), (2, 0), (4, 0),
    (-2, 8). Element 0:
        t=1  Delta 1                    theta 1 - 0.5 * 1/2                 =  0.75
        t=2  Delta 3,  v 0 + 3/2 = 1.5  theta 0.75 - 0.5 (0.5*1.5 + 2/2)     = -0.125
        t=3  Delta 4                    theta -0.125 - 0.5 * 4/2             = -1.125
        t=4  Delta 2,  v 0.75 + 1 = 1.75 theta -1.125 - 0.5 (0.875 - 1)      = -1.0625
    element 1: unmoved until t=4: Delta 8, v 4, theta 1 - 0.5 (0.5*4 + 8/2) = -2."""
    theta = np.ones(2)
    dn = DelayedNesterov(theta, 0.5, 0.5, period=2)
    grads = [(1, 0), (2, 0), (4, 0), (-2, 8)]
    want_theta = [(0.75, 1), (-0.125, 1), (-1.125, 1), (-1.0625, -2)]
    want_v = [(0, 0), (1.5, 0), (1.5, 0), (1.75, 4)]
    want_buffer = [(1, 0), (0, 0), (4, 0), (0, 0)]
    for g, th, v, buf in zip(grads, want_theta, want_v, want_buffer, strict=True):
        dn.step(theta, np.asarray(g, np.float64))
        assert theta.tolist() == list(th)
        assert dn.velocity.tolist() == list(v) and dn.buffer.tolist() == list(buf)
    state = dn.state_dict()
    again = DelayedNesterov(np.zeros(2), 0.5, 0.5, period=2)
    again.load_state_dict(state)
    assert again.steps == 4 and again.velocity.tolist() == [1.75, 4]


def test_a_shard_running_it_equals_the_optimizer_in_one_process():
    """One client pushes outer gradients to two float64 shards with --outer-period 3: the
    servers' parameters are a DelayedNesterov's stepped on the same gradients."""
    params = initial_params(dtype="float64")
    twin = params.data.copy()
    dn = DelayedNesterov(twin, 0.7, 0.9, period=3)
    rng = np.random.default_rng(1)
    with serve(shards=2, dtype="float64", outer_optimizer="delayed-nesterov", outer_lr=0.7,
               outer_momentum=0.9, outer_period=3) as daemons:
        c = connect(addresses(daemons), 0, params)
        try:
            flat = np.empty(params.size, np.float64)
            c.pull(flat)
            for step in range(7):
                g = rng.standard_normal(params.size)
                c.push_pull(g, step, flat)
                dn.step(twin, g)
                np.testing.assert_array_equal(flat, twin)
            assert c.server.optim_config and '"nesterov": true' in c.server.optim_config
        finally:
            c.close()


def test_its_flags_are_checked():
    with pytest.raises(ConfigError, match="--outer-period 2 needs --outer-optimizer "
                                          "delayed-nesterov"):
        build(ServerConfig, {"outer_optimizer": "nesterov", "outer_momentum": 0.9,
                             "outer_period": 2}).validate()
    with pytest.raises(ConfigError, match="delayed-nesterov needs --outer-momentum > 0"):
        build(ServerConfig, {"outer_optimizer": "delayed-nesterov", "outer_period": 2})
    with pytest.raises(ConfigError, match="--outer-period must be positive|outer_period"):
        build(ServerConfig, {"outer_optimizer": "delayed-nesterov", "outer_momentum": 0.9,
                             "outer_period": 0})


def test_a_shard_saved_mid_period_resumes_where_it_was(tmp_path):
    """Saved after 4 outer gradients of period 3 (one into a period: the buffer Delta
    holds it, the velocity the first period's), resumed, and pushed 4 more: the shard
    equals a DelayedNesterov stepped on all 8 without a stop."""
    params = initial_params(dtype="float64")
    twin = params.data.copy()
    dn = DelayedNesterov(twin, 0.7, 0.9, period=3)
    grads = [np.random.default_rng(10 + i).standard_normal(params.size) for i in range(8)]
    run = {"dtype": "float64", "outer_optimizer": "delayed-nesterov", "outer_lr": 0.7,
           "outer_momentum": 0.9, "outer_period": 3, "checkpoint_dir": str(tmp_path / "ck")}
    flat = np.empty(params.size, np.float64)
    for part, resume in ((range(4), False), (range(4, 8), True)):
        with serve(shards=1, resume=resume, **run) as daemons:
            c = connect(addresses(daemons), 0, params)
            try:
                c.pull(flat)
                for step in part:
                    c.push_pull(grads[step], step, flat)
                    dn.step(twin, grads[step])
                    np.testing.assert_array_equal(flat, twin)
                if not resume:
                    c.shards[0].save_checkpoint()
            finally:
                c.close()
