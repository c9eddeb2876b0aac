"""A pipeline step: each stage's passes from models/cost.py FLOPs, replayed by the schedule.

    stages = stage_flops("transformer", config, b, bounds)   # per stage {"F", "B", "W"} FLOPs
    step = pipeline_step(make("1f1b", p, m), times, p2p)     # models/schedule.py's replay

Pass FLOPs per micro-batch of b samples, from the Parts of the stage's body modules
(models/partition.py's module_parts, the split models/partition.py balances):

    F = forward (+ nothing kept for recompute)
    W = the weight gradients, dL/dW = x^T dy: one matmul per weight matmul of the forward,
        so W = forward FLOPs less those of the matmuls without weights (attention's
        Q K^T and A V, 4 B T^2 d a block)
    B = backward + recompute - W  (the input gradients, attention's score gradients)

Tensor parallelism (Megatron-LM, Shoeybi et al. 2019) divides every pass's FLOPs by t.

Point-to-point transfers. The executor (models/pipeline.py) sends an activation and
a gradient as one message each (the activation's int64 shape header goes once a step,
with its first micro-batch: not charged), with non-blocking sends and blocking
receives, so a transfer is on the critical path of the receiving pass: in the replay a
receive is charged to the pass that receives, from the moment both the data and the
receiving stage are ready:

    F on stage g > 0         += alpha + b T d size beta
    B / BW on stage g < S-1  += alpha + b T d size beta

(S stages: p, or v p with v model chunks per rank, where a neighbouring stage on the
same rank, the bottom of a V, is handed the array for free). models/schedule.py's
`simulate` replays the real op lists (GPipe, 1F1B, interleaved 1F1B, ZB-H1, ZB-V,
DualPipeV) with
these per-stage times; the predicted bubble counts receive time as idle, as the
executor measures it (blocked in receives):

    bubble = mean over ranks of (makespan - compute of the rank) / makespan

Pass times come per stage, or per rank: then each of a rank's v chunks takes 1/v of
them (the balanced split Narayanan et al. 2021 assume for the interleaved schedule).
"""

from __future__ import annotations

from dataclasses import dataclass

from dtlab.lab.simulate.links import Link
from dtlab.models.partition import balance, explicit, module_costs
from dtlab.models.parts import Part
from dtlab.models.schedule import Schedule, layout_of, simulate, virtual_stage
from dtlab.models.zoo import MODELS

PASSES = ("F", "B", "W")


def weightless_flops(part: Part, c, b: int) -> int:
    """Forward FLOPs of `part`'s matmuls that multiply two activations (no weight, so no
    weight gradient): attention's Q K^T and A V, 2 B T^2 d each (models/parts.attention)."""
    if part.name.endswith("attention"):
        return part.count * 4 * b * c.seq_len * c.seq_len * c.d_model
    return 0


def pass_flops(parts: list[Part], c, b: int) -> dict[str, float]:
    """{"F", "B", "W"}: FLOPs of one micro-batch's passes through `parts`."""
    fwd = sum(p.count * p.flops_forward for p in parts)
    back = sum(p.count * (p.flops_backward + p.flops_recompute) for p in parts)
    w = fwd - sum(weightless_flops(p, c, b) for p in parts)
    return {"F": float(fwd), "B": float(back - w), "W": float(w)}


def module_groups(model_name: str, c, b: int) -> list[list[Part]]:
    """The Parts of each body module (models/parts.py's recipe, in body order)."""
    return MODELS[model_name].cost.modules(c, b)


def stage_bounds(model_name: str, c, b: int, p: int, stages: str = "") -> list[int]:
    """models/partition.py's split: --stages as given, else balanced by FLOPs (a
    ConfigError when p exceeds the modules)."""
    n = len(module_groups(model_name, c, b))
    if stages:
        return explicit(stages, n, p)
    return balance(module_costs(model_name, c, b, n), p)


