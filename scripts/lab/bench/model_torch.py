"""PyTorch eager twins of the benchmark's models, for `dtlab-bench model`'s comparison.

A twin is the same function with the same parameter values, written as a
PyTorch user would: F.linear with nn.Linear's (out, in) weights,
F.layer_norm / F.rms_norm, F.gelu(approximate="tanh"), F.scaled_dot_product_attention
(is_causal=True; on the CPU its flash kernel skips the masked blocks),
F.cross_entropy, torch.utils.checkpoint for a recomputed block (its early stop
off, so that both recompute the whole block: Megatron's full recomputation, which
dtlab's Recompute runs and models/cost.py counts; the default stops once the saved
tensors are rebuilt and skips the block's last matmul, 7% of medium-full's FLOPs), and
torch.optim.AdamW fused (its one-pass CPU kernel) where the build has it. It is
built by walking the dtlab module tree (models/layers.py), so every size
the benchmark runs has one; its first loss must equal dtlab's to 1e-4.

    twin = Twin(model, P, optim_config, threads)   # parameters copied from P
    loss = twin.step(inputs, targets)               # zero grads, forward, backward, update
    twin.layers(model, P, batch)                    # [(layer, count, dtlab fn, torch fn)]

PyTorch is not a dependency of dtlab: `available()` says whether it can be imported.
"""

from __future__ import annotations

import numpy as np

from dtlab.models.attention import CausalSelfAttention
from dtlab.models.layers import (
    GELU,
    Embedding,
    LayerNorm,
    Linear,
    Recompute,
    ReLU,
    Residual,
    RMSNorm,
    Sequential,
    SwiGLU,
)
from dtlab.models.loss import softmax_cross_entropy


def available() -> bool:
    """Whether PyTorch can be imported here."""
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


