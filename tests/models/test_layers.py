"""Every layer's backward pass against central finite differences in float64.

For a layer y = f(x; θ) the scalar checked is L = sum(y * R) with a fixed
random R, so dL/dy = R is what backward receives. Every parameter and every
input element of these tiny layers is checked, for leading batch shapes
(2, 3, d) and (5, d). Tolerance: see tests/support/gradcheck.py.
"""

from __future__ import annotations

import numpy as np
import pytest
from support.gradcheck import assert_grad_close, numeric_grad

from dtlab.models.attention import CausalSelfAttention
from dtlab.models.layers import (
    GELU,
    Embedding,
    LayerNorm,
    Linear,
    Recompute,
    ReLU,
    Residual,
    RMSNorm,
    Sequential,
    SwiGLU,
)
from dtlab.models.loss import softmax_cross_entropy
from dtlab.models.params import FlatParams

D = 6
SHAPES = [(2, 3, D), (5, D)]


def make_params(module, seed=0, std=0.5):
    """float64 parameters with every entry random (no unit gains or zero biases
    that could hide a wrong term)."""
    P = FlatParams(module.specs(), seed=seed, dtype="float64", xp=np)
    P.data[...] = np.random.default_rng(seed + 1).normal(0.0, std, P.size)
    return P


def arrays(ctx):
    if isinstance(ctx, (tuple, list)):
        return [a for item in ctx for a in arrays(item)]
    return [ctx] if isinstance(ctx, np.ndarray) else []


def check_layer(module, x, P=None, check_input=True):
    """All parameter and (optionally) input gradients of `module` at `x`."""
    P = P if P is not None else make_params(module)
    y, _ = module.forward(P, x)
    R = np.random.default_rng(7).standard_normal(y.shape)
    R_before = R.copy()

    def loss():
        return float((module.forward(P, x)[0] * R).sum())

    P.zero_grad()
    x_before = x.copy()
    _, ctx = module.forward(P, x)
    ctx_before = [a.copy() for a in arrays(ctx)]
    dx = module.backward(P, ctx, R)
    np.testing.assert_array_equal(R, R_before, err_msg="backward must not modify dy")
    np.testing.assert_array_equal(x, x_before, err_msg="forward must not modify x")
    for a, b in zip(arrays(ctx), ctx_before, strict=True):
        np.testing.assert_array_equal(a, b, err_msg="backward must not modify its context")
    name = type(module).__name__
    if P.size:
        num = numeric_grad(loss, P.data, range(P.size))
        assert np.abs(num).max() > 1e-3, f"{name}: parameter gradients are all ~0"
        assert_grad_close(P.grad, num, f"{name} parameter gradients")
    if check_input:
        assert dx.shape == x.shape
        num = numeric_grad(loss, x, range(x.size))
        assert np.abs(num).max() > 1e-3, f"{name}: input gradients are all ~0"
        assert_grad_close(dx, num, f"{name} input gradient")
    return P


def rand(shape, seed=3):
    return np.random.default_rng(seed).standard_normal(shape)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("bias", [True, False])
def test_linear(shape, bias):
    check_layer(Linear("fc", D, 4, bias=bias), rand(shape))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("cls", [LayerNorm, RMSNorm])
def test_norms(shape, cls):
    check_layer(cls("ln", D), rand(shape) * 2 + 0.5)


@pytest.mark.parametrize("shape", SHAPES)
def test_gelu(shape):
    check_layer(GELU(), rand(shape) * 2)


@pytest.mark.parametrize("shape", SHAPES)
def test_relu(shape):
    x = rand(shape)
    x = np.where(x > 0, 1, -1) * np.maximum(np.abs(x), 0.1)  # away from the kink
    check_layer(ReLU(), x)


@pytest.mark.parametrize("shape", SHAPES)
def test_swiglu(shape):
    check_layer(SwiGLU("ffn", D, 5), rand(shape))


@pytest.mark.parametrize("shape", SHAPES)
def test_residual(shape):
    check_layer(Residual(Sequential([LayerNorm("ln", D), Linear("fc", D, D)])), rand(shape))


@pytest.mark.parametrize("shape", SHAPES)
def test_sequential(shape):
    check_layer(Sequential([Linear("a", D, 7), GELU(), Linear("b", 7, 3)]), rand(shape))


@pytest.mark.parametrize("shape", SHAPES)
def test_recompute(shape):
    check_layer(Recompute(Sequential([RMSNorm("n", D), SwiGLU("f", D, 4)])), rand(shape))


@pytest.mark.parametrize("shape", [(2, 5, 8), (1, 3, 8)])
def test_attention(shape):
    attn = CausalSelfAttention("attn", 8, 2)
    check_layer(attn, rand(shape), P=make_params(attn, std=0.3))  # std 0.3: softmax not saturated


@pytest.mark.parametrize("tokens_shape", [(2, 3), (5,), (2, 2, 4)])
@pytest.mark.parametrize("max_len", [None, 5])
def test_embedding(tokens_shape, max_len):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 4, size=tokens_shape)  # vocab 7, so tokens repeat
    tokens.reshape(-1)[:2] = 3  # at least one duplicate: gradients must accumulate
    emb = Embedding("wte", 7, D, max_len=max_len)
    P = check_layer(emb, tokens, check_input=False)
    unused = P.grads["wte.W"][4:]
    assert not unused.any(), "rows of tokens that never occur must get no gradient"


def test_embedding_rejects_long_sequence():
    emb = Embedding("wte", 7, D, max_len=3)
    with pytest.raises(ValueError, match="max_len"):
        emb.forward(make_params(emb), np.zeros((2, 4), dtype=np.int64))


