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
takes for expert parallelism (models/moe_ep.py): with `ep` the layer holds the experts
`ep.owned(N)` only (parameters named per expert, `h0.moe.e3.w1`, marked split "ep"), and
between dispatch and compute the rows go to their experts' ranks, and back between compute
and combine (forward and backward).

Token groups and capacity. Capacity applies per token group, as in GShard: a layer with
`groups` G splits its n rows into G equal contiguous groups and dispatches each on its
own (C_g = ceil(factor A_g / N)), the Switch term being the mean over groups
(models/router.py). Under expert parallelism every rank is one group (its own tokens), so
e ranks of n rows each compute exactly what one process with G = e computes on their
n e rows concatenated in rank order: the single-process twin of an ep run. The rows of an
expert are the groups' rows for it in group order, on one rank as across ranks.

Tensor-split experts (`tp`, Megatron-LM's split applied to each expert, as Megatron-Core's
expert tensor parallelism does): the tokens, the router and the dispatch are replicated
over the tp ranks; each expert holds its columns of the first linear layer(s) and the
matching rows of the last, so every rank computes a partial out_a (A, d) on the same rows.
The combine is linear in out, so the partial outputs are combined first and summed over
tp once per layer (g on (n, d) rather than on the k-times larger rows); in backward the
gate gradients dg_a = dy_t . out_a need the whole out_a, so their partial sums (n k
scalars) are summed over tp, and dx is summed over tp (f) before the router's dx, which
every rank computes whole, is added.

