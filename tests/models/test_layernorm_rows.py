"""LayerNorm's rows in C (models/_fused.c norm_forward / norm_backward) against the array
lines of models/layers.py, bit for bit, at widths where NumPy's pairwise summation splits a
row (over 128) and where it does not; and its row sums against NumPy's own."""

from __future__ import annotations

import numpy as np
import pytest

from dtlab.models import layers
from dtlab.models.layers import LayerNorm
from dtlab.models.params import FlatParams

fused = pytest.importorskip("dtlab.models._fused")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("d", [3, 8, 129, 300, 1000])
def test_layernorm_rows_are_bit_identical_to_the_array_lines(dtype, d, monkeypatch):
    norm = LayerNorm("n", d)
    P = FlatParams(norm.specs(), seed=0, dtype=dtype, xp=np)
    rng = np.random.default_rng(d)
    P.data[...] = rng.standard_normal(P.data.shape)
    x = (rng.standard_normal((5, d)) * 3 + 1).astype(dtype)
    x[0] = 0.0  # a constant row: variance 0, rstd 1 / sqrt(eps)
    dy = rng.standard_normal((5, d)).astype(dtype)
    out = {}
    for kernels in (True, False):
        monkeypatch.setattr(layers, "_fused", fused if kernels else None)
        y, (xhat, rstd) = norm.forward(P, x)
        P.zero_grad()
        dx = norm.backward(P, (xhat, rstd), dy)
        out[kernels] = (y, xhat, rstd, dx, P.grad.copy())
    for a, b in zip(out[True], out[False], strict=True):
        assert a.dtype == dtype
        np.testing.assert_array_equal(a, b)


def test_layernorm_rows_use_numpys_mean():
    """The kernel's mean is np.mean's to the bit (its centred rows are x - np.mean(x))."""
    d = 777
    x = (np.random.default_rng(0).standard_normal((4, d)) * 5 + 2).astype(np.float32)
    y, xhat, rstd = np.empty_like(x), np.empty_like(x), np.empty((4, 1), np.float32)
    ones, zeros = np.ones(d, np.float32), np.zeros(d, np.float32)
    fused.norm_forward(y, xhat, rstd, x, ones, zeros, 1e-5)
    centred = x - x.mean(axis=-1, keepdims=True)
    var = (centred * centred).sum(axis=-1, keepdims=True) / np.float32(d) + np.float32(1e-5)
    np.testing.assert_array_equal(rstd, 1.0 / np.sqrt(var))
    np.testing.assert_array_equal(xhat, centred * rstd)
