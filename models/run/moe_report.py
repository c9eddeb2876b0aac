"""What a trainer logs of its Mixture-of-Experts layers: per step, and a table at the end.

Each step's metrics record gets "moe": one object per MoE layer with the last
forward's tokens per expert, load imbalance (max / mean), dropped tokens,
router entropy, experts per token (dynamic k), the balancing terms and the
selection bias, and "moe_aux_loss": coefficient x balancing terms, summed
over layers, each layer's the mean over the step's micro-batches (its
backward passes: the mean the balancing gradient follows under gradient
accumulation, MoE.take_aux_loss; not part of the logged "loss", which is the
cross-entropy). The run's summary ends with a table per layer: the means over
every forward and p50/p95/p99 of the router, dispatch, expert compute and
combine times (models/moe_stats.py).
"""

from __future__ import annotations

from dtlab.models.moe_stats import PHASES

PER_STEP = ("imbalance", "dropped_tokens", "dropped_pairs", "entropy", "experts_per_token",
            "aux_switch", "aux_z")


def step_record(layers: list) -> dict:
    """{"moe": [...], "moe_aux_loss": x} for a step's metrics record ({} without MoE),
    once per step, after its backward passes (moe_aux_loss: the mean over them)."""
    if not layers:
        return {}
    out = []
    for m in layers:
        last = m.stats.last if m.stats is not None else {}
        rec = {"layer": m.name, **{k: last[k] for k in PER_STEP if k in last}}
        for key in ("tokens_per_expert", "bias"):
            if key in last:
                rec[key] = [float(v) for v in last[key]]
        out.append(rec)
    return {"moe": out, "moe_aux_loss": sum(m.take_aux_loss() for m in layers)}


def merge(records: list[dict]) -> dict:
    """One step record from the step records of every pipeline stage, in stage order
    (a stage without MoE layers gave {})."""
    parts = [r for r in records if r]
    if not parts:
        return {}
    return {"moe": [layer for r in parts for layer in r["moe"]],
            "moe_aux_loss": sum(r["moe_aux_loss"] for r in parts)}


def layer_summaries(layers: list) -> list[tuple[str, dict]]:
    """(layer name, MoEStats.summary()) of every layer that keeps statistics."""
    return [(m.name, m.stats.summary()) for m in layers if m.stats is not None]


def summary_lines(rows: list[tuple[str, dict]]) -> list[str]:
    """The end-of-run table, one row per MoE layer ([] without MoE); `rows` from
    layer_summaries (of every stage, for a pipeline)."""
    if not rows:
        return []
    lines = ["MoE layers (means over every forward; times p50/p95/p99 in ms):",
             f"  {'layer':<10} {'fwd':>6} {'imbal':>6} {'drop tok':>8} {'entropy':>7} "
             f"{'k/tok':>5} " + " ".join(f"{p:>16}" for p in PHASES)]
    for name, s in rows:
        if not s["forwards"]:
            continue
        times = " ".join("{:>16}".format("/".join(f"{1e3 * s[f'{p}_s'][q]:.2f}"
                                                 for q in ("p50", "p95", "p99")))
                         for p in PHASES)
        lines.append(f"  {name:<10} {s['forwards']:>6} {s['imbalance']:>6.2f} "
                     f"{s['dropped_tokens']:>8.1f} {s['entropy']:>7.3f} "
                     f"{s['experts_per_token']:>5.2f} {times}")
    return lines