def stage_flops(model_name: str, c, b: int, bounds: list[int]) -> list[dict[str, float]]:
    """Per stage, the F/B/W FLOPs of one micro-batch of b samples."""
    groups = module_groups(model_name, c, b)
    return [pass_flops([q for g in groups[lo:hi] for q in g], c, b)
            for lo, hi in zip(bounds, bounds[1:], strict=False)]


def activation_bytes(c, b: int, itemsize: int) -> int:
    """One micro-batch's activation between stages, (b, T, d) in a transformer, (b,
    d_hidden) in an MLP (every boundary between its modules is a hidden layer's); its
    gradient is the same."""
    if hasattr(c, "seq_len"):
        return b * c.seq_len * c.d_model * itemsize
    return b * c.d_hidden * itemsize


@dataclass(frozen=True)
class P2P:
    """One micro-batch's receives: an activation and a gradient."""

    activation_s: float
    gradient_s: float
    nbytes: int  # the activation's data (the gradient's too)

    @staticmethod
    def over(link: Link, nbytes: int) -> P2P:
        one = link.alpha_s + nbytes * link.beta_s_per_byte
        return P2P(one, one, nbytes)


FREE = P2P(0.0, 0.0, 0)


@dataclass
class PipelineStep:
    makespan_s: float
    bubble: float  # mean over stages of idle (receives included) / makespan
    compute_s: list[float]  # each stage's passes, no receives
    p2p_s: float  # the most time a stage spends receiving


def per_stage(times: list[dict[str, float]], p: int, v: int,
              layout: str = "loop") -> list[dict[str, float]]:
    """Pass times of each of the v p stages: as given (one per stage), or one per rank
    split evenly over its v chunks."""
    if len(times) == v * p:
        return times
    if len(times) != p:
        raise ValueError(f"{len(times)} pass times for {p} ranks of {v} chunks each")
    out = [{}] * (v * p)
    for r in range(p):
        for c in range(v):
            out[virtual_stage(layout, p, r, c)] = {k: x / v for k, x in times[r].items()}
    return out


def with_receives(times: list[dict[str, float]], p2p: P2P, p: int | None = None,
                  layout: str = "loop") -> list[dict[str, float]]:
    """Per-stage pass times with each pass's receive added (see the module docstring);
    p: the ranks the len(times) stages sit on (default one stage each)."""
    S, p = len(times), p or len(times)
    rank = {virtual_stage(layout, p, r, c): r for r in range(p) for c in range(S // p)}
    return [{"F": t["F"] + (p2p.activation_s if g > 0 and rank[g - 1] != rank[g] else 0.0),
             "B": t["B"] + (p2p.gradient_s if g < S - 1 and rank[g + 1] != rank[g] else 0.0),
             "W": t["W"]}
            for g, t in enumerate(times)]


def pipeline_step(ops: Schedule, times: list[dict[str, float]], p2p: P2P = FREE,
                  layout: str | None = None) -> PipelineStep:
    """Replay `ops` (models/schedule.py op lists, their stages placed by `layout`, by
    default the one they carry) with pass seconds `times` (per stage, or per rank:
    `per_stage`) and the receives of `p2p`."""
    layout = layout or layout_of(ops)
    p = len(ops)
    v = 1 + max(op.chunk for stage in ops for op in stage)
    m = sum(op.kind == "F" for op in ops[0]) // v
    stages = per_stage(times, p, v, layout)
    paid = with_receives(stages, p2p, p, layout)
    line = simulate(ops, stage_times=paid, layout=layout)
    where = [[virtual_stage(layout, p, r, c) for c in range(v)] for r in range(p)]
    compute = [m * sum(stages[g][k] for g in where[r] for k in PASSES) for r in range(p)]
    received = [m * sum(paid[g][k] - stages[g][k] for g in where[r] for k in PASSES)
                for r in range(p)]
    bubble = sum(line.makespan - c for c in compute) / (p * line.makespan)
    return PipelineStep(line.makespan, bubble, compute, max(received))
