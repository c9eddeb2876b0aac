"""Causal multi-head self-attention with an explicit backward pass.

    Attention(Q, K, V) = softmax(Q K^T / sqrt(d_head) + M) V      (Vaswani et al. 2017)

M is the causal mask (-inf above the diagonal), so position t sees 0..t.
Q, K and V come from one fused projection x @ W_qkv, the heads are
concatenated and projected back with W_o, as in GPT-2. The full (T, T)
score matrix is computed (masked entries included), which is what
models/cost.py counts: 4 B T^2 d FLOPs forward, 8 B T^2 d backward.

Backward, per head, with S = Q K^T * scale, A = softmax(S), Y = A V:
    dV = A^T dY
    dA = dY V^T
    dS = A * (dA - rowsum(dA * A)),   rowsum(dA * A) = rowsum(dY * Y)
    dQ = dS K * scale,  dK = dS^T Q * scale
Split over a tensor-parallel communicator (Shoeybi et al. 2019), a rank
runs n_heads / tp heads: the q, k and v columns of its heads (a
ColumnParallelLinear of 3 groups) and the matching rows of W_o (a
RowParallelLinear, whose all-reduce sums the heads' contributions).

With `recompute_scores` (selective activation recomputation, Korthikanti et
al. 2022, "Reducing Activation Recomputation in Large Transformer Models")
the (B, heads, T, T) softmax A is not kept: backward rebuilds it from the
kept q and k by the same operations, so the gradients are bit-identical,
for 2 B T^2 d more FLOPs and B heads T^2 fewer floats held per layer; the
linear layers' inputs and outputs stay kept.

The row sum is taken over (T, d_head) rather than (T, T) through the
identity sum_j dA_ij A_ij = dY_i . sum_j A_ij V_j = dY_i . Y_i (as in
FlashAttention, Dao et al. 2022). The per-head products are written straight
into the (B, T, heads, d_head) layout the projections use, so no transposed
copies are made.
"""

from __future__ import annotations

import math

from dtlab.models.backend import array_module
from dtlab.models.comm import Comm
from dtlab.models.layers import Linear, Module
from dtlab.models.tensor_parallel import ColumnParallelLinear, RowParallelLinear


class CausalSelfAttention(Module):
    """n_heads heads over d_model; with `tp`, this rank's n_heads / tp.size of them."""

    def __init__(self, name: str, d_model: int, n_heads: int, std: float = 0.02,
                 out_std: float = 0.02, tp: Comm | None = None, recompute_scores: bool = False):
        if d_model % n_heads:
            raise ValueError(f"d_model {d_model} is not divisible by n_heads {n_heads}")
        self.name, self.d, self.recompute_scores = name, d_model, recompute_scores
        self.hs = d_model // n_heads
        if tp is None:
            self.h = n_heads
            self.qkv = Linear(f"{name}.qkv", d_model, 3 * d_model, std=std)
            self.proj = Linear(f"{name}.proj", d_model, d_model, std=out_std)
        else:
            if n_heads % tp.size:
                raise ValueError(f"{name}: {n_heads} heads are not divisible by the "
                                 f"tensor-parallel size {tp.size}")
            self.h = n_heads // tp.size
            self.qkv = ColumnParallelLinear(f"{name}.qkv", d_model, 3 * d_model, tp, std=std,
                                            groups=3)
            self.proj = RowParallelLinear(f"{name}.proj", d_model, d_model, tp, std=out_std)

    def specs(self):
        return self.qkv.specs() + self.proj.specs()

    def forward(self, P, x):
        xp = array_module(x)
        B, T, _ = x.shape
        nh, hs = self.h, self.hs  # this rank's heads
        C = nh * hs
        qkv, qkv_ctx = self.qkv.forward(P, x)  # (B, T, 3C)
        q, k, v = qkv.reshape(B, T, 3, nh, hs).transpose(2, 0, 3, 1, 4)  # 3 x (B, nh, T, hs)
        a = self._softmax(xp, q, k)  # (B, nh, T, T)
        y = xp.empty((B, T, nh, hs), dtype=a.dtype)
        xp.matmul(a, v, out=y.transpose(0, 2, 1, 3))  # (B, nh, T, hs) view: Y = A V
        out, proj_ctx = self.proj.forward(P, y.reshape(B, T, C))
        return out, (qkv_ctx, q, k, v, None if self.recompute_scores else a, proj_ctx)

    def _softmax(self, xp, q, k):
        """A = softmax(Q K^T / sqrt(d_head) + M), (B, nh, T, T), in place in one buffer."""
        T = q.shape[2]
        a = (q * (1.0 / math.sqrt(self.hs))) @ k.swapaxes(-1, -2)  # (B, nh, T, T) scores S
        a += _causal_mask(xp, T, a.dtype)
        a -= a.max(axis=-1, keepdims=True)
        xp.exp(a, out=a)
        a *= 1.0 / a.sum(axis=-1, keepdims=True)
        return a

    def backward(self, P, ctx, dout):
        xp = array_module(dout)
        qkv_ctx, q, k, v, a, proj_ctx = ctx
        if a is None:  # selective recomputation: rebuild A exactly as forward made it
            a = self._softmax(xp, q, k)
        B, nh, T, hs = q.shape
        dy = self.proj.backward(P, proj_ctx, dout)  # (B, T, C)
        dy = dy.reshape(B, T, nh, hs).transpose(0, 2, 1, 3)  # (B, nh, T, hs) dY
        y = proj_ctx.reshape(B, T, nh, hs).transpose(0, 2, 1, 3)  # (B, nh, T, hs) Y
        dqkv = xp.empty((B, T, 3, nh, hs), dtype=dout.dtype)
        dq, dk, dv = dqkv.transpose(2, 0, 3, 1, 4)  # 3 x (B, nh, T, hs) views
        xp.matmul(a.swapaxes(-1, -2), dy, out=dv)  # dV = A^T dY
        ds = dy @ v.swapaxes(-1, -2)  # (B, nh, T, T) dA
        ds -= xp.einsum("bhtd,bhtd->bht", dy, y)[..., None]  # - rowsum(dY * Y)
        ds *= a  # dS
        xp.matmul(ds, k, out=dq)
        xp.matmul(ds.swapaxes(-1, -2), q, out=dk)
        dqkv[:, :, :2] *= 1.0 / math.sqrt(hs)
        return self.qkv.backward(P, qkv_ctx, dqkv.reshape(B, T, 3 * nh * hs))


_MASKS: dict = {}


def _causal_mask(xp, T: int, dtype):
    """(T, T) additive mask: 0 on and below the diagonal, -inf above."""
    key = (xp.__name__, T, str(dtype))
    if key not in _MASKS:
        _MASKS[key] = xp.triu(xp.full((T, T), -xp.inf, dtype=dtype), k=1)
    return _MASKS[key]
