"""What a comparison with tuning and seeds writes (compare/study.py's protocol).

    summary.json           the setup, the protocol, per method its best point, the spread
                           of every figure over the seeds and what ran; every run
    report.md              leads with one table: each method at its best, time, samples
                           and bytes to the held-out target with their spread, vs the
                           first method; the bytes-against-quality front;
                           then the sensitivity table, what ran, the plots, every run
    sensitivity.png        final held-out loss against each tuned value, one line per method
    heldout_vs_samples.png held-out loss against samples seen: mean over the seeds at each
                           method's best point, min-max band
    heldout_vs_time.png    ... against seconds of training
    heldout_vs_bytes.png   ... against bytes on the wire (all processes, log scale), and
                           against communication rounds (compare/analysis.py, traffic)
    time_split.png         ms per step (compute, comm, pull, other), mean over the seeds
    front.png              final held-out loss against MB per step (log), the methods no
                           other beats on both joined (compare/front.py)

Each run's own files (metrics, logs, config) are in OUT/tune/POINT/ (tuning, the tuning
seed) and OUT/seed-S/POINT/ (evaluation seeds), named after the run. With outer axes in
the grid (outer_lr, outer_momentum), a method without an outer optimizer has points
without them (study.applicable): its cells repeat across the outer values in the
sensitivity table, "-" stands for them in the leading one, and the protocol line names
each tuned method's chosen outer lr.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from dtlab.lab.compare import front, study
from dtlab.lab.compare.analysis import SPLIT, memory_words, ran_words
from dtlab.lab.compare.report import NO_MATPLOTLIB, Result, _f, failed_lines
from dtlab.lab.compare.runner import RunSpec

PLOTS = {"sensitivity.png": "final held-out loss against the tuned setting",
         "heldout_vs_samples.png": "held-out loss against samples seen (band: min-max over "
                                   "seeds)",
         "heldout_vs_time.png": "held-out loss against wall time (band: min-max over seeds)",
         "heldout_vs_bytes.png": "held-out loss against bytes moved and against "
                                 "communication rounds (mean over seeds)",
         "time_split.png": "where a step's time goes (mean over seeds)",
         "front.png": "final held-out loss against bytes on the wire per step: the front"}


def summary(data: dict, specs: list[RunSpec], grid: study.Grid, best: dict, seeds: list[int],
            trials: list[study.Trial], results: list[Result]) -> dict:
    methods = []
    for spec in specs:
        mine = [t for t in trials if t.spec.name == spec.name]
        final = [t for t in mine if t.seed in seeds and t.point == best[spec.name]
                 and t.folder.startswith("seed-")]
        agg = study.aggregate(final, data["global_batch"])
        moved = [t.stats["traffic"] for t in final if t.stats and t.stats.get("traffic")]
        agg["bytes_per_step"] = study.spread([m["bytes_per_step"] for m in moved])
        agg["rounds_per_step"] = study.spread([m["rounds_per_step"] for m in moved])
        agg["bytes_to_target"] = study.spread([m["bytes_to_target"] for m in moved
                                               if m.get("bytes_to_target") is not None])
        methods.append({
            "name": spec.name, "what": study.at_point(spec, best[spec.name]).describe(),
            "best": best[spec.name],
            "tuning": [{"point": t.point, "folder": t.folder, "status": "ok" if t.stats else
                        "failed", "time_to_target_s": study.held_time_to_target(t.stats)
                        if t.stats else None,
                        "final_eval_loss": t.stats.get("final_eval_loss") if t.stats else None}
                       for t in mine if t.folder.startswith("tune")],
            **agg,
            "what_ran": [t.what_ran for t in final],
        })
    base = methods[0]["time_to_target_s"]
    for m in methods:
        t = m["time_to_target_s"]
        m["vs_first"] = t["mean"] / base["mean"] if t and base else None
    runs = [{"name": r.name, "phase": r.phase, "point": r.point, "seed": r.seed,
             "folder": r.folder, "status": "ok" if r.ok else "failed", "error": r.outcome.error,
             "log_tail": r.outcome.tail, "wall_s": r.outcome.wall_s,
             "metrics": [f"{r.folder}/{p.name}" for p in r.outcome.metrics],
             "commands": r.outcome.commands, "stats": r.stats, "what_ran": r.ran}
            for r in results]
    protocol = {"grid": grid.axes, "tuning_seed": data["config"]["run"]["seed"],
                "seeds": seeds, "spread": "min-max over the seeds",
                "selection": "fewest samples to the held-out target, then lowest final "
                             "held-out loss (unreached points after, by that loss); time to "
                             "the target breaks exact ties only",
                "held_out": {"every": data["config"]["run"]["eval_every"],
                             "examples": data["config"]["run"]["eval_samples"]},
                "outer_axes": [a for a in study.OUTER_AXES if a in grid.axes],
                "outer_methods": [s.name for s in specs if s.has_outer]}
    return {**data, "protocol": protocol, "methods": methods, "runs": runs}


def _spread(s: dict | None, fmt: str) -> str:
    if s is None:
        return "-"
    if s["n"] == 1 or s["min"] == s["max"]:
        return format(s["mean"], fmt)
    return f"{format(s['mean'], fmt)} [{format(s['min'], fmt)}-{format(s['max'], fmt)}]"


def leading_table(data: dict) -> list[str]:
    first = data["methods"][0]["name"]
    grid = list(data["protocol"]["grid"])
    names = grid or ["-"]
    rows = [f"| method | what | best {', '.join(names)} | time to target (s) | reached "
            f"| samples to target | final held-out loss | ms/step | MB/process | MB/step "
            f"| rounds/step | MB to target | vs {first} |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for m in data["methods"]:
        best = ", ".join(f"{m['best'][n]:g}" if n in m["best"] else "-"
                         for n in grid) or "as configured"
        ms = m["s_per_step"]
        ms = None if ms is None else {k: v * 1e3 if k != "n" else v for k, v in ms.items()}
        rows.append(f"| {m['name']} | {m['what']} | {best} "
                    f"| {_spread(m['time_to_target_s'], '.2f')} "
                    f"| {m['reached']}/{len(m['seeds'])} "
                    f"| {_spread(m['samples_to_target'], ',.0f')} "
                    f"| {_spread(m['final_eval_loss'], '.4f')} | {_spread(ms, '.2f')} "
                    f"| {memory_words(m['what_ran'][0]) if m['what_ran'] else '-'} "
                    f"| {_traffic(m.get('bytes_per_step'), 1e-6)} "
                    f"| {_traffic(m.get('rounds_per_step'), 1.0)} "
                    f"| {_traffic(m.get('bytes_to_target'), 1e-6)} "
                    f"| {_f(m['vs_first'], '.2f')} |")
    return rows


def _traffic(s: dict | None, scale: float) -> str:
    """A bytes or rounds per step spread in the table, 3 significant digits; - unrecorded."""
    if s is None:
        return "-"
    return _spread({k: v * scale if k != "n" else v for k, v in s.items()}, ".3g")


def sensitivity_table(data: dict) -> list[str]:
    """Per method and grid point: the tuning seed's final held-out loss and time to target
    (a method without an outer optimizer: its run at the point's other axes)."""
    if not any(m["tuning"] for m in data["methods"]):
        return []
    points = study.Grid(data["protocol"]["grid"]).points()
    head = " | ".join(study.label(p) for p in points)
    rows = [f"| method | {head} |", "|---|" + "---|" * len(points)]
    for m in data["methods"]:
        cells = []
        for point in points:
            t = next((t for t in m["tuning"] if t["point"].items() <= point.items()), None)
            if t is None:
                cells.append("-")
                continue
            loss, time_s = t["final_eval_loss"], t["time_to_target_s"]
            cell = "failed" if t["status"] != "ok" else \
                f"{_f(loss, '.4f')} ({'-' if time_s is None else f'{time_s:.2f} s'})"
            cells.append(f"**{cell}**" if t["point"] == m["best"] else cell)
        rows.append(f"| {m['name']} | " + " | ".join(cells) + " |")
    return rows


def what_ran_table(data: dict) -> list[str]:
    rows = ["| method | what ran (every seed) |", "|---|---|"]
    for m in data["methods"]:
        words = list(dict.fromkeys(ran_words(r) for r in m["what_ran"] if r)) or ["-"]
        rows.append(f"| {m['name']} | {' / '.join(words)} |")
    return rows


def runs_table(data: dict) -> list[str]:
    rows = ["| run | phase | point | seed | status | final held-out loss | held-out steps to "
            "target | ms/step | folder |", "|---|---|---|---|---|---|---|---|---|"]
    for r in data["runs"]:
        s = r["stats"] or {}
        rows.append(f"| {r['name']} | {r['phase']} | {study.label(r['point'])} | {r['seed']} "
                    f"| {r['status']} | {_f(s.get('final_eval_loss'), '.4f')} "
                    f"| {_f(s.get('eval_steps_to_target'), 'd')} "
                    f"| {_f(s['s_per_step'] * 1e3 if s else None, '.2f')} | {r['folder']} |")
    return rows


def write(out: Path, data: dict, results: list[Result], lines: list[str]) -> None:
    p = data["protocol"]
    grid = study.Grid(p["grid"]).describe() or "none"
    first = data["methods"][0]["name"]
    outer = outer_words(data)
    text = ["# Sync vs async training, each method at its own best", "", *lines,
            f"- protocol: every method tuned over {grid} with seed {p['tuning_seed']}, then "
            f"run at its best point with seeds {', '.join(map(str, p['seeds']))}; held-out "
            f"loss every {p['held_out']['every']} steps on {p['held_out']['examples']} "
            f"examples (the same for every run); best = {p['selection']}{outer}", "",
            "## Each method at its best", "", *leading_table(data), "",
            "Figures over the evaluation seeds: mean [min-max]. time to target: ms/step x the "
            "first evaluated step whose held-out loss is at or below the target, over the "
            "seeds that reached it (reached: how many did); samples to target: that step x "
            f"the global batch; final held-out loss: the last evaluation; MB/process: what a "
            "sync rank holds (parameters, gradients, optimizer state: measured buffers), or an "
            "async worker / shard (parameters and gradients / its slice with optimizer state: "
            "from the config); MB/step and rounds/step: bytes on the wire per step, every "
            "process's counted once (sync: N x rank 0's, our ring's schedule; async: pushed "
            "and pulled tensors), and collectives (sync) or pushes (async) per step; MB to "
            "target: bytes on the wire until the held-out target, over the seeds that reached "
            f"it; vs {first}: mean time to target / {first}'s. -: no seed reached the "
            "target.", "", *front.lines(front.points_of(data["methods"]))]
    sens = sensitivity_table(data)
    if sens:
        text += ["## Sensitivity to the tuned setting (tuning seed)", "", *sens, "",
                 "Each cell: final held-out loss (time to the held-out target); bold: the "
                 "method's best point." + (" A method without an outer optimizer ran once "
                 "per point of the other axes: its cell repeats across the outer values."
                                            if p.get("outer_axes") else ""), ""]
    text += ["## What ran", "", *what_ran_table(data), "",
             "From each run's own metrics: the all-reduce each gradient bucket ran (sync), "
             "how each shard's tensors travelled (async; every path a worker recorded), "
             "compute precision and the wire dtype.", ""]
    text += failed_lines(results, lambda r: f"{r.name} ({r.folder})")
    text += ["## Plots", ""]
    text += ([f"![{PLOTS[q]}]({q})" for q in data["plots"]] if data["plots"]
             else [data["plots_note"]])
    text += ["", "## Every run", "", *runs_table(data), "",
             "Each run's metrics, log and config are in its folder; summary.json holds every "
             "number above.", ""]
    (out / "report.md").write_text("\n".join(text) + "\n")


def outer_words(data: dict) -> str:
    """The protocol line's words on the outer axes: whom they apply to and what each
    tuned method chose ("" without outer axes)."""
    axes = data["protocol"].get("outer_axes")
    if not axes:
        return ""
    tuned = set(data["protocol"]["outer_methods"])
    chosen = [f"{m['name']} " + ", ".join(f"{a} {m['best'][a]:g}" for a in axes
                                           if a in m["best"])
              for m in data["methods"] if m["name"] in tuned]
    return (f"; {' and '.join(axes)} tuned for the methods with an outer optimizer only (the "
            f"others ran once per point of the other axes); chosen: {'; '.join(chosen)}")


def bands(curves: list, x: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Held-out curves of several seeds at the first seed's evaluation steps that every
    seed's curve spans, each seed's loss and time interpolated there where its evaluations
    fell at other steps (workers out of step: compare/analysis.py): x (the mean of the
    seeds' x there), mean, min and max of the held-out loss."""
    lo, hi = max(c.eval_steps[0] for c in curves), min(c.eval_steps[-1] for c in curves)
    first = curves[0].eval_steps
    steps = first[(first >= lo) & (first <= hi)]  # [E]
    if x == "elapsed_s":  # the evaluations' own times
        xs = np.mean([np.interp(steps, c.eval_steps, c.eval_time_s) for c in curves], axis=0)
    else:
        xs = np.mean([getattr(c, x)[steps - 1] for c in curves], axis=0)  # [E]
    ys = np.array([np.interp(steps, c.eval_steps, c.eval_loss) for c in curves])  # [seeds, E]
    return xs, ys.mean(axis=0), ys.min(axis=0), ys.max(axis=0)


def plot(out: Path, data: dict, results: list[Result], floor: float | None,
         target: float) -> tuple[list[str], str]:
    """The PNG plots written, or none and why."""
    try:
        import matplotlib
    except ImportError:
        return [], NO_MATPLOTLIB
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    best = {m["name"]: m["best"] for m in data["methods"]}
    final = {name: [r for r in results if r.phase == "seed" and r.name == name
                    and r.curve is not None and r.curve.eval_steps.size] for name in best}
    written = []
    axes = list(data["protocol"]["grid"])
    if axes:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for m in data["methods"]:
            pts = [(t["point"][axes[0]], t["final_eval_loss"]) for t in m["tuning"]
                   if axes[0] in t["point"]  # an outer axis: its methods only
                   and t["final_eval_loss"] is not None and math.isfinite(t["final_eval_loss"])]
            if pts:
                ax.plot(*zip(*sorted(pts), strict=True), "o-", label=m["name"], linewidth=1.2)
        if floor is not None:
            ax.axhline(floor, color="black", linestyle=":", linewidth=1, label="floor")
        ax.axhline(target, color="black", linestyle="--", linewidth=1, label="target")
        ax.set_xscale("log")
        ax.set(xlabel=axes[0] + (" (other settings: every point)" if len(axes) > 1 else ""),
               ylabel="final held-out loss (nats)", title=PLOTS["sensitivity.png"])
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / "sensitivity.png", dpi=110)
        plt.close(fig)
        written.append("sensitivity.png")
    for name, x, label in (("heldout_vs_samples.png", "samples", "samples seen"),
                           ("heldout_vs_time.png", "elapsed_s", "seconds of training")):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for method, runs in final.items():
            if not runs:
                continue
            xs, mean, lo, hi = bands([r.curve for r in runs], x)
            (line,) = ax.plot(xs, mean, label=f"{method} ({study.label(best[method])})",
                              linewidth=1.2,
                              linestyle="-" if runs[0].outcome.spec.topology == "sync" else "--")
            ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.15, linewidth=0)
        if floor is not None:
            ax.axhline(floor, color="black", linestyle=":", linewidth=1, label="floor")
        ax.axhline(target, color="black", linestyle="--", linewidth=1, label="target")
        ax.set(xlabel=label, ylabel="held-out loss (nats)", title=PLOTS[name])
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        written.append(name)
    if traffic_plot(out, final, best, floor, target, plt):
        written.append("heldout_vs_bytes.png")
    if front.plot(front.points_of(data["methods"]), out, PLOTS["front.png"]):
        written.append("front.png")
    shown = [m for m in best if final[m]]
    if shown:
        fig, ax = plt.subplots(figsize=(7, 0.5 * len(shown) + 1.5))
        left = [0.0] * len(shown)
        for part in SPLIT:
            widths = [float(np.mean([r.stats["split_ms"][part] for r in final[m]]))
                      for m in shown]
            ax.barh(shown, widths, left=left, label=part)
            left = [a + b for a, b in zip(left, widths, strict=True)]
        ax.invert_yaxis()
        ax.set(xlabel="ms per step", title=PLOTS["time_split.png"])
        ax.legend(fontsize=8, ncol=len(SPLIT), loc="upper center", bbox_to_anchor=(0.5, -0.12))
        fig.savefig(out / "time_split.png", dpi=110, bbox_inches="tight")
        plt.close(fig)
        written.append("time_split.png")
    return written, ""


def traffic_plot(out: Path, final: dict, best: dict, floor: float | None, target: float,
                 plt) -> bool:
    """heldout_vs_bytes.png: held-out loss against cumulative bytes on the wire (log x) and
    against communication rounds, one line per method whose every seed recorded them
    (mean over the seeds at their common evaluation steps); False when none did."""
    runs = {m: rs for m, rs in final.items()
            if rs and all(r.curve.bytes is not None for r in rs)}
    if not runs:
        return False
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), sharey=True)
    for ax, x, label in ((axes[0], "bytes", "bytes on the wire, all processes"),
                         (axes[1], "rounds", "communication rounds")):
        for method, rs in runs.items():
            xs, mean, _, _ = bands([r.curve for r in rs], x)
            ax.plot(xs, mean, marker="o", markersize=3, linewidth=1.2,
                    label=f"{method} ({study.label(best[method])})",
                    linestyle="-" if rs[0].outcome.spec.topology == "sync" else "--")
        if floor is not None:
            ax.axhline(floor, color="black", linestyle=":", linewidth=1, label="floor")
        ax.axhline(target, color="black", linestyle="--", linewidth=1, label="target")
        ax.set_xscale("log")
        ax.set(xlabel=label)
    axes[0].set(ylabel="held-out loss (nats)")
    axes[1].legend(fontsize=7)
    fig.suptitle(PLOTS["heldout_vs_bytes.png"])
    fig.tight_layout()
    fig.savefig(out / "heldout_vs_bytes.png", dpi=110)
    plt.close(fig)
    return True
