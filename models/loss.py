"""Numerically stable softmax cross-entropy.

    loss = mean_i [ logsumexp(z_i) - z_i[y_i] ]
    dloss/dz_i = (softmax(z_i) - onehot(y_i)) / N

The max is subtracted before exponentiating, so large logits cannot overflow.
One (N, C) buffer is allocated: shifted logits, then probabilities, then the
gradient, in place. On NumPy the row passes run in blocks of rows spread over
the compute threads (layers.in_blocks): each row's operations are the same, so
the results are bit-identical; the loss's mean over the rows is taken whole.
"""

from __future__ import annotations

import numpy as np

from dtlab.models.backend import array_module
from dtlab.models.layers import THREAD_BLOCK, in_blocks


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
    p = xp.empty_like(z)  # (N, C) shifted logits, then probabilities
    zt = xp.empty(N, dtype=z.dtype)  # (N,) shifted logit of the target
    sum_p = xp.empty((N, 1), dtype=z.dtype)  # (N, 1)

    def softmax_rows(lo, hi):  # rows lo..hi-1: p = exp(z - max), its row sums, zt
        zb, pb = z[lo:hi], p[lo:hi]
        xp.subtract(zb, zb.max(axis=1, keepdims=True), out=pb)
        zt[lo:hi] = pb[rows[: hi - lo], t[lo:hi]]
        xp.exp(pb, out=pb)
        pb.sum(axis=1, keepdims=True, out=sum_p[lo:hi])

    def scale_rows(lo, hi):  # softmax * scale / N
        p[lo:hi] *= (scale / N) / sum_p[lo:hi]

    if xp is np:
        per_thread = max(1, THREAD_BLOCK // max(1, C))
        in_blocks(softmax_rows, N, per_thread)
        loss = float((xp.log(sum_p[:, 0]) - zt).mean())
        in_blocks(scale_rows, N, per_thread)
    else:
        softmax_rows(0, N)
        loss = float((xp.log(sum_p[:, 0]) - zt).mean())
        scale_rows(0, N)
    p[rows, t] -= scale / N
    return loss, p.reshape(logits.shape)