class Twin:
    """The PyTorch eager copy of `model` with the values of `P`, and its AdamW."""

    def __init__(self, model, P, optim, threads: int):
        import torch

        self.torch, self.F = torch, torch.nn.functional
        torch.set_num_threads(threads)
        self.model = model
        linear = linear_weights(model.body)  # stored (out, in), as nn.Linear keeps them
        self.T = {name: torch.nn.Parameter(torch.from_numpy(np.ascontiguousarray(
                      P[name].T if name in linear else P[name])))
                  for name in P.offsets}
        kw = dict(lr=optim.lr, betas=(optim.beta1, optim.beta2), eps=optim.eps,
                  weight_decay=optim.weight_decay)
        try:
            self.opt = torch.optim.AdamW(list(self.T.values()), fused=True, **kw)
            self.optimizer = "AdamW(fused=True)"
        except (RuntimeError, TypeError):  # a build without the fused CPU kernel
            self.opt = torch.optim.AdamW(list(self.T.values()), **kw)
            self.optimizer = "AdamW"

    def loss(self, inputs, targets):
        logits = self.forward(self.model.body, inputs)
        return self.F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def step(self, inputs, targets) -> float:
        self.opt.zero_grad()
        loss = self.loss(inputs, targets)
        loss.backward()
        self.opt.step()
        return loss.item()

    def forward(self, m, x):
        """`m`'s function in PyTorch ops (the twin of m.forward's output)."""
        F, T = self.F, self.T
        if isinstance(m, Sequential):
            for sub in m.modules:
                x = self.forward(sub, x)
            return x
        if isinstance(m, Residual):
            return x + self.forward(m.branch, x)
        if isinstance(m, Recompute):
            from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

            with set_checkpoint_early_stop(False):  # the whole block again, as dtlab's
                return checkpoint(lambda v: self.forward(m.module, v), x, use_reentrant=False)
        if isinstance(m, Linear):
            return F.linear(x, T[f"{m.name}.W"], T[f"{m.name}.b"] if m.bias else None)
        if isinstance(m, Embedding):
            y = F.embedding(x, T[f"{m.name}.W"])
            return y + T[f"{m.name}.pos"][: x.shape[-1]] if m.max_len else y
        if isinstance(m, LayerNorm):
            return F.layer_norm(x, (m.d,), T[f"{m.name}.g"], T[f"{m.name}.b"], m.eps)
        if isinstance(m, RMSNorm):
            return F.rms_norm(x, (m.d,), T[f"{m.name}.g"], m.eps)
        if isinstance(m, GELU):
            return F.gelu(x, approximate="tanh")
        if isinstance(m, ReLU):
            return F.relu(x)
        if isinstance(m, SwiGLU):
            h = F.silu(self.forward(m.w1, x)) * self.forward(m.w3, x)
            return self.forward(m.w2, h)
        if isinstance(m, CausalSelfAttention):
            return self.forward(m.proj, self.attend(m, self.forward(m.qkv, x)))
        raise ValueError(f"no PyTorch twin for {type(m).__name__}")

    def attend(self, m: CausalSelfAttention, qkv):
        """softmax(Q K^T / sqrt(d_head) + M) V of a fused (B, T, 3C) projection -> (B, T, C)."""
        B, T, _ = qkv.shape
        q, k, v = qkv.view(B, T, 3, m.h, m.hs).permute(2, 0, 3, 1, 4)  # 3 x (B, h, T, hs)
        y = self.F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, h, T, hs)
        return y.transpose(1, 2).reshape(B, T, m.h * m.hs)

    def layers(self, P, inputs, targets, opt) -> list[tuple]:
        """(layer, count per step, input shape, dtlab fn, torch fn): each layer kind of the
        model, once per distinct input shape, forward and backward at that shape as the step
        meets it, then the loss and the optimizer step (`opt`: dtlab's)."""
        torch = self.torch
        rows: dict = {}
        for m, x in layer_inputs(self.model.body, P, inputs):
            for label, shape, d_fn, t_fn in self._layer_fns(m, P, x):
                key = (label, shape)
                count = rows[key][1] + 1 if key in rows else 1
                rows[key] = (label, count, shape, d_fn, t_fn)
        logits, _ = self.model.body.forward(P, inputs)
        t_logits = torch.from_numpy(logits).requires_grad_()
        t_targets = torch.from_numpy(targets)

        def t_loss():
            loss = self.F.cross_entropy(t_logits.reshape(-1, logits.shape[-1]),
                                        t_targets.reshape(-1))
            loss.backward()

        out = list(rows.values())
        out.append(("cross-entropy", 1, logits.shape,
                    lambda: softmax_cross_entropy(logits, targets), t_loss))
        self.step(torch.from_numpy(inputs), torch.from_numpy(targets))  # grads to update with
        out.append((self.optimizer, 1, P.data.shape, lambda: opt.step(P.data, P.grad),
                    self.opt.step))
        return out

    def _layer_fns(self, m, P, x) -> list[tuple]:
        """[(label, input shape, dtlab fn, torch fn)] of one leaf module at input `x`."""
        torch = self.torch
        t_x = torch.from_numpy(x)
        if x.dtype.kind == "f":
            t_x.requires_grad_()
        if isinstance(m, CausalSelfAttention):
            qkv, _ = m.qkv.forward(P, x)
            y, _ = m.proj.forward(P, m.attend(qkv)[0])
            dy = np.random.default_rng(1).standard_normal(y.shape[:2] + (m.d,), np.float32)
            t_qkv, t_dy = torch.from_numpy(qkv).requires_grad_(), torch.from_numpy(dy)
            y_in = m.attend(qkv)[0]
            core = ("attention core", qkv.shape,
                    lambda: m.attend_backward(m.attend(qkv)[1], y_in, dy),
                    lambda: self.attend(m, t_qkv).backward(t_dy))
            return (self._layer_fns(m.qkv, P, x) + [core]
                    + self._layer_fns(m.proj, P, y_in))
        y, _ = m.forward(P, x)
        dy = np.random.default_rng(1).standard_normal(y.shape, np.float32)
        t_dy = torch.from_numpy(dy)

        def d_fn():
            _, ctx = m.forward(P, x)
            m.backward(P, ctx, dy)

        label = type(m).__name__
        if isinstance(m, Linear):
            label = f"Linear {m.d_in}->{m.d_out}"
        return [(label, x.shape, d_fn, lambda: self.forward(m, t_x).backward(t_dy))]


def linear_weights(body) -> set[str]:
    """Names of the (in, out) weights of every Linear in `body`, inside attention and SwiGLU."""
    out = set()
    for m in leaves(body):
        parts = {CausalSelfAttention: lambda m: (m.qkv, m.proj),
                 SwiGLU: lambda m: (m.w1, m.w3, m.w2)}.get(type(m), lambda m: (m,))(m)
        out.update(f"{p.name}.W" for p in parts if isinstance(p, Linear))
    return out


def leaves(m):
    """The modules of `m`'s tree that are not containers, in forward order."""
    if isinstance(m, Sequential):
        return [leaf for sub in m.modules for leaf in leaves(sub)]
    if isinstance(m, (Residual, Recompute)):
        return leaves(m.branch if isinstance(m, Residual) else m.module)
    return [m]


def layer_inputs(m, P, x) -> list[tuple]:
    """[(leaf module, its input)] of one forward of `m` from `x`."""
    out = []

    def walk(m, x):
        if isinstance(m, Sequential):
            for sub in m.modules:
                x = walk(sub, x)
            return x
        if isinstance(m, Residual):
            return x + walk(m.branch, x)
        if isinstance(m, Recompute):
            return walk(m.module, x)
        out.append((m, x))
        return m.forward(P, x)[0]

    walk(m, x)
    return out
