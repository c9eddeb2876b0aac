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

Point-to-point transfers. The executor (models/pipeline.py) sends an activation as
two messages (an int64 shape header, then the data) and a gradient as one, with
non-blocking sends and blocking receives, so a transfer is on the critical path of
the receiving pass: in the replay a receive is charged to the pass that receives,
from the moment both the data and the receiving stage are ready:

    F on stage s > 0         += 2 alpha + (b T d size + header) beta
    B / BW on stage s < p-1  += alpha + b T d size beta

models/schedule.py's `simulate` replays the real op lists (GPipe, 1F1B, ZB-H1) with
these per-stage times; the predicted bubble counts receive time as idle, as the
executor measures it (blocked in receives):

    bubble = mean over stages of (makespan - compute of the stage) / makespan
"""

from __future__ import annotations

from dataclasses import dataclass

from dtlab.lab.bench.parallel_formulas import HEADER_BYTES
from dtlab.lab.simulate.links import Link
from dtlab.models.partition import balance, explicit, module_costs
from dtlab.models.parts import Part
from dtlab.models.schedule import Schedule, simulate
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
    """One micro-batch's receives: an activation (header + data) and a gradient."""

    activation_s: float
    gradient_s: float
    nbytes: int  # the activation's data (the gradient's too)

    @staticmethod
    def over(link: Link, nbytes: int) -> P2P:
        return P2P(2 * link.alpha_s + (nbytes + HEADER_BYTES) * link.beta_s_per_byte,
                   link.alpha_s + nbytes * link.beta_s_per_byte, nbytes)


FREE = P2P(0.0, 0.0, 0)


@dataclass
class PipelineStep:
    makespan_s: float
    bubble: float  # mean over stages of idle (receives included) / makespan
    compute_s: list[float]  # each stage's passes, no receives
    p2p_s: float  # the most time a stage spends receiving


def with_receives(times: list[dict[str, float]], p2p: P2P) -> list[dict[str, float]]:
    """Per-stage pass times with each pass's receive added (see the module docstring)."""
    p = len(times)
    return [{"F": t["F"] + (p2p.activation_s if s > 0 else 0.0),
             "B": t["B"] + (p2p.gradient_s if s < p - 1 else 0.0), "W": t["W"]}
            for s, t in enumerate(times)]


def pipeline_step(ops: Schedule, times: list[dict[str, float]], p2p: P2P = FREE) -> PipelineStep:
    """Replay `ops` (models/schedule.py op lists) with per-stage pass seconds `times`
    and the receives of `p2p`."""
    m = sum(op.kind == "F" for op in ops[0])
    line = simulate(ops, stage_times=with_receives(times, p2p))
    compute = [m * sum(t[k] for k in PASSES) for t in times]
    p = len(ops)
    received = [m * ((p2p.activation_s if s > 0 else 0.0)
                     + (p2p.gradient_s if s < p - 1 else 0.0)) for s in range(p)]
    bubble = sum(line.makespan - c for c in compute) / (p * line.makespan)
    return PipelineStep(line.makespan, bubble, compute, max(received))
