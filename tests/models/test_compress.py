"""Gradient compressors with error feedback (models/compress.py): the residual holds what
was not sent, full top-k / random-k send everything bit for bit, full-rank PowerSGD
reproduces the (mean) gradient, its warm start converges to the best rank-R
approximation, and every payload's bytes."""

import math

import numpy as np
import pytest

from dtlab.models.compress import (
    CompressConfig,
    PowerSGD,
    RandK,
    Sign,
    TopK,
    make_compressor,
    matrix_layout,
)
from dtlab.models.config import ConfigError, build
from dtlab.models.data import DataConfig, ShardedLoader, make_dataset
from dtlab.models.model import Replica
from dtlab.models.optim import SGD
from dtlab.models.zoo import build_model, config_class

U32 = np.finfo(np.float32).eps / 2  # unit roundoff


def grads(steps: int, n: int, seed: int = 0, dtype=np.float32) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(n).astype(dtype) for _ in range(steps)]


@pytest.mark.parametrize("make", [lambda n: TopK(n, 0.1), lambda n: RandK(n, 0.1, seed=3)])
def test_sparse_residual_holds_exactly_what_was_not_sent(make):
    n = 1001
    c = make(n)
    for g in grads(5, n):
        before = c.residual.copy()
        payload = c.compress(g)
        sent = c.decompress(payload)
        np.testing.assert_array_equal(c.residual + sent, g + before)
        k = math.ceil(0.1 * n)
        assert np.count_nonzero(sent) == k  # ... and sends k elements
        assert payload.nbytes == (k * 8 if isinstance(c, TopK) else k * 4 + 8)


def test_top_k_sends_the_largest_corrected_elements():
    n = 500
    c = TopK(n, 0.02)
    g0, g1 = grads(2, n, seed=1)
    c.compress(g0)
    p = g1 + c.residual
    payload = c.compress(g1)
    want = np.sort(np.argsort(-np.abs(p), kind="stable")[:10])
    np.testing.assert_array_equal(payload.indices, want)
    np.testing.assert_array_equal(payload.values, p[want])


def test_random_k_replicas_with_one_seed_draw_the_same_indices_and_decode_each_other():
    n = 300
    a, b = RandK(n, 0.05, seed=7), RandK(n, 0.05, seed=7)
    ga, gb = grads(2, n, seed=2)
    pa = a.compress(ga)
    b.compress(gb)
    np.testing.assert_array_equal(a.indices(0), b.indices(0))
    np.testing.assert_array_equal(b.decompress(pa), a.decompress(pa))
    assert not np.array_equal(a.indices(0), a.indices(1))  # a fresh draw every step
    assert not np.array_equal(a.indices(0), RandK(n, 0.05, seed=8).indices(0))


@pytest.mark.parametrize("spec_", ["topk:1", "randk:1"])
def test_full_sparse_compression_is_uncompressed_training_bit_for_bit(spec_):
    """A real model, 6 SGD steps: the decompressed gradient is the gradient itself and the
    residual stays zero, so the parameters are plain training's exactly."""
    cfg = build(config_class("mlp"), {"d_in": 4, "d_hidden": 16, "n_layers": 1,
                                      "n_classes": 3})
    dataset, cfg = make_dataset(DataConfig(), "mlp", cfg)
    model = build_model("mlp", cfg)
    runs = []
    for on in (False, True):
        params = model.init_params(seed=0, xp=np)
        replica, opt = Replica(model, params), SGD(params.data, 0.1)
        loader = ShardedLoader(dataset, 8, seed=0)
        c = make_compressor(build(CompressConfig, {"compress": spec_}), params.size, seed=1)
        for _ in range(6):
            replica.compute_grads(loader.next())
            grad = c.decompress(c.compress(params.grad)) if on else params.grad
            opt.step(params.data, grad)
        if on:
            assert not c.residual.any()
        runs.append(params.data.copy())
    np.testing.assert_array_equal(runs[1], runs[0])


def test_sign_packs_bits_with_the_mean_magnitude_and_feeds_back_the_rest():
    n = 1003
    c = Sign(n)
    for g in grads(4, n, seed=4):
        before = c.residual.copy()
        p = g + before
        payload = c.compress(g)
        assert payload.bits.shape == (math.ceil(n / 8),) and payload.nbytes == 126 + 4
        sent = c.decompress(payload)
        scale = np.float32(np.abs(p.astype(np.float64)).sum() / n)
        np.testing.assert_array_equal(sent, np.where(p >= 0, scale, -scale))
        e, d, p64 = (x.astype(np.float64) for x in (c.residual, sent, p))
        assert np.all(np.abs(e + d - p64) <= U32 * np.abs(e))  # one rounding at most


def test_without_error_feedback_nothing_is_kept():
    c = make_compressor(build(CompressConfig, {"compress": "topk:0.1",
                                               "error_feedback": False}), 50)
    g0, g1 = grads(2, 50, seed=5)
    c.compress(g0)
    assert c.residual is None
    np.testing.assert_array_equal(c.decompress(c.compress(g1)) != 0, TopK(50, 0.1).decompress(
        TopK(50, 0.1).compress(g1)) != 0)


LAYOUT = [(0, 6, 9), (60, 12, 5)]  # a wide and a tall matrix; [54, 60) and [120, 127): vectors
SIZE = 127


