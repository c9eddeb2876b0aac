"""Mixture-of-Experts feed-forward layer (Shazeer et al. 2017; GShard, Lepikhin et al. 2021;
Switch Transformer, Fedus et al. 2021), a drop-in for the dense FFN.

    y_t = sum_j g_tj FFN_(e_tj)(x_t)  +  sum_s Shared_s(x_t)

with the router of models/router.py choosing experts e_tj and gates g_tj. The forward
runs in four phases, each timed into the layer's MoEStats (models/moe_stats.py):

    router    z = x Wr, softmax, choice, gates                          (n, k)
    dispatch  the chosen (token, slot) pairs as rows grouped by expert: `slots` (A,) and
              `counts` (N,); with a capacity C = ceil(factor A_chosen / N) an expert keeps
              its first C pairs in priority order (every token's first choice before any
              second choice, then token order; GShard), the rest are dropped (output 0,
              the residual carries the token); xs = x[slots // k]           (A, d)
    compute   one FFN per expert on its contiguous rows: one matmul per weight and
              expert, never a loop over tokens nor every expert on every token
    combine   y_t = sum_j g_tj out_(t, j): the rows written back to their slots (n, k, d)
              and summed over k; plus the shared experts on every row

"Rows grouped by destination expert, counts per expert" is the form an all-to-all
(Comm.alltoallv(xs, send_counts)) takes for expert parallelism: between dispatch and
compute, and back between compute and combine. Experts' parameters are named per expert
(`h0.moe.e3.w1`, `h0.moe.e3.fc.W`) so that a rank can own a subset (`experts=range(a, b)`).

Backward: dout_a = g_a dy_t; dg_a = dy_t . out_a; the experts' backward on their rows;
dx_t = sum of the rows' dx back in their slots + the router's dx (models/router.py, which
adds the balancing terms' gradients); then the bias nudge (when enabled) and the noise step
advance. The context is a dict: its arrays are what models/memory.py measures and
models/parts.py's moe_ffn predicts.
"""

from __future__ import annotations

import time
from typing import NamedTuple

import numpy as np

from dtlab.models.backend import array_module, to_host
from dtlab.models.comm import Comm
from dtlab.models.layers import GELU, Linear, Module, Sequential, SwiGLU
from dtlab.models.moe_stats import MoEStats
from dtlab.models.router import Router, RouterOptions, capacity, entropy


def expert_ffn(kind: str, name: str, d: int, d_ff: int, out_std: float = 0.02) -> Module:
    """One expert: SwiGLU (`name.w1/w3/w2`) or Linear-GELU-Linear (`name.fc/proj`)."""
    if kind == "swiglu":
        return SwiGLU(name, d, d_ff, out_std=out_std)
    return Sequential([Linear(f"{name}.fc", d, d_ff), GELU(),
                       Linear(f"{name}.proj", d_ff, d, std=out_std)])


class Dispatch(NamedTuple):
    """Rows grouped by expert: slot ids t k + j (A,), kept rows per expert (N,) and the
    pairs that chose each expert before capacity (N,)."""

    slots: object
    counts: object
    load: object


def dispatch(sel, valid, n_experts: int, cap: int | None) -> Dispatch:
    """Group the chosen pairs of sel (n, k) [valid (n, k)] by expert, keeping at most `cap`
    per expert (None: dropless) in priority order: choice rank j, then token t."""
    xp = array_module(sel)
    n, k = sel.shape
    slot = xp.arange(n * k).reshape(n, k).T.reshape(-1)  # (k n,) j-major priority
    expert = sel.T.reshape(-1)  # (k n,)
    if valid is not None:
        keep = valid.T.reshape(-1)
        slot, expert = slot[keep], expert[keep]
    order = xp.argsort(expert, kind="stable")  # by expert, priority kept within one
    slot, expert = slot[order], expert[order]
    load = xp.bincount(expert, minlength=n_experts)  # (N,)
    if cap is None:
        return Dispatch(slot, load, load)
    start = xp.cumsum(load) - load  # (N,) first row of each expert
    rank = xp.arange(slot.shape[0]) - start[expert]  # position within its expert
    kept = rank < cap
    return Dispatch(slot[kept], xp.minimum(load, cap), load)


