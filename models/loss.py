"""Numerically stable softmax cross-entropy.

    loss = mean_i [ logsumexp(z_i) - z_i[y_i] ]
    dloss/dz_i = (softmax(z_i) - onehot(y_i)) / N

The max is subtracted before exponentiating, so large logits cannot overflow.
"""

from __future__ import annotations

from models.backend import array_module


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
    z = z - z.max(axis=1, keepdims=True)
    p = xp.exp(z)
    sum_p = p.sum(axis=1, keepdims=True)  # (N, 1)
    rows = xp.arange(N)
    loss = float((xp.log(sum_p[:, 0]) - z[rows, t]).mean())
    p /= sum_p  # softmax
    p[rows, t] -= 1.0
    p *= scale / N
    return loss, p.reshape(logits.shape)
