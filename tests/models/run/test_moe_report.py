"""A step's MoE record: "moe_aux_loss" is the mean of the balancing terms over the step's
micro-batches, the figure whose gradient the step took (central differences in float64),
with recomputation and router noise too; the logged loss is the cross-entropy alone."""

from __future__ import annotations

import numpy as np
import pytest
from support.gradcheck import assert_grad_close, numeric_grad, sample_offsets

from dtlab.models.model import Replica
from dtlab.models.run import moe_report
from dtlab.models.transformer import Transformer, TransformerConfig

TINY = dict(vocab=11, seq_len=5, d_model=8, n_heads=2, n_layers=2, d_ff=12, moe_experts=3,
            moe_aux_coef=0.5, moe_z_coef=0.1)


@pytest.mark.parametrize("extra", [{}, {"recompute": True, "moe_noise": "jitter"}])
def test_the_logged_aux_loss_is_the_mean_the_gradient_follows(extra):
    model = Transformer(TransformerConfig(**TINY, **extra))
    P = model.init_params(0, dtype="float64", xp=np)
    P.data[...] = np.random.default_rng(1).normal(0.0, 0.3, P.size)
    rng = np.random.default_rng(0)
    micro = [(t[:, :-1], t[:, 1:]) for t in (rng.integers(0, 11, size=(2, 6)) for _ in range(3))]

    def each() -> list[tuple[float, float]]:
        """(cross-entropy, balancing terms) of every micro-batch, each forward at the router
        noise step its backward in the accumulated step had."""
        out = []
        for i, mb in enumerate(micro):
            for m in model.moe:
                m.noise_step = i
            loss, _ = model.forward(P, mb)
            out.append((loss, sum(m.last_aux_loss for m in model.moe)))
        for m in model.moe:
            m.noise_step = 0
        return out

    parts = each()
    loss = Replica(model, P).compute_grads(micro)
    record = moe_report.step_record(model.moe)
    assert loss == pytest.approx(np.mean([ce for ce, _ in parts]), rel=1e-12)
    assert record["moe_aux_loss"] == pytest.approx(np.mean([a for _, a in parts]), rel=1e-12)
    assert record["moe_aux_loss"] != pytest.approx(parts[-1][1], rel=1e-6)  # not the last's
    grad = P.grad.copy()
    offsets = sample_offsets(P, 1, np.random.default_rng(0))
    num = numeric_grad(lambda: float(np.mean([ce + a for ce, a in each()])), P.data, offsets)
    assert np.abs(num).max() > 1e-3
    assert_grad_close(grad[offsets], num, "the step's gradient: mean of cross-entropy + aux")
