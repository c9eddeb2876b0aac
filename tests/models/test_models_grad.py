"""Whole models against central finite differences in float64.

The scalar is the model's own loss (softmax cross-entropy). Three random
entries of every parameter tensor are checked (each tensor is covered; the
layers themselves are checked entry by entry in test_layers.py). Tolerance:
see tests/support/gradcheck.py. Also: the transformer is causal end to end,
recomputation changes no bit of any gradient, and `grad_ready` reports
final gradients in decreasing offset order.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from support.gradcheck import assert_grad_close, numeric_grad, sample_offsets

from dtlab.models.mlp import MLP, MLPConfig
from dtlab.models.model import Replica
from dtlab.models.transformer import Transformer, TransformerConfig

TINY_T = dict(vocab=11, seq_len=5, d_model=8, n_heads=2, n_layers=2, d_ff=12)
TINY_MLP = dict(d_in=5, d_hidden=7, n_layers=2, n_classes=4)
VARIANTS = list(itertools.product(["gelu", "swiglu"], ["layernorm", "rmsnorm"], [False, True]))


def token_batch(cfg, B=3, seed=0):
    tokens = np.random.default_rng(seed).integers(0, cfg.vocab, size=(B, cfg.seq_len + 1))
    return tokens[:, :-1], tokens[:, 1:]


def mlp_batch(cfg, B=6, seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((B, cfg.d_in)), rng.integers(0, cfg.n_classes, size=B)


def randomized(model, seed=0, std=0.3):
    """float64 parameters, all entries random (gains not 1, biases not 0)."""
    P = model.init_params(seed, dtype="float64", xp=np)
    P.data[...] = np.random.default_rng(seed + 1).normal(0.0, std, P.size)
    return P


def check_model(model, batch, seed=0):
    P = randomized(model, seed)
    P.zero_grad()
    model.loss_and_grad(P, batch)
    offsets = sample_offsets(P, 3, np.random.default_rng(seed))
    num = numeric_grad(lambda: model.forward(P, batch)[0], P.data, offsets)
    assert np.abs(num).max() > 1e-3
    assert_grad_close(P.grad[offsets], num, f"{model.name} parameter gradients")


@pytest.mark.parametrize("activation", ["gelu", "relu"])
def test_mlp_gradients(activation):
    cfg = MLPConfig(activation=activation, **TINY_MLP)
    check_model(MLP(cfg), mlp_batch(cfg))


@pytest.mark.parametrize("ffn,norm,recompute", VARIANTS)
def test_transformer_gradients(ffn, norm, recompute):
    cfg = TransformerConfig(ffn=ffn, norm=norm, recompute=recompute, **TINY_T)
    check_model(Transformer(cfg), token_batch(cfg))


@pytest.mark.parametrize("ffn,norm", [("gelu", "layernorm"), ("swiglu", "rmsnorm")])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_recompute_gives_identical_gradients(ffn, norm, dtype):
    grads = []
    for recompute in (False, True):
        model = Transformer(TransformerConfig(ffn=ffn, norm=norm, recompute=recompute, **TINY_T))
        P = model.init_params(0, dtype=dtype, xp=np)
        Replica(model, P).compute_grads([token_batch(model.config)])
        grads.append(P.grad.copy())
    assert grads[0].any()
    np.testing.assert_array_equal(grads[0], grads[1])


def test_transformer_is_causal():
    """Changing token t leaves the logits of positions < t bit-identical."""
    model = Transformer(TransformerConfig(**TINY_T))
    P = randomized(model)
    tokens, _ = token_batch(model.config)
    logits0, _ = model.body.forward(P, tokens)
    for t in range(model.config.seq_len):
        changed = tokens.copy()
        changed[:, t] = (changed[:, t] + 1) % model.config.vocab
        logits1, _ = model.body.forward(P, changed)
        np.testing.assert_array_equal(logits1[:, :t], logits0[:, :t], err_msg=f"t={t}")
        assert (np.abs(logits1[:, t] - logits0[:, t]).max(axis=-1) > 0).all()


def grad_ready_calls(model, batch, P):
    calls = []
    P.zero_grad()
    loss, ctx = model.forward(P, batch)
    model.backward(P, ctx, grad_ready=lambda off: calls.append((off, P.grad.copy())))
    return calls


@pytest.mark.parametrize("name", ["mlp", "transformer", "transformer-recompute"])
def test_grad_ready_offsets_are_final(name):
    if name == "mlp":
        model = MLP(MLPConfig(**TINY_MLP))
        batch = mlp_batch(model.config)
    else:
        model = Transformer(TransformerConfig(recompute=name.endswith("recompute"), **TINY_T))
        batch = token_batch(model.config)
    P = model.init_params(0, xp=np)
    calls = grad_ready_calls(model, batch, P)
    offsets = [off for off, _ in calls]
    with_params = [m for m in model.body.modules if m.specs()]
    assert len(calls) == len(with_params)
    assert all(a > b for a, b in itertools.pairwise(offsets)), offsets
    assert offsets[-1] == 0
    for off, snapshot in calls:
        np.testing.assert_array_equal(snapshot[off:], P.grad[off:], err_msg=f"offset {off}")
    # and the reports are early: below the first offset nothing is computed yet
    assert not calls[0][1][: offsets[0]].any()


def _arrays(node):
    if isinstance(node, (tuple, list)):
        for item in node:
            yield from _arrays(item)
    elif isinstance(node, np.ndarray):
        yield node


@pytest.mark.parametrize("variant", VARIANTS + ["mlp-gelu", "mlp-relu"], ids=str)
def test_float32_model_has_no_float64_anywhere(variant):
    """A Python float or NumPy float64 scalar mixed into float32 math must not
    promote an activation: every float the context keeps is float32."""
    if isinstance(variant, str):
        model = MLP(MLPConfig(activation=variant[4:], **TINY_MLP))
        batch = mlp_batch(model.config)
    else:
        ffn, norm, recompute = variant
        model = Transformer(TransformerConfig(ffn=ffn, norm=norm, recompute=recompute, **TINY_T))
        batch = token_batch(model.config)
    P = model.init_params(0, xp=np)
    _, ctx = model.forward(P, batch)
    kinds = {a.dtype for a in _arrays(ctx)}
    assert kinds <= {np.dtype(np.float32), np.dtype(np.int64), np.dtype(bool)}, kinds
    assert np.dtype(np.float32) in kinds