def test_recompute_is_bit_identical():
    inner = Sequential([LayerNorm("n", D), Linear("a", D, 9), GELU(), Linear("b", 9, D)])
    x, dy = rand((2, 3, D)), rand((2, 3, D), seed=4)
    grads, dxs = [], []
    for module in (inner, Recompute(inner)):
        P = make_params(module)
        y, ctx = module.forward(P, x)
        dxs.append(module.backward(P, ctx, dy))
        grads.append(P.grad.copy())
    np.testing.assert_array_equal(grads[0], grads[1])
    np.testing.assert_array_equal(dxs[0], dxs[1])


def test_recompute_keeps_only_the_input():
    inner = Sequential([Linear("a", D, 9), GELU()])
    x = rand((5, D))
    _, ctx = Recompute(inner).forward(make_params(inner), x)
    assert ctx is x


def test_attention_is_causal():
    attn = CausalSelfAttention("attn", 8, 2)
    P = make_params(attn, std=0.3)
    x = rand((2, 6, 8))
    y0, _ = attn.forward(P, x)
    for t in range(1, 6):
        x1 = x.copy()
        x1[:, t:] += rand((2, 6 - t, 8), seed=t)
        y1, _ = attn.forward(P, x1)
        np.testing.assert_array_equal(y1[:, :t], y0[:, :t], err_msg=f"future of t={t} leaked")
        assert np.abs(y1[:, t:] - y0[:, t:]).min() > 0, "later positions must see the change"


def test_attention_rejects_indivisible_heads():
    with pytest.raises(ValueError, match="divisible"):
        CausalSelfAttention("attn", 10, 3)


def test_sequential_grad_ready_order_and_finality():
    """Offsets arrive in decreasing order and every gradient at or above one
    is final when it is reported."""
    mods = [Linear("a", D, 7), GELU(), LayerNorm("n", 7), Linear("b", 7, 4), ReLU(),
            Linear("c", 4, 3)]
    seq = Sequential(mods)
    P = make_params(seq)
    y, ctx = seq.forward(P, rand((5, D)))
    calls = []
    seq.backward(P, ctx, rand(y.shape, seed=5),
                 grad_ready=lambda off: calls.append((off, P.grad.copy())))
    offsets = [off for off, _ in calls]
    expected = [P.first_offset([s.name for s in m.specs()]) for m in mods[::-1] if m.specs()]
    assert offsets == expected
    assert offsets == sorted(offsets, reverse=True) and offsets[-1] == 0
    for off, snap in calls:
        np.testing.assert_array_equal(snap[off:], P.grad[off:], err_msg=f"offset {off}")
    first_off, first_snap = calls[0]
    assert not first_snap[:first_off].any(), "nothing below the first offset is done yet"


@pytest.mark.parametrize("shape", [(2, 3, 5), (4, 5)])
def test_cross_entropy_gradient(shape):
    logits = rand(shape) * 3
    targets = np.random.default_rng(1).integers(0, shape[-1], size=shape[:-1])
    loss, dlogits = softmax_cross_entropy(logits, targets, scale=0.5)
    z = logits.reshape(-1, shape[-1])
    ref = np.mean(np.log(np.exp(z).sum(1)) - z[np.arange(len(z)), targets.reshape(-1)])
    assert loss == pytest.approx(ref, rel=1e-12)
    num = numeric_grad(lambda: 0.5 * softmax_cross_entropy(logits, targets)[0], logits,
                       range(logits.size))
    assert_grad_close(dlogits, num, "cross-entropy dlogits")
    assert dlogits.shape == logits.shape


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_cross_entropy_is_stable_for_huge_logits(dtype):
    logits = np.array([[1e4, 0.0, -1e4], [-1e4, 1e4, 1e4 - 5]], dtype=dtype)
    targets = np.array([0, 2])
    loss, dlogits = softmax_cross_entropy(logits, targets)
    # row 0: log(1 + e^-1e4 + e^-2e4) = 0; row 1: 5 + log(1 + e^-5)
    assert loss == pytest.approx((5 + np.log1p(np.exp(-5.0))) / 2, rel=1e-6)
    assert dlogits.dtype == dtype and np.isfinite(dlogits).all()
    p1 = 1 / (1 + np.exp(-5.0))
    expected = np.array([[0, 0, 0], [0, p1, -p1]]) / 2  # (softmax - onehot) / N
    np.testing.assert_allclose(dlogits, expected, atol=1e-6)


def test_cross_entropy_rejects_mismatched_targets():
    with pytest.raises(ValueError, match="targets shape"):
        softmax_cross_entropy(np.zeros((2, 3, 4)), np.zeros((2, 4), dtype=np.int64))


@pytest.mark.parametrize("module", [Linear("fc", D, 4), LayerNorm("ln", D), RMSNorm("n", D),
                                    GELU(), ReLU(), SwiGLU("f", D, 5)])
def test_float32_stays_float32(module):
    """No silent float64 promotion from Python or NumPy scalars."""
    P = FlatParams(module.specs(), seed=0, xp=np)
    x = rand((2, 3, D)).astype(np.float32)
    y, ctx = module.forward(P, x)
    dx = module.backward(P, ctx, np.ones_like(y))
    assert y.dtype == np.float32 and dx.dtype == np.float32
    assert P.grad.dtype == np.float32


def test_float32_attention_and_loss():
    attn = CausalSelfAttention("attn", 8, 2)
    P = FlatParams(attn.specs(), seed=0, xp=np)
    y, ctx = attn.forward(P, rand((2, 4, 8)).astype(np.float32))
    assert y.dtype == np.float32
    assert attn.backward(P, ctx, np.ones_like(y)).dtype == np.float32
    _, dl = softmax_cross_entropy(y, np.zeros((2, 4), dtype=np.int64), scale=0.25)
    assert dl.dtype == np.float32
