"""models/_fused.c against the array lines of models/optim.py: bit for bit.

Every optimizer and option, float32 and float64, lengths around the vector
widths, several steps with changing lr; the twin runs with the kernels
switched off (models.optim._fused = None), as on a machine without them.
"""

from __future__ import annotations

import numpy as np
import pytest

import dtlab.models.optim as optim
from dtlab.models.config import build
from dtlab.models.optim import OptimConfig, make_optimizer

fused = pytest.importorskip("dtlab.models._fused")

SETTINGS = [
    {"optimizer": "sgd"},
    {"optimizer": "sgd", "weight_decay": 0.1},
    {"optimizer": "sgd", "momentum": 0.9},
    {"optimizer": "sgd", "momentum": 0.9, "nesterov": True, "weight_decay": 0.01},
    {"optimizer": "adam"},
    {"optimizer": "adam", "weight_decay": 0.1},
    {"optimizer": "adamw", "weight_decay": 0.1, "beta2": 0.999},
]
LENGTHS = [1, 7, 8, 9, 1000, 4099]


def _run(settings: dict, dtype, n: int, kernels: bool, monkeypatch, strided: bool = False):
    """Parameters and state after 4 steps, from the same seeded start; `strided`
    gradients are every other element of a longer array."""
    monkeypatch.setattr(optim, "_fused", fused if kernels else None)
    rng = np.random.default_rng(n)
    p = rng.standard_normal(n).astype(dtype)
    mask = (np.arange(n) % 3 != 0).astype(dtype)
    cfg = build(OptimConfig, {"lr": 0.05, "warmup": 0, **settings})
    opt = make_optimizer(cfg, p, decay_mask=mask)
    for step in range(4):
        g = (rng.standard_normal(2 * n) * 10.0 ** (step - 2)).astype(dtype)
        opt.step(p, g[::2] if strided else g[:n], lr=0.05 / (step + 1))
    return p, opt.state_dict()


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda s: "-".join(f"{k}={v}" for k, v
                                                                        in s.items()))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_fused_update_is_bit_identical_to_the_array_lines(settings, dtype, monkeypatch):
    for n in LENGTHS:
        p_c, state_c = _run(settings, dtype, n, True, monkeypatch)
        p_np, state_np = _run(settings, dtype, n, False, monkeypatch)
        assert p_c.dtype == dtype
        np.testing.assert_array_equal(p_c, p_np, err_msg=f"n={n}")
        for name, value in state_np.items():
            np.testing.assert_array_equal(state_c[name], value, err_msg=f"{name}, n={n}")


def test_strided_gradients_take_the_array_lines(monkeypatch):
    settings = {"optimizer": "adam"}
    p_c, _ = _run(settings, np.float32, 100, True, monkeypatch, strided=True)
    p_np, _ = _run(settings, np.float32, 100, False, monkeypatch, strided=True)
    np.testing.assert_array_equal(p_c, p_np)


def test_kernels_refuse_mismatched_buffers():
    p = np.zeros(8, np.float32)
    with pytest.raises(ValueError, match="float32 or float64 of one length"):
        fused.sgd(p, np.zeros(7, np.float32), 0.1)
    with pytest.raises(ValueError, match="float32 or float64"):
        fused.sgd(p, np.zeros(8, np.float64), 0.1)
    with pytest.raises(ValueError, match="float32 or float64"):
        fused.sgd(np.zeros(8, np.int32), np.zeros(8, np.int32), 0.1)
    with pytest.raises(ValueError, match="not C-contiguous"):
        fused.sgd(np.zeros(16, np.float32)[::2], p, 0.1)
    frozen = np.zeros(8, np.float32)
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        fused.sgd(frozen, p, 0.1)
    fused.sgd(p, frozen, 0.1)  # the gradient is only read


class _Threads:
    num_threads = 3


@pytest.mark.parametrize("settings", SETTINGS[::2], ids=lambda s: "-".join(
    f"{k}={v}" for k, v in s.items()))
def test_updates_spread_over_threads_are_bit_identical(settings, monkeypatch):
    """A long buffer's update in blocks on three threads (layers.in_blocks) against the
    array lines."""
    import dtlab.models.layers as layers

    monkeypatch.setattr(layers, "numpy_blas", _Threads)
    monkeypatch.setattr(optim, "THREAD_BLOCK", 1000)  # 4099: three blocks
    p_c, state_c = _run(settings, np.float32, 4099, True, monkeypatch)
    p_np, state_np = _run(settings, np.float32, 4099, False, monkeypatch)
    np.testing.assert_array_equal(p_c, p_np)
    for name, value in state_np.items():
        np.testing.assert_array_equal(state_c[name], value, err_msg=name)
