"""The Mixture-of-Experts router: logits, noise, expert choice, gates, balancing terms.

For n token rows x (n, d) and N experts (Shazeer et al. 2017; Fedus et al. 2021):

    z = x Wr                              (n, N) logits, Wr (d, N), no bias
    z <- z + tau eps  (training only)     eps ~ Gumbel(0, 1) ("gumbel") or U(-1, 1) ("jitter"),
                                          drawn from (seed, layer name, noise step, token
                                          group): deterministic, the same for a group's
                                          rows on any number of ranks
    p = softmax(z)                        (n, N)
    choice by s = p + b                   b: per-expert bias used for the choice only
                                          (auxiliary-loss-free balancing, DeepSeek-V3 2024)
      top-k: the k largest s (k in 1..N)
      dynamic: in that order, the fewest experts whose mass of p reaches p_min,
               at most k_max (top-p routing, Huang et al. 2024)
    gates g_j = p_(e_j) / S,  S = sum over the chosen of p     (renormalised)

Balancing terms, each reported on its own and added to the router's gradient times
its coefficient by the MoE layer's backward:

    Switch (Fedus et al. 2021, eq. 4): L_aux = N sum_e f_e P_e,
        f_e = share of the chosen (token, expert) pairs going to e (constant), P_e = mean_t p_te
        dL_aux/dp_te = N f_e / n
      with G token groups (the rows split into G equal contiguous groups, as G data-parallel
      ranks each see their own; GShard's groups) the mean over groups of each group's
      L_aux, so dL_aux/dp_te = N f_ge / (n_g G) for t in group g
    router z-loss (Zoph et al. 2022, eq. 5): L_z = mean_t (logsumexp_e z_te)^2
        dL_z/dz_te = 2 lse_t p_te / n
    bias: after each backward, b_e += rate sign(mean_e' load_e' - load_e), load_e the pairs
        choosing e (summed over a communicator's ranks when one is given)

Backward from the gates' gradient dg (n, k) to the logits:

    dp_(e_j) = (dg_j - sum_i dg_i g_i) / S            (through the renormalisation)
    dz = p (dp - sum_e dp_e p_e)                       (through the softmax)
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import numpy as np

from dtlab.models.backend import array_module
from dtlab.models.comm import Comm
from dtlab.models.params import ParamSpec

NOISES = ("none", "jitter", "gumbel")


@dataclass(frozen=True)
class RouterOptions:
    """How a router chooses; see the module docstring for the formulas."""

    n_experts: int
    top_k: int = 2
    dynamic_p: float = 0.0  # 0: fixed top-k; else the mass to reach, at most k_max experts
    k_max: int = 0  # 0: top_k
    noise: str = "none"
    temperature: float = 1.0
    aux_coef: float = 0.0
    z_coef: float = 0.0
    bias_rate: float = 0.0
    seed: int = 0

    def __post_init__(self):
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k {self.top_k} must be in 1..{self.n_experts}")
        if not 0 <= self.dynamic_p <= 1:
            raise ValueError(f"dynamic_p {self.dynamic_p} must be in [0, 1]")
        if not 0 <= self.k_max <= self.n_experts:
            raise ValueError(f"k_max {self.k_max} must be in 0..{self.n_experts}")
        if self.noise not in NOISES:
            raise ValueError(f"noise {self.noise!r} must be one of {', '.join(NOISES)}")
        if self.temperature <= 0:
            raise ValueError(f"temperature {self.temperature} must be positive")

    @property
    def slots(self) -> int:
        """Experts a token may use: k, or k_max with dynamic routing."""
        return (self.k_max or self.top_k) if self.dynamic_p else self.top_k


class Router:
    """The linear router of MoE layer `name`: parameters `{name}.router.W` (d, N) and,
    with bias balancing, `{name}.router.bias` (N,) (no gradient; nudged in update_bias)."""

    def __init__(self, name: str, d: int, opts: RouterOptions, std: float = 0.02):
        self.name, self.d, self.opts, self.std = f"{name}.router", d, opts, std
        self.key = zlib.crc32(name.encode())

    def specs(self) -> list[ParamSpec]:
        N = self.opts.n_experts
        out = [ParamSpec(f"{self.name}.W", (self.d, N), std=self.std)]
        if self.opts.bias_rate:
            out.append(ParamSpec(f"{self.name}.bias", (N,), init="zeros", decay=False))
        return out

    def noise(self, shape, dtype, step: int, xp, groups: int = 1, group: int = 0):
        """tau eps for noise step `step`, the same on every call with that step: the rows
        of shape (n, N) in `groups` equal groups numbered from `group`, each drawn from
        (seed, layer, step, its number) (group 0 from (seed, layer, step))."""
        n, N = shape
        eps = []
        for g in range(group, group + groups):
            rng = np.random.default_rng([self.opts.seed, self.key, step, *([g] if g else [])])
            size = (n // groups, N)
            eps.append(rng.gumbel(size=size) if self.opts.noise == "gumbel"
                       else rng.uniform(-1.0, 1.0, size=size))
        return xp.asarray(np.concatenate(eps) * self.opts.temperature, dtype=dtype)

    def route(self, P, x2, noise_step: int | None, groups: int = 1, group: int = 0) -> dict:
        """Choose experts for rows x2 (n, d); noise_step None: no noise (evaluation).
        `groups`: the rows' token groups (the Switch term per group), numbered from `group`
        (the noise's seed).

        Returns the routing: x (n, d), p (n, N), lse (n,), sel (n, slots) expert ids in
        choice order, valid (n, slots) bool or None (fixed k: all valid), gates (n, slots)
        (0 where not valid), and the balancing terms' values aux_switch, aux_z.
        """
        xp = array_module(x2)
        o, n = self.opts, x2.shape[0]
        z = x2 @ P[f"{self.name}.W"]  # (n, N)
        if o.noise != "none" and noise_step is not None:
            z += self.noise(z.shape, z.dtype, noise_step, xp, groups, group)
        lse = z.max(axis=1)  # (n,)
        z -= lse[:, None]
        p = xp.exp(z, out=z)  # (n, N) unnormalised, in z's buffer
        total = p.sum(axis=1)  # (n,)
        p /= total[:, None]
        lse += xp.log(total)  # logsumexp of the (noisy) logits
        score = p + P[f"{self.name}.bias"] if o.bias_rate else p
        k = o.slots
        sel = xp.argsort(-score, axis=1, kind="stable")[:, :k]  # (n, k) best first
        chosen = xp.take_along_axis(p, sel, axis=1)  # (n, k)
        valid = None
        if o.dynamic_p:
            before = xp.cumsum(chosen, axis=1) - chosen  # mass of the better-ranked ones
            valid = before < o.dynamic_p  # (n, k): slot 0 always, then until the mass is reached
            chosen *= valid
        gates = chosen / chosen.sum(axis=1, keepdims=True)  # (n, k) renormalised
        f = self.shares(sel, valid, groups)  # (G, N)
        P_mean = p.reshape(groups, n // groups, -1).mean(axis=1)  # (G, N)
        aux_switch = o.n_experts * float((f * P_mean).sum()) / groups
        aux_z = float((lse * lse).mean())
        return {"x": x2, "p": p, "lse": lse, "sel": sel, "valid": valid, "gates": gates,
                "aux_switch": aux_switch, "aux_z": aux_z, "n": n, "groups": groups}

    def shares(self, sel, valid, groups: int):
        """(G, N) f_ge: each group's share of its chosen pairs going to each expert."""
        xp = array_module(sel)
        n = sel.shape[0] // groups
        loads = [self.load(sel[g * n:(g + 1) * n],
                           None if valid is None else valid[g * n:(g + 1) * n])
                 for g in range(groups)]
        load = xp.stack(loads)  # (G, N)
        return load / load.sum(axis=1, keepdims=True)

    def load(self, sel, valid):
        """(N,) float: (token, expert) pairs choosing each expert, before any drop."""
        xp = array_module(sel)
        chosen = sel.reshape(-1) if valid is None else sel[valid]
        return xp.bincount(chosen, minlength=self.opts.n_experts).astype(np.float64)

    def backward(self, P, r: dict, dgates, aux_scale: float = 1.0):
        """Gradient of the loss to the router's input, given dgates (n, k); adds dWr into
        P.grads, and aux_scale x (coefficient x gradient) of each balancing term."""
        xp = array_module(dgates)
        o, p, sel, gates, valid = self.opts, r["p"], r["sel"], r["gates"], r["valid"]
        n = r["n"]
        chosen = xp.take_along_axis(p, sel, axis=1)  # (n, k)
        if valid is not None:
            chosen *= valid
        S = chosen.sum(axis=1, keepdims=True)  # (n, 1)
        dchosen = dgates - xp.einsum("tk,tk->t", dgates, gates)[:, None]
        dchosen /= S
        if valid is not None:
            dchosen *= valid
        dp = xp.zeros_like(p)  # (n, N)
        dp[xp.arange(n)[:, None], sel] = dchosen  # the chosen of a row are distinct
        if o.aux_coef:
            G = r["groups"]
            f = self.shares(sel, valid, G).astype(p.dtype)  # (G, N)
            dp.reshape(G, n // G, -1)[...] += (aux_scale * o.aux_coef * o.n_experts
                                               / n) * f[:, None, :]
        dz = dp
        dz -= xp.einsum("te,te->t", dp, p)[:, None]
        dz *= p  # (n, N) through the softmax
        if o.z_coef:
            dz += (2 * aux_scale * o.z_coef / n) * r["lse"][:, None] * p
        W = P[f"{self.name}.W"]
        P.grads[f"{self.name}.W"] += r["x"].T @ dz  # (d, N)
        return dz @ W.T  # (n, d)

    def update_bias(self, P, load, comm: Comm | None) -> None:
        """b_e += rate sign(mean load - load_e); `load` (N,) summed over `comm` first
        (FlatParams.nudge: on a mixed-precision half copy, to the float32 master's bias)."""
        if comm is not None:
            comm.allreduce(load)
        xp = array_module(load)
        P.nudge(f"{self.name}.bias", xp.sign(load.mean() - load) * self.opts.bias_rate)  # (N,)


def entropy(p) -> float:
    """Mean over rows of -sum_e p log p, in nats (0 log 0 = 0)."""
    xp = array_module(p)
    logp = xp.log(xp.maximum(p, np.finfo(p.dtype).tiny))
    return float(-xp.einsum("te,te->", p, logp) / max(p.shape[0], 1))


def capacity(factor: float, assigned: int, n_experts: int) -> int:
    """Rows one expert takes: ceil(factor x assigned pairs / N) (Fedus et al. 2021, eq. 3)."""
    return math.ceil(factor * assigned / n_experts)
