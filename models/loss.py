"""Numerically stable softmax cross-entropy.

    loss = mean_i [ logsumexp(z_i) - z_i[y_i] ]
    dloss/dz_i = (softmax(z_i) - onehot(y_i)) / N

The max is subtracted before exponentiating, so large logits cannot overflow.
One (N, C) buffer is allocated: shifted logits, then probabilities, then the
gradient, in place.
"""

from __future__ import annotations

from dtlab.models.backend import array_module


def softmax_cross_entropy(logits, targets, scale: float = 1.0):
    """Mean cross-entropy of `logits` (..., C) against integer `targets` (...).

    Returns (loss as a Python float, dlogits of the loss times `scale`).
    `scale` lets gradient accumulation weight each micro-batch.
    """
    xp = array_module(logits)
    C = logits.shape[-1]
    if targets.shape != logits.shape[:-1]:
        raise ValueError(f"targets shape {targets.shape} does not match logits {logits.shape}")
    z = logits.reshape(-1, C)  # (N, C)
    t = targets.reshape(-1)  # (N,)
    N = z.shape[0]
    rows = xp.arange(N)
    p = z - z.max(axis=1, keepdims=True)  # (N, C) shifted logits, then probabilities
    zt = p[rows, t]  # (N,) shifted logit of the target
    xp.exp(p, out=p)
    sum_p = p.sum(axis=1, keepdims=True)  # (N, 1)
    loss = float((xp.log(sum_p[:, 0]) - zt).mean())
    p *= (scale / N) / sum_p  # softmax * scale / N
    p[rows, t] -= scale / N
    return loss, p.reshape(logits.shape)
