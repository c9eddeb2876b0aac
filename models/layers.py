"""Layers with explicit forward and backward passes.

Every layer is a `Module`:

    specs()                 -> the ParamSpecs it owns (names carry its prefix)
    forward(P, x)           -> (y, ctx)   ctx holds what backward needs
    backward(P, ctx, dy)    -> dx         and accumulates (+=) into P.grads

`P` is a FlatParams. The context is returned rather than kept on the module,
so several micro-batches can be in flight at once (pipeline schedules) and a
wrapper can drop it and recompute it (activation recomputation). Arrays may
have any leading batch shape `(..., d)`; the namespace (NumPy or CuPy) is the
one of the input array.
"""

from __future__ import annotations

import math

from models.backend import array_module
from models.params import FlatParams, ParamSpec


class Module:
    name: str = ""

    def specs(self) -> list[ParamSpec]:
        return []

    def forward(self, P: FlatParams, x):
        raise NotImplementedError

    def backward(self, P: FlatParams, ctx, dy):
        raise NotImplementedError


class Linear(Module):
    """y = x @ W + b, with W of shape (d_in, d_out)."""

    def __init__(self, name: str, d_in: int, d_out: int, bias: bool = True, std: float = 0.02):
        self.name, self.d_in, self.d_out, self.bias, self.std = name, d_in, d_out, bias, std

    def specs(self):
        out = [ParamSpec(f"{self.name}.W", (self.d_in, self.d_out), std=self.std)]
        if self.bias:
            out.append(ParamSpec(f"{self.name}.b", (self.d_out,), init="zeros", decay=False))
        return out

    def forward(self, P, x):
        y = x @ P[f"{self.name}.W"]  # (..., d_out)
        if self.bias:
            y += P[f"{self.name}.b"]
        return y, x

    def backward(self, P, x, dy):
        x2 = x.reshape(-1, self.d_in)  # (N, d_in)
        dy2 = dy.reshape(-1, self.d_out)  # (N, d_out)
        P.grads[f"{self.name}.W"] += x2.T @ dy2  # (d_in, d_out)
        if self.bias:
            P.grads[f"{self.name}.b"] += dy2.sum(axis=0)
        return dy @ P[f"{self.name}.W"].T  # (..., d_in)


class Embedding(Module):
    """Token embedding plus an optional learned positional embedding.

    x: integer tokens (B, T) -> (B, T, d). Positions 0..T-1 are added when
    `max_len` is given (GPT-2 style learned positions).
    """

    def __init__(self, name: str, vocab: int, d: int, max_len: int | None = None):
        self.name, self.vocab, self.d, self.max_len = name, vocab, d, max_len

    def specs(self):
        out = [ParamSpec(f"{self.name}.W", (self.vocab, self.d))]
        if self.max_len:
            out.append(ParamSpec(f"{self.name}.pos", (self.max_len, self.d), std=0.01))
        return out

    def forward(self, P, tokens):
        y = P[f"{self.name}.W"][tokens]  # (B, T, d)
        if self.max_len:
            T = tokens.shape[-1]
            if T > self.max_len:
                raise ValueError(f"{self.name}: sequence length {T} > max_len {self.max_len}")
            y += P[f"{self.name}.pos"][:T]
        return y, tokens

    def backward(self, P, tokens, dy):
        xp = array_module(dy)
        flat = tokens.reshape(-1)
        xp.add.at(P.grads[f"{self.name}.W"], flat, dy.reshape(flat.size, self.d))
        if self.max_len:
            T = tokens.shape[-1]
            P.grads[f"{self.name}.pos"][:T] += dy.reshape(-1, T, self.d).sum(axis=0)
        return None  # integer inputs have no gradient


class LayerNorm(Module):
    """y = (x - mean) / sqrt(var + eps) * g + b over the last axis (Ba et al. 2016)."""

    def __init__(self, name: str, d: int, eps: float = 1e-5):
        self.name, self.d, self.eps = name, d, eps

    def specs(self):
        return [
            ParamSpec(f"{self.name}.g", (self.d,), init="ones", decay=False),
            ParamSpec(f"{self.name}.b", (self.d,), init="zeros", decay=False),
        ]

    def forward(self, P, x):
        xp = array_module(x)
        mu = x.mean(axis=-1, keepdims=True)
        xc = x - mu
        rstd = 1.0 / xp.sqrt((xc * xc).mean(axis=-1, keepdims=True) + self.eps)  # (..., 1)
        xhat = xc * rstd
        return xhat * P[f"{self.name}.g"] + P[f"{self.name}.b"], (xhat, rstd)

    def backward(self, P, ctx, dy):
        xhat, rstd = ctx
        P.grads[f"{self.name}.g"] += (dy * xhat).reshape(-1, self.d).sum(axis=0)
        P.grads[f"{self.name}.b"] += dy.reshape(-1, self.d).sum(axis=0)
        dxhat = dy * P[f"{self.name}.g"]
        # dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat))
        return rstd * (
            dxhat
            - dxhat.mean(axis=-1, keepdims=True)
            - xhat * (dxhat * xhat).mean(axis=-1, keepdims=True)
        )


