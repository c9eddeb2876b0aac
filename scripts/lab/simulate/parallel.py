"""One step of a dp x pp x ep x tp layout: the pipeline's replay plus the gradient all-reduce.

    step = pipeline makespan (simulate/pipeline.py: the schedule's op lists replayed
           with each stage's passes and receives)
         + the straggler wait (step.ComputeRate.straggler_s)
         + the exposed gradient all-reduce
         + the update: once-a-step work (the optimizer) on the rank's parameters

A stage's passes per micro-batch are its FLOPs over t (tensor-split) at the compute
rate, plus the communication inside them: tp's all-reduces (simulate/tensor.py)
and the MoE layers' all-to-alls (simulate/moe.py) on the forward and on the input
gradient pass. The compute rate is seconds per FLOP of the whole model's forward and
backward of one micro-batch (measured, or a calibrated fit's rate, or 1 / --tflops),
so the work models/cost.py does not count (elementwise layers) is charged in
proportion; the once-a-step work (the optimizer; a fit's per-step overhead t0) is
charged once, to each rank in proportion to the parameters it holds.

Gradient all-reduce (collective/train.py): a rank's dense parameters (its stage, over
t) are averaged over dp x ep, its experts' (over ep and t) over dp, after the
schedule's flush when pp > 1 (a pipeline's gradients are final only then). With
pp = 1 the dense buckets overlap the last micro-batch's backward as in step.sync_step
(dtlab-sync starts the reducer in the last micro-batch only: 2/3 of compute / m), or
none of them with --grad-reduce-after (Work.overlapped); the experts' range (laid out
last, reduced over another communicator) is counted exposed.

Bytes per element by tensor class (simulate/precision.py, from --dtype, --precision and
--wire): tp's all-reduces and the pipeline's sends at `Precision.tp` / `.p2p`, the
gradient all-reduce at `.gradient`. With sequence parallelism or Megatron's
scatter-gather optimisation (Narayanan et al. 2021, section 4.1), each tp rank sends
only its 1/t of an activation between stages (the next stage all-gathers it over its tp
ranks on the intra-node link, counted in its receive); without, every tp rank sends the
whole activation.

Placement: ranks are numbered dp x pp x ep x tp, tp fastest (collective/grid.py),
G to a node. A group whose span (its stride times its size) fits in G runs on the
intra-node link, else on the inter-node one (the slowest hop sets a pipeline's and
an all-to-all's pace); a data-parallel group has max(1, G / stride) of its ranks on
each node, which sets its two-level all-reduce.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from dtlab.lab.simulate import moe, pipeline, tensor
from dtlab.lab.simulate.formulas import Network, bucketed_allreduce_s
from dtlab.lab.simulate.links import Link
from dtlab.lab.simulate.precision import Precision
from dtlab.lab.simulate.step import BACKWARD_SHARE, Host
from dtlab.models.config import ConfigError
from dtlab.models.schedule import make

DIMS = ("tp", "ep", "pp", "dp")  # fastest first


@dataclass(frozen=True)
class Layout:
    dp: int = 1
    pp: int = 1
    ep: int = 1
    tp: int = 1

    @property
    def ranks(self) -> int:
        return self.dp * self.pp * self.ep * self.tp

    @property
    def model_parallel(self) -> int:
        return self.pp * self.ep * self.tp

    def stride(self, dim: str) -> int:
        out = 1
        for d in DIMS[:DIMS.index(dim)]:
            out *= getattr(self, d)
        return out

    def span(self, dim: str) -> int:
        return self.stride(dim) * getattr(self, dim)

    def per_node(self, dims: tuple[str, ...], G: int) -> int:
        """Ranks of one group over `dims` on one node of G ranks."""
        out = 1
        for d in dims:
            out *= min(getattr(self, d), max(1, G // self.stride(d)))
        return out


@dataclass(frozen=True)
class Fabric:
    """The links: `net` the all-reduce's (per algorithm on a calibrated host); point to
    point by `p2p` and all-to-all by `alltoall` (a calibrated host's fits), else by the
    intra- or inter-node link; `one_host`: every rank on one host (shared memory)."""

    net: Network
    p2p: Link | None = None
    alltoall: Link | None = None
    one_host: bool = False

    def by_span(self, span: int) -> Link:
        return self.net.intra if span <= self.net.gpus_per_node else self.net.inter

    def point_to_point(self, span: int) -> Link:
        return self.p2p or self.by_span(span)

    def exchange(self, span: int) -> Link:
        return self.alltoall or self.by_span(span)

    def group(self, per_node: int) -> Network:
        """The network of a group with `per_node` ranks on each node; the node's GPUs
        all run their groups' collectives at once, so each still shares its NIC with
        G / K others (formulas.Network.nic_share)."""
        net, K = self.net, self.net.nics_per_node
        return replace(net, gpus_per_node=per_node,
                       nics_per_node=per_node * K / net.gpus_per_node if K else 0)


@dataclass(frozen=True)
class Work:
    """What the layout's step computes: the model, its micro-batch and schedule."""

    model: str
    config: object  # the model config (TransformerConfig, MLPConfig)
    batch: int  # samples per micro-batch on a rank
    microbatches: int
    schedule: str
    itemsize: int
    bounds: tuple[int, ...]  # stage s: body modules [bounds[s], bounds[s + 1])
    flops_microbatch: float  # the whole model's step of one micro-batch (models/cost.py)
    precision: Precision | None = None  # bytes per tensor class (None: all `itemsize`)
    scatter_gather: bool = False  # each tp rank sends 1/t of an activation between stages
    virtual: int | None = None  # the interleaved schedule's model chunks per rank
    overlapped: bool = True  # False: pp 1's all-reduce after the last backward

    @property
    def tp_bytes(self) -> int:
        return self.precision.tp if self.precision else self.itemsize

    @property
    def p2p_bytes(self) -> int:
        return self.precision.p2p if self.precision else self.itemsize

    @property
    def grad_bytes(self) -> int:
        return self.precision.gradient if self.precision else self.itemsize

    @property
    def stages(self) -> int:
        return len(self.bounds) - 1

    def stage_parts(self) -> list[list]:
        groups = pipeline.module_groups(self.model, self.config, self.batch)
        return [[q for g in groups[lo:hi] for q in g]
                for lo, hi in zip(self.bounds, self.bounds[1:], strict=False)]


def check(work: Work, layout: Layout) -> None:
    """ConfigError naming a layout the model cannot take."""
    c = work.config
    experts = getattr(c, "moe_experts", 0)
    if layout.tp > 1 and work.model != "transformer":
        raise ConfigError(f"--tp {layout.tp}: the simulation models the transformer's "
                          "Megatron split only (--model transformer)")
    if layout.ep > 1 and not experts:
        raise ConfigError(f"--ep {layout.ep} needs a model with experts (--model transformer "
                          "--moe-experts N)")
    if layout.ep > 1 and experts % layout.ep:
        raise ConfigError(f"--moe-experts {experts} is not divisible by --ep {layout.ep}")


def stage_seconds(work: Work, layout: Layout, fabric: Fabric, s_per_flop: float,
                  share: float) -> tuple[list[dict], list[dict]]:
    """(per stage {F, B, W} seconds of one micro-batch, per stage {tp, a2a} seconds of it)."""
    t, e = layout.tp, layout.ep
    flops = pipeline.stage_flops(work.model, work.config, work.batch, list(work.bounds))
    tp_net = fabric.group(t)
    a2a_link = fabric.exchange(layout.span("ep"))
    times, comm = [], []
    for f, parts in zip(flops, work.stage_parts(), strict=True):
        msgs = tensor.stage_messages(parts, work.config, work.batch, t, work.tp_bytes)
        tp_f, tp_b = tensor.stage_tp_s(msgs, t, tp_net, fabric.one_host)
        layers = sum(p.count for p in parts if moe.is_moe(p))
        a2a_f, a2a_b = moe.layer_alltoall_s(work.config, work.batch, work.tp_bytes, e,
                                            a2a_link) if layers else (0.0, 0.0)
        times.append({"F": share * (f["F"] / t * s_per_flop + tp_f + layers * a2a_f),
                      "B": share * (f["B"] / t * s_per_flop + tp_b + layers * a2a_b),
                      "W": share * f["W"] / t * s_per_flop})
        comm.append({"tp": share * (tp_f + tp_b), "a2a": share * layers * (a2a_f + a2a_b)})
    return times, comm


def gradient_bytes(work: Work, layout: Layout) -> list[tuple[float, float]]:
    """Per stage, (dense, expert) gradient bytes one rank all-reduces."""
    out = []
    for parts in work.stage_parts():
        experts = sum(p.count * moe.expert_params(work.config, p) for p in parts)
        dense = sum(p.count * p.params for p in parts) - experts
        out.append((dense / layout.tp * work.grad_bytes,
                    experts / (layout.ep * layout.tp) * work.grad_bytes))
    return out


def stage_p2p(work: Work, layout: Layout, fabric: Fabric) -> pipeline.P2P:
    """One micro-batch's receives between stages: the whole activation from every tp
    rank, or with scatter-gather 1/t of it and an all-gather over the tp ranks."""
    if layout.pp == 1:
        return pipeline.FREE
    link = fabric.point_to_point(layout.span("pp"))
    whole = pipeline.activation_bytes(work.config, work.batch, work.p2p_bytes)
    if not (work.scatter_gather and layout.tp > 1):
        return pipeline.P2P.over(link, whole)
    t = layout.tp
    sent = pipeline.P2P.over(link, whole // t)
    gather = tensor.allgather_s(whole, t, fabric.net.link("ring", fabric.net.intra))
    return pipeline.P2P(sent.activation_s + gather, sent.gradient_s + gather, whole // t)


def parallel_step(work: Work, layout: Layout, fabric: Fabric, s_per_flop: float, host: Host,
                  bucket_bytes: float, straggler_s: float = 0.0, update_s: float = 0.0) -> dict:
    """The step of `layout` (see the module docstring), its parts in seconds; `update_s`:
    the whole model's once-a-step work (the optimizer), a rank doing its parameters'
    share of it after the all-reduce."""
    n = layout.ranks
    share = host.share(n)
    times, comm = stage_seconds(work, layout, fabric, s_per_flop, share)
    ops = make(work.schedule, layout.pp, work.microbatches, work.virtual)
    p2p = stage_p2p(work, layout, fabric)
    piped = pipeline.pipeline_step(ops, times, replace(
        p2p, activation_s=share * p2p.activation_s, gradient_s=share * p2p.gradient_s))
    G = fabric.net.gpus_per_node
    dense_net = fabric.group(layout.per_node(("ep", "dp"), G))
    expert_net = fabric.group(layout.per_node(("dp",), G))
    reduce_s = []
    held = gradient_bytes(work, layout)
    whole = sum(p.count * p.params for parts in work.stage_parts() for p in parts)
    update = share * update_s * max(d + x for d, x in held) / (whole * work.grad_bytes)
    for dense, experts in held:
        d_all, d_last, _ = bucketed_allreduce_s(
            "ring", dense, bucket_bytes, layout.dp * layout.ep, dense_net,
            fabric.one_host) if dense else (0.0, 0.0, "-")
        x_all = bucketed_allreduce_s("ring", experts, bucket_bytes, layout.dp, expert_net,
                                     fabric.one_host)[0] if experts else 0.0
        reduce_s.append((share * d_all, share * d_last, share * x_all))
    ranks_here = n if host.cores else min(n, G)
    if layout.pp == 1 and work.overlapped and host.overlap(ranks_here):
        backward = BACKWARD_SHARE * piped.compute_s[0] / work.microbatches  # the last one
        d_all, d_last, x_all = reduce_s[0]
        exposed = d_last + max(0.0, d_all - d_last - backward) + x_all
    else:
        exposed = max(d + x for d, _, x in reduce_s)
    busiest = max(range(layout.pp), key=lambda s: piped.compute_s[s])
    m = work.microbatches
    return {"dp": layout.dp, "pp": layout.pp, "ep": layout.ep, "tp": layout.tp,
            "compute_s": piped.compute_s[busiest] - m * sum(comm[busiest].values()),
            "bubble": piped.bubble if layout.pp > 1 else 0.0, "p2p_s": piped.p2p_s,
            "tp_s": m * comm[busiest]["tp"], "a2a_s": m * comm[busiest]["a2a"],
            "makespan_s": piped.makespan_s, "allreduce_s": exposed,
            "straggler_s": straggler_s, "update_s": update,
            "step_s": piped.makespan_s + straggler_s + exposed + update}