def to_slots(rows, slots, n: int, k: int):
    """sum_j of rows (A, d) placed at their slots t k + j: (n, d); empty slots add 0."""
    xp = array_module(rows)
    buf = xp.zeros((n * k, rows.shape[1]), dtype=rows.dtype)  # (n k, d)
    buf[slots] = rows
    return buf if k == 1 else buf.reshape(n, k, -1).sum(axis=1)


class MoE(Module):
    """N expert FFNs (`kind` gelu or swiglu, hidden d_ff each), `shared` always-on FFNs of
    the same shape, a linear router (RouterOptions), a capacity factor (None: dropless).

    `comm`: the ranks whose loads the bias balancing sums (None: this process only).
    `experts`: the experts this layer holds (default all; a subset needs the expert-
    parallel all-to-all, not yet implemented). `stats`: the MoEStats each forward fills
    (None: none kept). Attributes the caller may set: `training` (False: no router noise),
    `aux_scale` (multiplies the balancing terms' gradients; set it to the loss's scale
    under gradient accumulation), `noise_step` (advances by one per backward). After each
    forward `last_aux_loss` holds the balancing terms times their coefficients (what a
    Model adds to the loss it reports; also in the context as `moe_aux_loss`, but
    Recompute keeps no context).
    """

    def __init__(self, name: str, d: int, d_ff: int, router: RouterOptions, kind: str = "gelu",
                 capacity_factor: float | None = 1.25, shared: int = 0, out_std: float = 0.02,
                 comm: Comm | None = None, experts: range | None = None,
                 stats: MoEStats | None = None):
        N = router.n_experts
        if capacity_factor is not None and capacity_factor <= 0:
            raise ValueError(f"{name}: capacity factor {capacity_factor} must be positive")
        self.owned = range(N) if experts is None else experts
        if self.owned != range(N):
            raise NotImplementedError(f"{name}: experts={self.owned} of {N} needs the "
                                      "expert-parallel all-to-all (not yet)")
        self.name, self.d, self.n_experts, self.k = name, d, N, router.slots
        self.capacity_factor, self.comm, self.stats = capacity_factor, comm, stats
        self.router = Router(name, d, router)
        self.experts = [expert_ffn(kind, f"{name}.e{e}", d, d_ff, out_std) for e in self.owned]
        self.shared = [expert_ffn(kind, f"{name}.s{s}", d, d_ff, out_std) for s in range(shared)]
        self.training, self.aux_scale, self.noise_step = True, 1.0, 0
        self.last_aux_loss = 0.0  # coefficient x balancing terms of the latest forward

    def specs(self):
        return self.router.specs() + [s for m in self.experts + self.shared for s in m.specs()]

    def forward(self, P, x):
        xp = array_module(x)
        n, k, o = x.size // self.d, self.k, self.router.opts
        x2 = x.reshape(n, self.d)  # (n, d)
        t0 = time.perf_counter()
        r = self.router.route(P, x2, self.noise_step if self.training else None)
        r["sel"] = xp.ascontiguousarray(r["sel"])  # (n, k) its own buffer, not a view
        t1 = time.perf_counter()
        chosen = n * k if r["valid"] is None else int(r["valid"].sum())
        cap = None if self.capacity_factor is None \
            else capacity(self.capacity_factor, chosen, self.n_experts)
        plan = dispatch(r["sel"], r["valid"], self.n_experts, cap)
        xs = x2.take(plan.slots // k, axis=0)  # (A, d) rows grouped by expert
        t2 = time.perf_counter()
        counts = [int(c) for c in to_host(plan.counts)]
        out = xp.empty_like(xs)  # (A, d)
        ectx, lo = [], 0
        for expert, c in zip(self.experts, counts, strict=True):
            ctx = None
            if c:
                out[lo:lo + c], ctx = expert.forward(P, xs[lo:lo + c])
            ectx.append(ctx)
            lo += c
        t3 = time.perf_counter()
        w = r["gates"].reshape(-1).take(plan.slots)  # (A,)
        y = to_slots(out * w[:, None], plan.slots, n, k)  # (n, d)
        sctx = []
        for s in self.shared:
            ys, ctx = s.forward(P, x2)
            y += ys
            sctx.append(ctx)
        t4 = time.perf_counter()
        aux = {"switch": r.pop("aux_switch"), "z": r.pop("aux_z")}
        self.last_aux_loss = o.aux_coef * aux["switch"] + o.z_coef * aux["z"]
        ctx = {"route": r, "slots": plan.slots, "counts": counts, "out": out, "experts": ectx,
               "shared": sctx, "moe_aux": aux, "moe_aux_loss": self.last_aux_loss}
        if self.stats is not None:
            self._record(P, r, plan, counts, aux, (t0, t1, t2, t3, t4))
        return y.reshape(x.shape), ctx

    def backward(self, P, ctx, dy):
        xp = array_module(dy)
        r, slots, out, k = ctx["route"], ctx["slots"], ctx["out"], self.k
        n = r["n"]
        dy2 = dy.reshape(n, self.d)  # (n, d)
        dyr = dy2.take(slots // k, axis=0)  # (A, d)
        dgates = xp.zeros(n * k, dtype=dy.dtype)
        dgates[slots] = xp.einsum("ad,ad->a", dyr, out)  # dg_a = dy_t . out_a
        dyr *= r["gates"].reshape(-1).take(slots)[:, None]  # dout_a = g_a dy_t
        dxs, lo = xp.empty_like(dyr), 0
        for expert, c, ectx in zip(self.experts, ctx["counts"], ctx["experts"], strict=True):
            if c:
                dxs[lo:lo + c] = expert.backward(P, ectx, dyr[lo:lo + c])
            lo += c
        dx = to_slots(dxs, slots, n, k)  # (n, d)
        dx += self.router.backward(P, r, dgates.reshape(n, k), self.aux_scale)
        for s, sctx in zip(self.shared, ctx["shared"], strict=True):
            dx += s.backward(P, sctx, dy2)
        if self.router.opts.bias_rate:
            self.router.update_bias(P, self.router.load(r["sel"], r["valid"]), self.comm)
        self.noise_step += 1
        return dx.reshape(dy.shape)

    def _record(self, P, r, plan, counts, aux, t) -> None:
        n, k, N = r["n"], self.k, self.n_experts
        sel = to_host(r["sel"])
        valid = np.ones(sel.shape, bool) if r["valid"] is None else to_host(r["valid"])
        onehot = np.zeros((n, N))  # (n, N) 1 where a token chose an expert
        np.put_along_axis(onehot, sel, valid.astype(np.float64), axis=1)
        kept = np.zeros(n * k, bool)
        kept[to_host(plan.slots)] = True
        dropped_tokens = int((~kept.reshape(n, k).any(axis=1)).sum())
        bias = to_host(P[f"{self.router.name}.bias"]) if self.router.opts.bias_rate else None
        self.stats.record(
            times={"router": t[1] - t[0], "dispatch": t[2] - t[1], "compute": t[3] - t[2],
                   "combine": t[4] - t[3]},
            load=to_host(plan.load), kept=np.array(counts), dropped_tokens=dropped_tokens,
            entropy=entropy(r["p"]), experts_per_token=float(valid.sum(axis=1).mean()),
            coselect=onehot.T @ onehot, bias=bias, aux=aux)


def moe_layers(module: Module) -> list[MoE]:
    """The MoE layers inside `module` (through Sequential, Residual and Recompute), in
    forward order: where a trainer finds each layer's `stats`."""
    if isinstance(module, MoE):
        return [module]
    inner = getattr(module, "modules", None) or [
        getattr(module, a) for a in ("branch", "module") if hasattr(module, a)]
    return [m for child in inner for m in moe_layers(child)]


def moe_aux_loss(ctx) -> float:
    """Sum of coefficient x balancing term over the MoE layers found in a forward context
    (the figure to add to the reported loss; their gradients are already in backward)."""
    total, stack = 0.0, [ctx]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if "moe_aux_loss" in node:
                total += node["moe_aux_loss"]
            stack.extend(node.values())
        elif isinstance(node, (tuple, list)):
            stack.extend(node)
    return total
