"""The speed paths of the layers against their plain formulation, bit for bit.

GELU's polynomial passes and LayerNorm's elementwise passes in C (models/_fused.c)
against the array lines of models/layers.py, as on a machine without the kernels; attention
computed chunk by
chunk of heads on several threads (models/attention.py over_heads) against one batched
call over the whole (batch, heads) stack.
"""

from __future__ import annotations

import numpy as np
import pytest

from dtlab.models import attention, layers
from dtlab.models.attention import CausalSelfAttention, head_chunks
from dtlab.models.layers import GELU, LayerNorm
from dtlab.models.params import FlatParams

fused = pytest.importorskip("dtlab.models._fused")


def run(module, P, x, dy):
    y, ctx = module.forward(P, x)
    P.zero_grad()
    dx = module.backward(P, ctx, dy)
    return y, dx, P.grad.copy()


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(3, 5, 7), (1000,), (2, 0, 4)])
def test_gelu_kernels_are_bit_identical_to_the_array_lines(dtype, shape, monkeypatch):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(shape) * 4).astype(dtype)  # both tails of tanh
    x.reshape(-1)[:3] = [0.0, -0.0, 30.0][: x.size]
    dy = rng.standard_normal(shape).astype(dtype)
    out = {}
    for kernels in (True, False):
        monkeypatch.setattr(layers, "_fused", fused if kernels else None)
        y, ctx = GELU().forward(None, x)
        out[kernels] = (y, *ctx, GELU().backward(None, ctx, dy))
    for a, b in zip(out[True], out[False], strict=True):
        assert a.dtype == dtype
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(3, 5, 7), (4, 16), (0, 7)])
def test_layernorm_kernels_are_bit_identical_to_the_array_lines(dtype, shape, monkeypatch):
    norm = LayerNorm("n", shape[-1])
    P = FlatParams(norm.specs(), seed=0, dtype=dtype, xp=np)
    rng = np.random.default_rng(2)
    P.data[...] = rng.standard_normal(P.data.shape)  # gain and bias away from 1 and 0
    x = (rng.standard_normal(shape) * 3 + 1).astype(dtype)
    dy = rng.standard_normal(shape).astype(dtype)
    out = {}
    for kernels in (True, False):
        monkeypatch.setattr(layers, "_fused", fused if kernels else None)
        y, (xhat, rstd) = norm.forward(P, x)
        out[kernels] = (y, xhat, rstd, *run(norm, P, x, dy))
    for a, b in zip(out[True], out[False], strict=True):
        assert a.dtype == dtype
        np.testing.assert_array_equal(a, b)


def test_norm_kernels_refuse_mismatched_buffers():
    m, r, c = np.zeros((4, 3), np.float32), np.zeros((4, 1), np.float32), np.zeros(3, np.float32)
    with pytest.raises(ValueError, match="rows x columns"):
        fused.norm_forward(m, m.copy(), np.zeros(5, np.float32), m.copy(), c, c, 1e-5)
    with pytest.raises(ValueError, match="float32 or float64"):
        fused.norm_backward(m, m.copy(), m, m, r, c.astype(np.float64))
    fused.norm_backward(m, m.copy(), m, m, r, c)


def test_gelu_takes_the_array_lines_for_strided_input(monkeypatch):
    x = np.linspace(-3, 3, 24, dtype=np.float32).reshape(4, 6)[:, ::2]  # not contiguous
    y, _ = GELU().forward(None, x)
    monkeypatch.setattr(layers, "_fused", None)
    np.testing.assert_array_equal(y, GELU().forward(None, x)[0])


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize("B, T, heads", [(3, 16, 4), (1, 32, 6), (4, 8, 2)])
def test_attention_by_chunks_of_heads_is_bit_identical(B, T, heads, recompute, monkeypatch):
    d = 8 * heads
    attn = CausalSelfAttention("a", d, heads, recompute_scores=recompute)
    P = FlatParams(attn.specs(), seed=0, xp=np)
    P.data[...] *= 10  # std 0.2: the softmax is not flat
    rng = np.random.default_rng(1)
    x = rng.standard_normal((B, T, d)).astype(np.float32)
    dy = rng.standard_normal((B, T, d)).astype(np.float32)
    whole = []

    def one_call(xp, chunk, *_):  # the whole (B, heads) stack in one batched call
        whole.append(True)
        chunk((slice(None), slice(None)))

    monkeypatch.setattr(attention, "over_heads", one_call)
    expected = run(attn, P, x, dy)
    assert whole
    monkeypatch.undo()
    # chunks of one head or one batch row, on two threads
    monkeypatch.setattr(attention, "SCORES_PER_CHUNK", T * T)
    monkeypatch.setattr(attention, "SCORES_PER_THREAD", 1)
    assert len(head_chunks(B, heads, T, 2)) == B * heads
    for got, want in zip(run(attn, P, x, dy), expected, strict=True):
        np.testing.assert_array_equal(got, want)