Backward: dout_a = g_a dy_t; dg_a = dy_t . out_a; the experts' backward on their rows;
dx_t = sum of the rows' dx back in their slots + the router's dx (models/router.py, which
adds the balancing terms' gradients); then the bias nudge (when enabled) and the noise step
advance. The context is a dict: its arrays are what models/memory.py measures and
models/parts.py's moe_ffn predicts.
"""

from __future__ import annotations

import dataclasses
import time
from typing import NamedTuple

import numpy as np

from dtlab.models.backend import array_module, to_host
from dtlab.models.comm import Comm
from dtlab.models.layers import GELU, Linear, Module, Sequential, SwiGLU
from dtlab.models.moe_ep import ExpertParallel, source_to_expert
from dtlab.models.moe_stats import MoEStats
from dtlab.models.router import Router, RouterOptions, capacity, entropy
from dtlab.models.tensor_parallel import (
    SPLIT,
    ColumnParallelLinear,
    ParallelSwiGLU,
    RowParallelLinear,
    f_backward,
    g_forward,
)


def expert_ffn(kind: str, name: str, d: int, d_ff: int, out_std: float = 0.02,
               tp: Comm | None = None) -> Module:
    """One expert: SwiGLU (`name.w1/w3/w2`) or Linear-GELU-Linear (`name.fc/proj`); with
    `tp` split by columns then rows, its output and input gradient left partial (the MoE
    layer reduces them once for all experts)."""
    if tp is not None:
        if kind == "swiglu":
            return ParallelSwiGLU(name, d, d_ff, tp, out_std=out_std, reduce=False)
        return Sequential([
            ColumnParallelLinear(f"{name}.fc", d, d_ff, tp, reduce_input_grad=False), GELU(),
            RowParallelLinear(f"{name}.proj", d_ff, d, tp, std=out_std, reduce_output=False)])
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


def dispatch_groups(sel, valid, n_experts: int, factor: float | None, groups: int) -> Dispatch:
    """dispatch() on each of `groups` equal contiguous groups of the rows of sel (n, k),
    with each group's own capacity (None: dropless); the rows grouped by expert, each
    expert's rows in group order."""
    xp = array_module(sel)
    n, k = sel.shape
    m = n // groups
    slots, counts, load = [], [], 0
    for g in range(groups):
        gsel = sel[g * m:(g + 1) * m]
        gvalid = None if valid is None else valid[g * m:(g + 1) * m]
        chosen = gsel.size if gvalid is None else int(gvalid.sum())
        cap = None if factor is None else capacity(factor, chosen, n_experts)
        d = dispatch(gsel, gvalid, n_experts, cap)
        slots.append(d.slots + g * m * k)
        counts.append(to_host(d.counts))
        load = load + d.load
    if groups == 1:
        return Dispatch(slots[0], d.counts, d.load)
    order = xp.asarray(source_to_expert(np.stack(counts)))  # group-major -> expert-major
    return Dispatch(xp.concatenate(slots)[order], xp.asarray(np.sum(counts, axis=0)), load)


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
    `ep`: the expert-parallel group (models/moe_ep.py; None: every expert here); the layer
    then holds `ep.owned(N)`, which `experts` (default: those) must equal. `tp`: the
    tensor-parallel group the experts are split over (None: whole). `groups`: token
    groups (capacity and Switch term per group; an ep rank is one group). `stats`: the
    MoEStats each forward fills (None: none kept). Attributes the caller may set:
    `training` (False: no router noise), `groups`, `aux_scale` (multiplies the balancing
    terms' gradients; set it to the loss's scale under gradient accumulation),
    `noise_step` (advances by one per backward). After each
    forward `last_aux_loss` holds the balancing terms times their coefficients (also in
    the context as `moe_aux_loss`; Recompute keeps no context). It is not in the loss a
    Model reports (Model.forward returns the cross-entropy only); its gradient is in
    backward. `take_aux_loss()` gives the mean of that term over the backward passes
    since it was last called: under gradient accumulation the micro-batches of one
    step, whose mean the balancing gradient follows (what each step's metrics record
    logs as `moe_aux_loss`, models/run/moe_report.py).
    """

    def __init__(self, name: str, d: int, d_ff: int, router: RouterOptions, kind: str = "gelu",
                 capacity_factor: float | None = 1.25, shared: int = 0, out_std: float = 0.02,
                 comm: Comm | None = None, experts: range | None = None,
                 stats: MoEStats | None = None, ep: ExpertParallel | None = None,
                 groups: int = 1, tp: Comm | None = None):
        N = router.n_experts
        if capacity_factor is not None and capacity_factor <= 0:
            raise ValueError(f"{name}: capacity factor {capacity_factor} must be positive")
        if groups < 1:
            raise ValueError(f"{name}: groups {groups} must be at least 1")
        held = range(N) if ep is None else ep.owned(N)
        self.owned = held if experts is None else experts
        if self.owned != held:
            raise ValueError(f"{name}: experts={self.owned} of {N}, but "
                             + ("a subset needs an ep group to reach the others by "
                                "all-to-all (ep=ExpertParallel)" if ep is None
                                else f"ep rank {ep.comm.rank} of {ep.comm.size} holds {held}"))
        self.ep, self.groups, self.tp = ep, groups, tp
        self.name, self.d, self.n_experts, self.k = name, d, N, router.slots
        self.capacity_factor, self.comm, self.stats = capacity_factor, comm, stats
        self.router = Router(name, d, router)
        self.experts = [expert_ffn(kind, f"{name}.e{e}", d, d_ff, out_std, tp)
                        for e in self.owned]
        self.shared = [expert_ffn(kind, f"{name}.s{s}", d, d_ff, out_std, tp)
                       for s in range(shared)]
        self.training, self.aux_scale, self.noise_step = True, 1.0, 0
        self.last_aux_loss = 0.0  # coefficient x balancing terms of the latest forward
        self._aux_sum, self._aux_backwards = 0.0, 0  # of the backwards since take_aux_loss

    def specs(self):
        experts = [s for m in self.experts for s in m.specs()]
        if self.ep is not None:  # expert gradients average over dp only (models/model.py)
            experts = [dataclasses.replace(s, split="ep+tp" if s.split == SPLIT else "ep")
                       for s in experts]
        return self.router.specs() + experts + [s for m in self.shared for s in m.specs()]

    def forward(self, P, x):
        xp = array_module(x)
        n, k, o = x.size // self.d, self.k, self.router.opts
        if n % self.groups:
            raise ValueError(f"{self.name}: {n} token rows are not divisible into "
                             f"{self.groups} groups")
        x2 = x.reshape(n, self.d)  # (n, d)
        t0 = time.perf_counter()
        group = 0 if self.ep is None else self.ep.group
        r = self.router.route(P, x2, self.noise_step if self.training else None,
                              self.groups, group)
        r["sel"] = xp.ascontiguousarray(r["sel"])  # (n, k) its own buffer, not a view
        t1 = time.perf_counter()
        plan = dispatch_groups(r["sel"], r["valid"], self.n_experts, self.capacity_factor,
                               self.groups)
        xs = x2.take(plan.slots // k, axis=0)  # (A, d) rows grouped by expert
        t2 = time.perf_counter()
        counts = [int(c) for c in to_host(plan.counts)]
        if self.ep is None:
            ectx = [None]
            out = self._experts_forward(P, ectx, 0, xs, counts)
            chunks = None
        else:
            chunks = self.ep.plan(counts, xp)
            ectx = [None] * len(chunks)
            out = self.ep.run(chunks, xs, lambda c, rows, cc:
                              self._experts_forward(P, ectx, c, rows, cc))
        t3 = time.perf_counter()
        w = r["gates"].reshape(-1).take(plan.slots)  # (A,)
        y = to_slots(out * w[:, None], plan.slots, n, k)  # (n, d)
        sctx = []
        for s in self.shared:
            ys, ctx = s.forward(P, x2)
            y += ys
            sctx.append(ctx)
        if self.tp is not None:
            g_forward(self.tp, y)  # the partial outputs of every expert, summed once
        t4 = time.perf_counter()
        aux = {"switch": r.pop("aux_switch"), "z": r.pop("aux_z")}
        self.last_aux_loss = o.aux_coef * aux["switch"] + o.z_coef * aux["z"]
        ctx = {"route": r, "slots": plan.slots, "counts": counts, "chunks": chunks, "out": out,
               "experts": ectx, "shared": sctx, "moe_aux": aux,
               "moe_aux_loss": self.last_aux_loss}
        if self.stats is not None:
            self._record(P, r, plan, counts, aux, (t0, t1, t2, t3, t4))
        return y.reshape(x.shape), ctx

    def _experts_forward(self, P, ectx: list, c: int, xs, counts: list[int]):
        """The held experts on their contiguous rows of xs (A, d); contexts into ectx[c]."""
        out = array_module(xs).empty_like(xs)  # (A, d)
        ectx[c], lo = [], 0
        for expert, n in zip(self.experts, counts, strict=True):
            ctx = None
            if n:
                out[lo:lo + n], ctx = expert.forward(P, xs[lo:lo + n])
            ectx[c].append(ctx)
            lo += n
        return out

    def _experts_backward(self, P, ectx: list, dyr, counts: list[int]):
        """dx of the held experts' rows from their output gradients dyr (A, d)."""
        dxs, lo = array_module(dyr).empty_like(dyr), 0  # (A, d)
        for expert, n, ctx in zip(self.experts, counts, ectx, strict=True):
            if n:
                dxs[lo:lo + n] = expert.backward(P, ctx, dyr[lo:lo + n])
            lo += n
        return dxs

    def take_aux_loss(self) -> float:
        """The mean of coefficient x balancing terms over the backward passes since the
        last call (each the forward whose context it used: a recomputed forward is not
        counted twice), then reset; the latest forward's if no backward ran since."""
        if not self._aux_backwards:
            return self.last_aux_loss
        mean = self._aux_sum / self._aux_backwards
        self._aux_sum, self._aux_backwards = 0.0, 0
        return mean

    def backward(self, P, ctx, dy):
        xp = array_module(dy)
        r, slots, out, k = ctx["route"], ctx["slots"], ctx["out"], self.k
        self._aux_sum += ctx["moe_aux_loss"]
        self._aux_backwards += 1
        n = r["n"]
        dy2 = dy.reshape(n, self.d)  # (n, d)
        dyr = dy2.take(slots // k, axis=0)  # (A, d)
        dgates = xp.zeros(n * k, dtype=dy.dtype)
        dgates[slots] = xp.einsum("ad,ad->a", dyr, out)  # dg_a = dy_t . out_a
        if self.tp is not None:
            self.tp.allreduce(dgates)  # out_a was this rank's partial sum
        dyr *= r["gates"].reshape(-1).take(slots)[:, None]  # dout_a = g_a dy_t
        ectx = ctx["experts"]
        if ctx["chunks"] is None:
            dxs = self._experts_backward(P, ectx[0], dyr, ctx["counts"])
        else:
            dxs = self.ep.run(ctx["chunks"], dyr, lambda c, rows, cc:
                              self._experts_backward(P, ectx[c], rows, cc))
        dx = to_slots(dxs, slots, n, k)  # (n, d)
        for s, sctx in zip(self.shared, ctx["shared"], strict=True):
            dx += s.backward(P, sctx, dy2)
        if self.tp is not None:
            dx = f_backward(self.tp, dx)  # the experts' partial dx, summed once
        dx += self.router.backward(P, r, dgates.reshape(n, k), self.aux_scale)
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