@pytest.mark.parametrize("rank", [6, 9])  # at or above min(rows, cols) of each
def test_full_rank_power_sgd_reproduces_the_gradient(rank):
    c = PowerSGD(SIZE, LAYOUT, rank, seed=0, dtype=np.float64)
    for g in grads(3, SIZE, seed=6, dtype=np.float64):
        before = c.residual.copy()
        sent = c.decompress(c.compress(g))
        np.testing.assert_allclose(sent, g + before, rtol=0, atol=1e-12)
        np.testing.assert_array_equal(sent[54:60], (g + before)[54:60])  # vectors: as they are
        np.testing.assert_allclose(c.residual, 0, atol=1e-12)


def test_power_sgd_two_replicas_with_the_callers_reductions():
    """Two replicas, the caller averaging P and Q between the steps: at full rank the
    result is the mean gradient, both keep the same warm start, and each replica's
    residual is what it did not send, M_w - P^ P^T M_w (not 0 for the tall matrix, whose
    replicas span other column spaces than their mean), the residuals summing to ~0."""
    reps = [PowerSGD(SIZE, LAYOUT, 9, seed=0, dtype=np.float64) for _ in range(2)]
    gs = grads(2, SIZE, seed=7, dtype=np.float64)
    p = [r.p_factors(g) for r, g in zip(reps, gs, strict=True)]
    p_mean = (p[0] + p[1]) / 2
    q = [r.q_factors(p_mean).copy() for r in reps]
    q_mean = (q[0] + q[1]) / 2
    out = [r.finish(q_mean) for r in reps]
    np.testing.assert_array_equal(out[0], out[1])
    np.testing.assert_allclose(out[0], (gs[0] + gs[1]) / 2, atol=1e-12)
    np.testing.assert_array_equal(reps[0].q, reps[1].q)
    P = reps[0].p[6 * 6 : 6 * 6 + 12 * 5].reshape(12, 5)  # the tall matrix's P^
    for r, g in zip(reps, gs, strict=True):
        M = g[60:120].reshape(12, 5)
        np.testing.assert_allclose(r.residual[60:120], (M - P @ P.T @ M).ravel(), atol=1e-12)
        np.testing.assert_allclose(r.residual[:54], 0, atol=1e-12)  # the wide one: full
        assert not r.residual[54:60].any() and not r.residual[120:].any()  # vectors: whole
    assert np.abs(reps[0].residual[60:120]).max() > 0.1
    np.testing.assert_allclose(reps[0].residual + reps[1].residual, 0, atol=1e-12)


def test_power_sgd_rank_r_residual_and_warm_start():
    """Below full rank: residual + P^ Q^T == p within one rounding, and the warm start's
    power iteration converges to the best rank-r approximation (the truncated SVD)."""
    rng = np.random.default_rng(8)
    U, _ = np.linalg.qr(rng.standard_normal((12, 12)))
    V, _ = np.linalg.qr(rng.standard_normal((9, 9)))
    M = (U[:, :9] * [8, 4, 2, 1, 0.5, 0.25, 0.1, 0.05, 0.01]) @ V.T  # (12, 9) known spectrum
    g = M.ravel().astype(np.float32)
    c = PowerSGD(g.size, [(0, 12, 9)], 2, seed=1)
    before = c.residual.copy()
    payload = c.compress(g)
    e, d = c.residual.astype(np.float64), c.decompress(payload).astype(np.float64)
    assert np.all(np.abs(e + d - (g + before)) <= 4 * U32 * (np.abs(e) + np.abs(d)))
    assert payload.nbytes == (12 + 9) * 2 * 4
    quiet = PowerSGD(g.size, [(0, 12, 9)], 2, seed=1, dtype=np.float64, error_feedback=False)
    best = np.linalg.norm([2, 1, 0.5, 0.25, 0.1, 0.05, 0.01])  # |M - M_2|_F
    errors = [np.linalg.norm(M.ravel() - quiet.decompress(quiet.compress(M.ravel())))
              for _ in range(40)]
    assert errors[0] > 1.01 * best and errors[-1] < best * (1 + 1e-6)


def test_matrix_layout_of_a_model_and_bad_specs():
    cfg = build(config_class("mlp"), {"d_in": 4, "d_hidden": 8, "n_layers": 1, "n_classes": 3})
    params = build_model("mlp", cfg).init_params(seed=0, xp=np)
    layout = matrix_layout(params)
    assert layout and all(r * c == math.prod(params[s.name].shape) for (o, r, c), s in zip(
        layout, [s for s in params.specs if len(s.shape) >= 2], strict=True))
    c = make_compressor(build(CompressConfig, {"compress": "powersgd:2"}), params.size,
                        matrices=layout)
    vec = sum(math.prod(s.shape) for s in params.specs if len(s.shape) < 2)
    assert c.compress(params.data).nbytes == 4 * (vec + sum((r + cc) * min(2, r, cc)
                                                            for _, r, cc in layout))
    for text, message in [("top:0.1", "one of"), ("topk:0", "fraction"), ("randk:2", "fraction"),
                          ("powersgd:1.5", "rank"), ("sign:3", "no value")]:
        with pytest.raises(ConfigError, match="--compress"):
            build(CompressConfig, {"compress": text})
        with pytest.raises(ConfigError, match=message):
            build(CompressConfig, {"compress": text})
    with pytest.raises(ConfigError, match="--no-error-feedback needs --compress"):
        build(CompressConfig, {"error_feedback": False})
    with pytest.raises(ValueError, match="do not lie apart"):
        PowerSGD(10, [(0, 3, 3), (8, 2, 2)], 1)