def test_head_chunks_cover_every_head_once():
    for B, nh, T, n in [(8, 8, 128, 2), (1, 16, 256, 2), (3, 5, 64, 4), (2, 1, 1024, 2)]:
        seen = np.zeros((B, nh), int)
        chunks = head_chunks(B, nh, T, n)
        for b, h in chunks:
            seen[b, h] += 1
        assert (seen == 1).all(), (B, nh, T, n)
        assert len(chunks) >= min(n, B * nh)


class _Threads:
    num_threads = 3


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_passes_spread_over_threads_are_bit_identical(dtype, monkeypatch):
    """GELU's and LayerNorm's passes in blocks on three threads (layers.in_blocks)
    against the array lines: bit for bit."""
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((7, 9, 37)) * 3).astype(dtype)  # 63 rows, 2331 elements
    dy = rng.standard_normal(x.shape).astype(dtype)
    norm = LayerNorm("n", x.shape[-1])
    P = FlatParams(norm.specs(), seed=0, dtype=dtype, xp=np)
    P.data[...] = rng.standard_normal(P.data.shape)
    out = {}
    for kernels in (True, False):
        monkeypatch.setattr(layers, "_fused", fused if kernels else None)
        monkeypatch.setattr(layers, "numpy_blas", _Threads)
        monkeypatch.setattr(layers, "THREAD_BLOCK", 100)  # 3 blocks, of unequal rows
        y, ctx = GELU().forward(None, x)
        out[kernels] = (y, *ctx, GELU().backward(None, ctx, dy), *run(norm, P, x, dy))
    for a, b in zip(out[True], out[False], strict=True):
        np.testing.assert_array_equal(a, b)


def test_embedding_rows_add_is_bit_identical_to_add_at(monkeypatch):
    """The embedding's gradient scatter in C (rows_add) against ufunc.at: repeated and
    negative tokens, a gradient that is not zero first."""
    emb = layers.Embedding("e", 11, 6, max_len=8)
    P = FlatParams(emb.specs(), seed=0, xp=np)
    rng = np.random.default_rng(3)
    tokens = rng.integers(-11, 11, size=(5, 8))
    tokens[0, :4] = 2  # one token four times
    dy = rng.standard_normal((5, 8, 6)).astype(np.float32)
    start = rng.standard_normal(P.grad.shape).astype(np.float32)  # earlier micro-batches'
    grads = {}
    for kernels in (True, False):
        monkeypatch.setattr(layers, "_fused", fused if kernels else None)
        P.grad[...] = start
        emb.backward(P, tokens, dy)
        grads[kernels] = P.grad.copy()
    assert not np.array_equal(grads[True], start)
    np.testing.assert_array_equal(grads[True], grads[False])
    with pytest.raises(IndexError, match="out of bounds"):
        fused.rows_add(np.zeros((3, 2), np.float32), np.array([0, 3], np.intp),
                       np.zeros((2, 2), np.float32))


def test_cross_entropy_by_blocks_of_rows_is_bit_identical(monkeypatch):
    """The loss's row passes in blocks on three threads against one block on one thread."""
    from dtlab.models import loss

    rng = np.random.default_rng(4)
    logits = (rng.standard_normal((4, 33, 50)) * 5).astype(np.float32)
    targets = rng.integers(0, 50, size=(4, 33))
    one = loss.softmax_cross_entropy(logits, targets, 0.5)
    monkeypatch.setattr(layers, "numpy_blas", _Threads)
    monkeypatch.setattr(loss, "THREAD_BLOCK", 200)  # 132 rows: three blocks
    blocks = loss.softmax_cross_entropy(logits, targets, 0.5)
    assert blocks[0] == one[0]
    np.testing.assert_array_equal(blocks[1], one[1])


def test_linear_bias_by_blocks_of_rows_is_bit_identical(monkeypatch):
    lin = layers.Linear("l", 37, 29)
    P = FlatParams(lin.specs(), seed=0, xp=np)
    P.data[...] = np.random.default_rng(6).standard_normal(P.data.shape)
    x = np.random.default_rng(7).standard_normal((5, 13, 37)).astype(np.float32)
    one, _ = lin.forward(P, x)
    monkeypatch.setattr(layers, "numpy_blas", _Threads)
    monkeypatch.setattr(layers, "THREAD_BLOCK", 500)  # 65 rows of 29: three blocks
    blocks, _ = lin.forward(P, x)
    np.testing.assert_array_equal(blocks, one)
