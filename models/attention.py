"""Causal multi-head self-attention with an explicit backward pass.

    Attention(Q, K, V) = softmax(Q K^T / sqrt(d_head) + M) V      (Vaswani et al. 2017)

M is the causal mask (-inf above the diagonal), so position t sees 0..t.
Q, K and V come from one fused projection x @ W_qkv, the heads are
concatenated and projected back with W_o, as in GPT-2.

Backward, per head, with S = Q K^T * scale and A = softmax(S):
    dV = A^T dY
    dA = dY V^T
    dS = A * (dA - rowsum(dA * A))       (softmax Jacobian)
    dQ = dS K * scale,  dK = dS^T Q * scale
"""

from __future__ import annotations

import math

from models.backend import array_module
from models.layers import Linear, Module


class CausalSelfAttention(Module):
    def __init__(self, name: str, d_model: int, n_heads: int, std: float = 0.02,
                 out_std: float = 0.02):
        if d_model % n_heads:
            raise ValueError(f"d_model {d_model} is not divisible by n_heads {n_heads}")
        self.name, self.d, self.h = name, d_model, n_heads
        self.hs = d_model // n_heads
        self.qkv = Linear(f"{name}.qkv", d_model, 3 * d_model, std=std)
        self.proj = Linear(f"{name}.proj", d_model, d_model, std=out_std)

    def specs(self):
        return self.qkv.specs() + self.proj.specs()

    def forward(self, P, x):
        xp = array_module(x)
        B, T, C = x.shape
        qkv, qkv_ctx = self.qkv.forward(P, x)  # (B, T, 3C)
        q, k, v = qkv.reshape(B, T, 3, self.h, self.hs).transpose(2, 0, 3, 1, 4)  # (B, nh, T, hs)
        scale = 1.0 / math.sqrt(self.hs)
        s = (q @ k.swapaxes(-1, -2)) * scale  # (B, nh, T, T)
        s += _causal_mask(xp, T, s.dtype)
        s -= s.max(axis=-1, keepdims=True)
        a = xp.exp(s, out=s)
        a /= a.sum(axis=-1, keepdims=True)  # (B, nh, T, T)
        y = (a @ v).transpose(0, 2, 1, 3).reshape(B, T, C)  # (B, T, C)
        out, proj_ctx = self.proj.forward(P, y)
        return out, (qkv_ctx, q, k, v, a, proj_ctx)

    def backward(self, P, ctx, dout):
        xp = array_module(dout)
        qkv_ctx, q, k, v, a, proj_ctx = ctx
        B, nh, T, hs = q.shape
        dy = self.proj.backward(P, proj_ctx, dout)  # (B, T, C)
        dy = dy.reshape(B, T, nh, hs).transpose(0, 2, 1, 3)  # (B, nh, T, hs)
        scale = 1.0 / math.sqrt(hs)
        dv = a.swapaxes(-1, -2) @ dy  # (B, nh, T, hs)
        da = dy @ v.swapaxes(-1, -2)  # (B, nh, T, T)
        ds = a * (da - (da * a).sum(axis=-1, keepdims=True))
        ds *= scale
        dq = ds @ k  # (B, nh, T, hs)
        dk = ds.swapaxes(-1, -2) @ q  # (B, nh, T, hs)
        dqkv = xp.stack([dq, dk, dv])  # (3, B, nh, T, hs)
        dqkv = dqkv.transpose(1, 3, 0, 2, 4).reshape(B, T, 3 * self.d)  # (B, T, 3C)
        return self.qkv.backward(P, qkv_ctx, dqkv)


_MASKS: dict = {}


def _causal_mask(xp, T: int, dtype):
    """(T, T) additive mask: 0 on and below the diagonal, -inf above."""
    key = (xp.__name__, T, str(dtype))
    if key not in _MASKS:
        _MASKS[key] = xp.triu(xp.full((T, T), -xp.inf, dtype=dtype), k=1)
    return _MASKS[key]