class RMSNorm(Module):
    """y = x / sqrt(mean(x^2) + eps) * g (Zhang & Sennrich 2019)."""

    def __init__(self, name: str, d: int, eps: float = 1e-6):
        self.name, self.d, self.eps = name, d, eps

    def specs(self):
        return [ParamSpec(f"{self.name}.g", (self.d,), init="ones", decay=False)]

    def forward(self, P, x):
        xp = array_module(x)
        rrms = 1.0 / xp.sqrt((x * x).mean(axis=-1, keepdims=True) + self.eps)  # (..., 1)
        xhat = x * rrms
        return xhat * P[f"{self.name}.g"], (xhat, rrms)

    def backward(self, P, ctx, dy):
        xhat, rrms = ctx
        P.grads[f"{self.name}.g"] += (dy * xhat).reshape(-1, self.d).sum(axis=0)
        dxhat = dy * P[f"{self.name}.g"]
        return rrms * (dxhat - xhat * (dxhat * xhat).mean(axis=-1, keepdims=True))


_GELU_C = math.sqrt(2.0 / math.pi)


class GELU(Module):
    """tanh approximation of GELU (Hendrycks & Gimpel 2016), as in GPT-2:
    gelu(x) = 0.5 x (1 + tanh(c (x + 0.044715 x^3))),  c = sqrt(2/pi)."""

    def forward(self, P, x):
        xp = array_module(x)
        t = xp.tanh(_GELU_C * (x + 0.044715 * x * x * x))
        return 0.5 * x * (1.0 + t), (x, t)

    def backward(self, P, ctx, dy):
        x, t = ctx
        dt = _GELU_C * (1.0 + 3 * 0.044715 * x * x)
        return dy * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * dt)


class ReLU(Module):
    def forward(self, P, x):
        mask = x > 0
        return x * mask, mask

    def backward(self, P, mask, dy):
        return dy * mask


def _silu(xp, a):
    s = 1.0 / (1.0 + xp.exp(-a))
    return a * s, s


class SwiGLU(Module):
    """Gated feed-forward y = (silu(x W1) * (x W3)) W2 (Shazeer 2020)."""

    def __init__(self, name: str, d: int, d_ff: int, std: float = 0.02, out_std: float = 0.02):
        self.name = name
        self.w1 = Linear(f"{name}.w1", d, d_ff, bias=False, std=std)
        self.w3 = Linear(f"{name}.w3", d, d_ff, bias=False, std=std)
        self.w2 = Linear(f"{name}.w2", d_ff, d, bias=False, std=out_std)

    def specs(self):
        return self.w1.specs() + self.w3.specs() + self.w2.specs()

    def forward(self, P, x):
        xp = array_module(x)
        a, _ = self.w1.forward(P, x)  # (..., d_ff)
        b, _ = self.w3.forward(P, x)  # (..., d_ff)
        sa, s = _silu(xp, a)
        y, _ = self.w2.forward(P, sa * b)  # (..., d)
        return y, (x, a, s, sa, b)

    def backward(self, P, ctx, dy):
        x, a, s, sa, b = ctx
        dh = self.w2.backward(P, sa * b, dy)  # (..., d_ff)
        db = dh * sa
        da = dh * b * (s * (1.0 + a * (1.0 - s)))  # silu'(a) = s (1 + a (1 - s))
        return self.w1.backward(P, x, da) + self.w3.backward(P, x, db)


class Sequential(Module):
    """Modules applied in order; backward in reverse.

    `grad_ready(offset)` (optional) is called after each module's backward
    with the lowest buffer offset that module owns: from then on every
    gradient at or above that offset is final, because parameters are laid
    out in forward order. The data-parallel trainer starts a bucket's
    all-reduce from it.
    """

    def __init__(self, modules: list[Module]):
        self.modules = modules
        self._names = [[s.name for s in m.specs()] for m in modules]

    def specs(self):
        return [s for m in self.modules for s in m.specs()]

    def forward(self, P, x):
        ctxs = []
        for m in self.modules:
            x, ctx = m.forward(P, x)
            ctxs.append(ctx)
        return x, ctxs

    def backward(self, P, ctxs, dy, grad_ready=None):
        for m, names, ctx in zip(self.modules[::-1], self._names[::-1], ctxs[::-1], strict=True):
            dy = m.backward(P, ctx, dy)
            if grad_ready is not None and names:
                grad_ready(P.first_offset(names))
        return dy


class Recompute(Module):
    """Activation recomputation (Chen et al. 2016, "gradient checkpointing").

    Keeps only the module's input; backward runs forward again to rebuild
    the context. Costs one extra forward, saves the module's activations.
    """

    def __init__(self, module: Module):
        self.module, self.name = module, module.name

    def specs(self):
        return self.module.specs()

    def forward(self, P, x):
        y, _ = self.module.forward(P, x)
        return y, x

    def backward(self, P, x, dy):
        _, ctx = self.module.forward(P, x)
        return self.module.backward(P, ctx, dy)


class Residual(Module):
    """y = x + f(x): the pre-norm residual branch of a transformer block."""

    def __init__(self, branch: Module):
        self.branch, self.name = branch, branch.name

    def specs(self):
        return self.branch.specs()

    def forward(self, P, x):
        y, ctx = self.branch.forward(P, x)
        return x + y, ctx

    def backward(self, P, ctx, dy):
        return dy + self.branch.backward(P, ctx, dy)
