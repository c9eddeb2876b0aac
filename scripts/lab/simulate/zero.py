"""ZeRO at scale (dtlab-simulate --zero S): each stage's step time and per-rank memory.

    dtlab-simulate --link 400gbit --intra-link nvlink --gpus-per-node 8 --tflops 400 \
        --zero 1,2,3

Communication (Rajbhandari et al. 2020, "ZeRO", section 7). collective/zero*.py cuts the
parameters into units (each body module holding parameters: the embedding, a block, the
head; models/parts.py's modules) and runs each unit's collectives on our flat ring over
the N dp ranks (predicted across nodes in two levels, below): a reduce-scatter of a
unit's n_u bytes and an all-gather of them cost (alpha, beta, gamma as in
simulate/formulas.py)

    rs(n_u) = (N-1) alpha + (N-1)/N n_u (beta + gamma)
    ag(n_u) = (N-1) alpha + (N-1)/N n_u beta

so RS = sum rs(n_u) and AG = sum ag(n_u) move the ring all-reduce's bytes (with one unit
they are exactly formulas.terms("ring")): stages 1 and 2 send what plain data
parallelism sends, 2(N-1)/N Psi; stage 3 gathers the parameters twice (before forward
and again before backward), 3(N-1)/N Psi, the paper's 1.5x. The reduce-scatters move the
gradient's wire bytes and the gathers the parameters' compute bytes (simulate/precision.py:
2 each under --precision fp16|bf16; with --wire bf16 over float32, 2 and 4). On one
node the ring goes at the intra-node link, on a calibrated host at its ring fit. Across
M nodes of G ranks (collective_s) a collective goes in two levels, as the all-reduce
does (formulas.sync_allreduce_s) and NCCL's rings do (each of its G channels crosses a
node boundary once, so a node's NICs carry n / G a rank): a reduce-scatter is one over
the G ranks of the node of n bytes and one over the M nodes of n / G bytes, each rank
on its NIC (shared by G / K ranks where a node has K < G), an all-gather the reverse:

    rs(n) = rs_G(n; intra) + (G / K) rs_M(n / G; inter)

the same bytes a rank as the flat ring ((G-1)/G n + (M-1)/M n / G = (N-1)/N n), at
the intra-node link for most of them. With one rank a node (G = 1) it is the flat ring
on the inter-node link.

Overlap, where the ranks have somewhere to communicate (step.py's rule: a GPU, or a core
of its own), with backward 2/3 of the compute (BACKWARD_SHARE; 3/4 with --recompute,
whose recomputed forward runs in backward: backward_share) and forward the rest; unit 0
is the first in forward, unit L-1 the last. As FSDP's and DeepSpeed's prefetch run it,
each unit's gather is issued while the unit before it computes (FSDP's forward and
backward prefetch, DeepSpeed's prefetch bucket), and a recomputed block uses the
parameters its backward gathered (no third gather: FSDP's pre-backward hook unshards
the unit before its checkpointed forward runs again):

    stages 1, 2  exposed = rs_0 + max(0, RS - rs_0 - backward) + AG
                 (each unit's reduce-scatter as backward finishes it, unit 0's after
                 backward ends; the all-gathers after the optimizer step)
    stage 3      exposed = ag_0 + max(0, AG - ag_0 - forward)
                         + ag_(L-1) + rs_0 + max(0, AG - ag_(L-1) + RS - rs_0 - backward)
                 (each unit's gather prefetched behind the unit before it, in forward
                 and in backward, but the first of each pass; the reduce-scatters behind
                 backward but the last)

and all of it where they have not. With k micro-batches a step (--grad-accum k), as
collective/zero/sharding.py runs them: stage 1 reduce-scatters in the last micro-batch's backward
only (as plain data parallelism, step.py), stage 2 in every micro-batch's, stage 3 also
gathers every micro-batch; backward and forward above are then one micro-batch's, and
stage 2's reduce-scatter part and all of stage 3's come k times. On a shared host every
collective takes N / cores turns, as the all-reduce does (step.sync_step).

Memory per rank: the paper's per-parameter bytes, models/cost.py zero_memory (mixed
precision with Adam, K = 12: plain DP (2 + 2 + K) Psi, stage 1 4 Psi + K Psi / N, stage 2
2 Psi + (2 + K) Psi / N, stage 3 (2 + 2 + K) Psi / N; in full precision 4 + 4 + 8 bytes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dtlab.lab.simulate.formulas import Network
from dtlab.lab.simulate.links import Link
from dtlab.lab.simulate.step import BACKWARD_SHARE, Host, Step
from dtlab.models.cost import zero_memory
from dtlab.models.zoo import MODELS

STAGES = (1, 2, 3)


@dataclass(frozen=True)
class ZeroSpec:
    """What the ZeRO columns need beyond the workload: the stages, the units' bytes (in
    forward order), the parameter count, the precision and bytes per element of the
    memory formula."""

    stages: tuple[int, ...]
    units: tuple[float, ...]
    params: int
    precision: str = "fp32"
    itemsize: int = 4  # --dtype's (8: float64) in full precision
    gather_scale: float = 1.0  # gathered parameters' bytes per element over the units'
    # (the units are at the gradient's wire bytes: --wire bf16 over float32 gathers 2)
    microbatches: int = 1  # --grad-accum
    backward_share: float = BACKWARD_SHARE  # of the compute (backward_share(config))

    def memory(self, stage: int, n: int, optimizer: str) -> dict[str, float]:
        """Bytes per rank of `stage` (0: plain data parallelism) over n ranks."""
        return zero_memory(self.params, stage, n, self.precision, optimizer, self.itemsize)


def reduce_scatter_s(nbytes: float, n: int, link: Link) -> float:
    if n == 1:
        return 0.0
    return (n - 1) * link.alpha_s + (n - 1) / n * nbytes * (link.beta_s_per_byte
                                                             + link.gamma_s_per_byte)


def allgather_s(nbytes: float, n: int, link: Link) -> float:
    if n == 1:
        return 0.0
    return (n - 1) * link.alpha_s + (n - 1) / n * nbytes * link.beta_s_per_byte


def unit_bytes(model_name: str, config, batch: int, itemsize: int) -> tuple[float, ...]:
    """Bytes of each unit, in forward order: the body modules holding parameters."""
    sizes = (sum(p.count * p.params for p in parts)
             for parts in MODELS[model_name].cost.modules(config, batch))
    return tuple(float(size * itemsize) for size in sizes if size)


def ring_link(net: Network, n: int) -> Link:
    """The link a flat ring over n ranks goes at: intra-node on one node, else inter."""
    base = net.intra if n <= net.gpus_per_node else net.inter
    return net.link("ring", base)


def collective_s(one, nbytes: float, n: int, net: Network) -> float:
    """Seconds of a reduce-scatter or all-gather (`one`: reduce_scatter_s or allgather_s)
    of nbytes over n ranks: a flat ring within a node (or on a network of one rank a
    node), else two levels (module docstring)."""
    G = min(net.gpus_per_node, n)
    nodes = math.ceil(n / G)
    if G == 1 or nodes == 1:
        return one(nbytes, n, ring_link(net, n))
    return (one(nbytes, G, net.link("ring", net.intra))
            + net.nic_share(G) * one(nbytes / G, nodes, net.link("ring", net.inter)))


def backward_share(config) -> float:
    """The share of a step's compute after the forward: 2/3 (BACKWARD_SHARE), 3/4 when
    each block's forward runs again in backward (--recompute: forward 1, recompute 1,
    backward 2)."""
    return 0.75 if getattr(config, "recompute", False) else BACKWARD_SHARE


def zero_step(stage: int, units: tuple[float, ...], n: int, net: Network, compute_s: float,
              host: Host, straggler_s: float = 0.0, gather_scale: float = 1.0,
              microbatches: int = 1, backward_share: float = BACKWARD_SHARE) -> Step:
    """One step of ZeRO `stage` over n ranks with units of these bytes and `microbatches`
    micro-batches (module docstring); straggler_s: how much later than the median the
    slowest rank ends backward (every rank waits for it); backward_share: of compute_s."""
    if stage not in STAGES:
        raise ValueError(f"ZeRO stage must be one of {STAGES}, not {stage}")
    share = host.share(n)
    rs = [collective_s(reduce_scatter_s, b, n, net) * share for b in units]  # (L,) per unit
    ag = [collective_s(allgather_s, b * gather_scale, n, net) * share for b in units]  # (L,)
    RS, AG = sum(rs), sum(ag)
    k = microbatches
    gathers = 2 * k if stage == 3 else 1  # all-gathers of the units a step
    scatters = 1 if stage == 1 else k  # reduce-scatters of the units a step
    ranks_here = min(n, net.gpus_per_node) if not host.cores else n
    overlap = host.overlap(ranks_here)
    backward = backward_share * compute_s / k  # one micro-batch's
    forward = compute_s / k - backward
    if not overlap:
        exposed = scatters * RS + gathers * AG
    elif stage == 3:
        exposed = k * (ag[0] + max(0.0, AG - ag[0] - forward)
                       + ag[-1] + rs[0] + max(0.0, AG - ag[-1] + RS - rs[0] - backward))
    else:
        exposed = scatters * (rs[0] + max(0.0, RS - rs[0] - backward)) + AG
    sent = (scatters + gathers * gather_scale) * (n - 1) / n * sum(units)
    return Step(f"zero{stage}", n, compute_s, straggler_s + exposed, "ring",
                {"reduce_scatter_s": scatters * RS, "allgather_s": gathers * AG,
                 "sent_bytes": sent, "straggler_s": straggler_s, "overlap": overlap})


def zero_columns(spec: ZeroSpec, optimizer: str, n: int, net: Network, compute_s: float,
                 host: Host, straggler_s: float) -> dict:
    """A prediction row's ZeRO entries: "dp_memory" (plain data parallelism's bytes per
    rank) and "zero<S>" for each stage: comm_s, step_s, its collectives, memory."""
    out = {"dp_memory": spec.memory(0, n, optimizer)}
    for stage in spec.stages:
        s = zero_step(stage, spec.units, n, net, compute_s, host, straggler_s,
                      spec.gather_scale, spec.microbatches, spec.backward_share)
        out[f"zero{stage}"] = {"comm_s": s.comm_s, "step_s": s.step_s, **s.parts,
                               "memory": spec.memory(stage, n, optimizer)}
    return out
