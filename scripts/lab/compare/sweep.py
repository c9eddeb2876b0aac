"""The scaling sweep: a few model sizes, one topology, one compute budget; power-law fits.

    dtlab-compare --sweep model-size [--sweep-sizes 32,64,128] [--runs sync-ring]

Every size trains for the same training FLOPs C (models/cost.py's count per
step times the steps it is given: a bigger model takes fewer steps), under
the first topology of --runs. The fits follow Kaplan et al. (2020, "Scaling
Laws for Neural Language Models") with the irreducible loss known here (the
data's floor E, Hoffmann et al. 2022's constant term):

    L(N) - E = a N^-alpha          final loss against parameters N, at budget C
    L*(c) - E = b c^-beta          the compute frontier: at each compute c <= C,
                                   the lowest loss any size reached by then

each by least squares on log-log axes; the exponent's error is the slope's
standard error sqrt(SSR / (n - 2) / Sxx) (none for two points). A sweep of
three tiny models on two cores fits a line through three points: the
exponent tells the trend of this setup, not a law.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np

from dtlab.models.config import ConfigError
from dtlab.models.cost import estimate
from dtlab.models.run.metrics import read_metrics

SIZE_FIELD = {"transformer": "d_model", "mlp": "d_hidden"}
MIN_STEPS = 5


def sized(model_name: str, cfg, width: int):
    """The model config at width `width` (transformer: d_model, d_ff = 4 d_model)."""
    if model_name == "transformer":
        if width % cfg.n_heads:
            raise ConfigError(f"--sweep-sizes: d_model {width} is not divisible by --n-heads "
                              f"{cfg.n_heads}")
        return dataclasses.replace(cfg, d_model=width, d_ff=4 * width)
    return dataclasses.replace(cfg, d_hidden=width)


def plan(model_name: str, cfg, widths: list[int], batch: int, steps: int) -> list[dict]:
    """Per size: its config, parameters, FLOPs per step and steps; the budget is `steps`
    steps of the smallest size."""
    sizes = []
    for w in widths:
        c = sized(model_name, cfg, w)
        cost = estimate(model_name, c, batch)
        sizes.append({"width": w, "config": c, "params": cost.params_total,
                      "flops_per_step": cost.flops_step})
    budget = steps * min(s["flops_per_step"] for s in sizes)
    for s in sizes:
        s["steps"] = int(budget // s["flops_per_step"])
        if s["steps"] < MIN_STEPS:
            raise ConfigError(f"--sweep-sizes: width {s['width']} gets {s['steps']} steps of "
                              f"the budget; give more --steps or smaller sizes")
    return sizes


def power_law(x: np.ndarray, y: np.ndarray) -> dict:
    """y = a x^-k fitted on log-log axes: k, its standard error, a."""
    lx, ly = np.log(x), np.log(y)
    slope, intercept = np.polyfit(lx, ly, 1)
    n = len(x)
    se = None
    if n > 2:
        ssr = float(np.sum((ly - (slope * lx + intercept)) ** 2))
        se = math.sqrt(ssr / (n - 2) / float(np.sum((lx - lx.mean()) ** 2)))
    return {"exponent": float(-slope), "exponent_se": se, "coefficient": float(np.exp(intercept)),
            "points": n}


def frontier(runs: list[dict], floor: float) -> tuple[np.ndarray, np.ndarray]:
    """(compute, lowest loss - floor by then) at 20 log-spaced compute points."""
    ends = [r["compute"][-1] for r in runs]
    grid = np.geomspace(min(r["compute"][0] for r in runs), min(ends), 20)
    best = []
    for c in grid:
        reached = [r["smooth"][np.searchsorted(r["compute"], c, side="right") - 1]
                   for r in runs if r["compute"][0] <= c]
        best.append(min(reached) - floor)
    keep = np.array(best) > 0
    return grid[keep], np.array(best)[keep]


def analyse(sizes: list[dict], metrics: list[Path], floor: float | None) -> dict:
    """The table rows and both fits (None where the floor is unknown or a loss is below it)."""
    rows, runs = [], []
    for s, path in zip(sizes, metrics, strict=True):
        records = read_metrics(str(path))[1]
        loss = np.array([r["loss"] for r in records])
        window = max(1, len(loss) // 10)
        smooth = np.convolve(loss, np.ones(window) / window, mode="valid")  # trailing means
        steps = np.arange(window, len(loss) + 1)
        held = [r["eval_loss"] for r in records if "eval_loss" in r]
        row = {"width": s["width"], "params": s["params"], "steps": s["steps"],
               "flops_per_step": s["flops_per_step"], "compute": s["steps"] * s["flops_per_step"],
               "final_loss": float(loss[-window:].mean()),
               "final_eval_loss": held[-1] if held else None}
        rows.append(row)
        runs.append({"compute": steps * s["flops_per_step"], "smooth": smooth})
    out = {"rows": rows, "loss_vs_params": None, "loss_vs_compute": None}
    if floor is None:
        return out
    gaps = np.array([r["final_loss"] - floor for r in rows])
    if (gaps > 0).all() and len(rows) >= 2:
        out["loss_vs_params"] = power_law(np.array([r["params"] for r in rows], float), gaps)
    c, best = frontier(runs, floor)
    if len(c) >= 2:
        out["loss_vs_compute"] = power_law(c, best)
        out["frontier"] = {"compute": c.tolist(), "gap": best.tolist()}
    return out


def table(result: dict, floor: float | None) -> list[str]:
    lines = ["| width | parameters | steps | FLOPs/step | final loss | gap | held-out loss |",
             "|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        gap = f"{r['final_loss'] - floor:+.4f}" if floor is not None else "-"
        held = f"{r['final_eval_loss']:.4f}" if r["final_eval_loss"] is not None else "-"
        lines.append(f"| {r['width']} | {r['params']:,} | {r['steps']} | "
                     f"{r['flops_per_step']:.3g} | {r['final_loss']:.4f} | {gap} | {held} |")
    for key, what in (("loss_vs_params", "L - E = a N^-alpha"),
                      ("loss_vs_compute", "L* - E = b C^-beta (compute frontier)")):
        fit = result[key]
        if fit is None:
            lines += ["", f"{what}: no fit (the floor is unknown or a loss is at or below it)"]
            continue
        se = f" +- {fit['exponent_se']:.3f}" if fit["exponent_se"] is not None else \
            " (two points: no error estimate)"
        lines += ["", f"{what}: exponent {fit['exponent']:.3f}{se}, coefficient "
                      f"{fit['coefficient']:.3g}, {fit['points']} points"]
    return lines


def plot(out: Path, result: dict, floor: float) -> str | None:
    """sweep.png (log-log, both fits), or None without matplotlib or fits."""
    try:
        import matplotlib
    except ImportError:
        return None
    if result["loss_vs_params"] is None:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    n = np.array([r["params"] for r in result["rows"]], float)
    gap = np.array([r["final_loss"] - floor for r in result["rows"]])
    fit = result["loss_vs_params"]
    left.loglog(n, gap, "o", label="runs")
    left.loglog(n, fit["coefficient"] * n ** -fit["exponent"], "-",
                label=f"alpha = {fit['exponent']:.3f}")
    left.set(xlabel="parameters N", ylabel="final loss - floor (nats)",
             title="loss against model size, one compute budget")
    left.legend(fontsize=8)
    if result["loss_vs_compute"] is not None:
        c, best = np.array(result["frontier"]["compute"]), np.array(result["frontier"]["gap"])
        fit = result["loss_vs_compute"]
        right.loglog(c, best, "o", markersize=3, label="frontier")
        right.loglog(c, fit["coefficient"] * c ** -fit["exponent"], "-",
                     label=f"beta = {fit['exponent']:.3f}")
        right.legend(fontsize=8)
    right.set(xlabel="training FLOPs C", ylabel="lowest loss - floor (nats)",
              title="compute frontier")
    fig.tight_layout()
    fig.savefig(out / "sweep.png", dpi=110)
    plt.close(fig)
    return "sweep.png"


def write(out: Path, result: dict, lines: list[str], floor: float | None,
          png: str | None) -> None:
    (out / "sweep.json").write_text(json.dumps(result, indent=1) + "\n")
    text = ["# Scaling sweep: model size at one compute budget", "", *lines, "",
            *table(result, floor), ""]
    text += [f"![loss against size and compute]({png})" if png else
             "no plot (matplotlib missing or no fit)", ""]
    (out / "sweep.md").write_text("\n".join(text) + "\n")
