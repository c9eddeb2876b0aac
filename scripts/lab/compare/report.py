"""What a comparison writes: summary.json, report.md and PNG plots.

    summary.json       the setup and, per run, its status, commands, metrics files and numbers
    report.md          the setup, time to target = HE x SE (Hadjis et al. 2016), per-run
                       detail, failed runs with the end of their logs, the plots
    loss_vs_time.png   smoothed training loss against seconds of training
    loss_vs_samples.png   ... against samples seen
    time_split.png     ms per step: compute, comm, pull, other, per run

With --calibration the efficiency table gets the measured median step, the
cost model's and the error (compare/predict.py); with --trace the report
links each run's merged Chrome trace (compare/traces.py).

The plots need matplotlib (the `plot` extra); without it the report says so.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from dtlab.lab.compare.analysis import SPLIT, Curve
from dtlab.lab.compare.runner import Outcome

PLOTS = {"loss_vs_time.png": "loss against wall time",
         "loss_vs_samples.png": "loss against samples seen",
         "time_split.png": "where a step's time goes"}
NO_MATPLOTLIB = "no plots: matplotlib is missing (install the plot extra: pip install -e '.[plot]')"


@dataclass
class Result:
    outcome: Outcome
    curve: Curve | None = None
    stats: dict | None = None
    ran: dict | None = None  # analysis.what_ran: what the run actually did
    phase: str = ""  # in a study (compare/study.py): "tune" or "seed"
    point: dict = field(default_factory=dict)  # the grid point it ran at
    seed: int | None = None
    folder: str = ""  # where its files are, relative to OUT

    @property
    def name(self) -> str:
        return self.outcome.spec.name

    @property
    def ok(self) -> bool:
        return not self.outcome.error


def summary(setup: dict, results: list[Result], plots: list[str], plots_note: str) -> dict:
    runs = []
    for r in results:
        o = r.outcome
        runs.append({"name": r.name, "topology": o.spec.topology, "what": o.spec.describe(),
                     "status": "ok" if r.ok else "failed", "error": o.error, "log_tail": o.tail,
                     "wall_s": o.wall_s, "metrics": [p.name for p in o.metrics],
                     "commands": o.commands, "stats": r.stats, "what_ran": r.ran,
                     "link_bytes": o.link_bytes,
                     "trace": o.trace.name if o.trace else None})
    return {**setup, "runs": runs, "plots": plots, "plots_note": plots_note}


def write_summary(out: Path, data: dict) -> None:
    (out / "summary.json").write_text(json.dumps(data, indent=1) + "\n")


def _f(value, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _mb(nbytes: float | None) -> float | None:
    return None if nbytes is None else nbytes / 1e6


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1e3


def efficiency_table(results: list[Result], runs: list[dict], predicted: bool) -> list[str]:
    """runs: summary.json's, in the order of `results`; predicted: with the cost model's
    columns (dtlab-compare --calibration)."""
    base = results[0]
    base_t = base.stats["time_to_target_s"] if base.stats else None
    extra = " median ms/step | predicted ms/step | error |" if predicted else ""
    rows = ["| run | what | ms/step (HE) | steps to target (SE) | time to target (s) "
            f"| vs {base.name} | samples to target | wall (s) | status |{extra}",
            "|---|---|---|---|---|---|---|---|---|" + "---|" * (3 if predicted else 0)]
    for r, run in zip(results, runs, strict=True):
        s = r.stats or {}
        t = s.get("time_to_target_s")
        ratio = t / base_t if t and base_t else None
        per_step = s["s_per_step"] * 1e3 if s else None
        row = (f"| {r.name} | {r.outcome.spec.describe()} | {_f(per_step, '.2f')} "
               f"| {_f(s.get('steps_to_target'), 'd')} | {_f(t, '.2f')} "
               f"| {_f(ratio, '.2f')} | {_f(s.get('samples_to_target'), ',d')} "
               f"| {r.outcome.wall_s:.1f} | {'ok' if r.ok else 'FAILED'} |")
        if predicted:
            err = run["prediction_error"]
            row += (f" {_f(_ms(run['measured_median_s_per_step']), '.2f')} "
                    f"| {_f(_ms(run['predicted_s_per_step']), '.2f')} "
                    f"| {_f(None if err is None else 100 * err, '+.1f')}"
                    f"{'' if err is None else '%'} |")
        rows.append(row)
    return rows


def prediction_lines(data: dict) -> list[str]:
    """The legend of the predicted columns and the load the runs shared the host with."""
    if not data.get("calibration"):
        return []
    bound = sum(1 for r in data["runs"] if r["prediction_error"] is not None
                and abs(r["prediction_error"]) <= 0.25)
    done = sum(1 for r in data["runs"] if r["prediction_error"] is not None)
    notes = [f"{r['name']}: no prediction ({r['prediction_note']})" for r in data["runs"]
             if r.get("prediction_note")]
    return [f"median ms/step: median step after warm-up (the first tenth, at least 2); "
            f"predicted: the cost model (dtlab-simulate, calibration "
            f"{data['calibration']}, the model benchmarked in one process before the runs); "
            f"error: (predicted - median) / median; {bound} of {done} within 25%."
            + "".join(f" {n}." for n in notes), ""]


def load_line(data: dict) -> list[str]:
    load = data.get("load_avg")
    if not load:
        return []
    return [f"Host load average (1, 5, 15 min) before the runs: "
            f"{', '.join(f'{x:.2f}' for x in load['before'])}; after: "
            f"{', '.join(f'{x:.2f}' for x in load['after'])} "
            f"({data['hardware']['cpu_count']} cores).", ""]


def trace_lines(results: list[Result]) -> list[str]:
    """With --trace: a link to each run's merged trace."""
    merged = [r for r in results if r.outcome.trace]
    if not merged:
        return []
    return ["## Traces", "", *(f"- [{r.name}]({r.outcome.trace.name})" for r in merged), "",
            "Each run's processes (sync ranks; async workers) merged into one Chrome trace, one "
            "track per process, rows compute / comm / wait / optimizer / eval: open it in "
            "Perfetto (ui.perfetto.dev) or chrome://tracing. The servers write no trace: one "
            "would add each shard's apply of every push and the time a pull waits there for "
            "the round (BSP/SSP), which the workers' comm spans hold undivided.", ""]


def detail_table(results: list[Result]) -> list[str]:
    rows = ["| run | final loss | gap | held-out loss | held-out steps to target | samples/s "
            "| updates/s | compute ms | comm ms | pull ms | other ms | MB/step | rounds/step "
            "| staleness mean | p50 | p95 | max |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if r.stats is None:
            rows.append(f"| {r.name} |" + " - |" * 16)
            continue
        s, split, st = r.stats, r.stats["split_ms"], r.stats["staleness"] or {}
        moved = s.get("traffic") or {}
        rows.append(f"| {r.name} | {s['final_loss']:.4f} | {_f(s['gap'], '+.4f')} "
                    f"| {_f(s.get('final_eval_loss'), '.4f')} "
                    f"| {_f(s.get('eval_steps_to_target'), 'd')} "
                    f"| {s['samples_per_s']:,.0f} | {s['updates_per_s']:.1f} "
                    + "".join(f"| {split[k]:.2f} " for k in SPLIT)
                    + f"| {_f(_mb(moved.get('bytes_per_step')), '.3g')} "
                    f"| {_f(moved.get('rounds_per_step'), '.3g')} "
                    + f"| {_f(st.get('mean'), '.2f')} | {_f(st.get('p50'), '.0f')} "
                    f"| {_f(st.get('p95'), '.0f')} | {_f(st.get('max'), 'd')} |")
    return rows


def pipeline_lines(results: list[Result]) -> list[str]:
    """Pipelined runs: the bubble measured and replayed, and what each stage holds."""
    piped = [r for r in results if r.stats and r.stats.get("pipeline")]
    if not piped:
        return []
    rows = ["| run | bubble measured | bubble replayed | extra weight version per stage (KB) "
            "| memory per rank (KB) |", "|---|---|---|---|---|"]
    for r in piped:
        p, ran = r.stats["pipeline"], r.ran or {}
        extra = ran.get("stage_weight_version_bytes") or []
        memory = (ran.get("memory") or {}).get("per_rank_bytes")
        rows.append(f"| {r.name} | {p['bubble']:.3f} | {_f(p['bubble_replay'], '.3f')} | "
                    + (", ".join(f"{b / 1e3:.1f}" for b in extra) or "0") + " | "
                    + f"{_f(None if memory is None else memory / 1e3, ',.1f')} |")
    return ["## Pipelines", "", *rows, "", "bubble measured: the mean over steps of the idle "
            "share of the first stage's step (models/pipeline.py); bubble replayed: its "
            "schedule's unit-time replay (PipeDream's runs: a flushed step, or a 2BW window "
            "of K steps as one op list, (p-1)/(Km+p-1)); extra weight version: the past "
            "parameters PipeDream-2BW or weight stashing keeps on each stage; memory per "
            "rank: parameters, gradients, optimizer state and that version.", ""]


def link_lines(results: list[Result]) -> list[str]:
    """On an emulated cluster: the bytes each run's hosts sent over their shaped links."""
    if not any(r.outcome.link_bytes for r in results):
        return []
    rows = ["| run | MB sent over the links, per host |", "|---|---|"]
    rows += [f"| {r.name} | " + ", ".join(f"{b / 1e6:.2f}" for b in r.outcome.link_bytes or [])
             + " |" for r in results]
    return [*rows, "", "From each emulated host's tc qdisc counter: traffic that crossed the "
            "shaped link (MPI over TCP, gRPC), not shared memory.", ""]


def failed_lines(results: list[Result], title) -> list[str]:
    """The report's section on failed runs: each under `title(run)`, its error and log tail."""
    failed = [r for r in results if not r.ok]
    if not failed:
        return []
    text = ["## Failed runs", ""]
    for r in failed:
        text += [f"### {title(r)}", "", r.outcome.error, "", "```", r.outcome.tail, "```", ""]
    return text


def write_report(out: Path, data: dict, results: list[Result], lines: list[str]) -> None:
    """report.md: `lines` (the setup in words), then the tables, failures and plots."""
    base = results[0].name
    text = ["# Sync vs async training, one model, one budget", "", *lines, "",
            "## Time to target = hardware efficiency x statistical efficiency", "",
            *efficiency_table(results, data["runs"], bool(data.get("calibration"))), "",
            *prediction_lines(data), *load_line(data),
            "ms/step (HE): ms of training / steps; steps to target (SE): first step whose "
            f"trailing mean loss over {data['smooth_window']} step(s) is <= the target; time to "
            f"target: HE x SE (Hadjis et al. 2016, Omnivore); vs {base}: time to target / "
            f"{base}'s; samples to target: SE x global batch; wall: seconds from launch to "
            "exit, start-up and servers included; -: not reached or failed.", "",
            "## Per run", "", *detail_table(results), "", *link_lines(results),
            "final loss: mean training loss of the last 10% of the steps (mean over ranks or "
            "workers); gap: final loss - floor; held-out loss: the last --eval-every "
            "evaluation on the held-out examples (the same for every run), and the first "
            "evaluated step at or below the target; samples/s: global samples per second of "
            "training; updates/s: parameter updates per second (sync and BSP: one per step; "
            "SSP and ASP: one per push); compute/comm/pull/other: mean ms per step of "
            "forward + backward (+ optimizer on sync), communication left exposed (sync: the "
            "wait on the all-reduce after backward; async: the push with the next step's pull "
            "riding on it, and the time servers hold that pull under SSP/BSP), pull (async: "
            "a pull on its own, the first step's), the rest; MB/step and rounds/step: bytes on "
            "the wire a step, every process together, and collectives or pushes a step "
            "(local SGD: one per H steps); staleness: over every push to "
            "every shard, versions applied between its read and its apply (sync: none).", ""]
    text += pipeline_lines(results)
    text += failed_lines(results, lambda r: r.name)
    text += trace_lines(results)
    text += ["## Plots", ""]
    text += ([f"![{PLOTS[p]}]({p})" for p in data["plots"]] if data["plots"]
             else [data["plots_note"]])
    text += ["", "## Files", "", "Each run's metrics (JSON lines: header, then one record "
             "per step) and log are beside this report, named after the run "
             "(NAME.jsonl for sync; NAME.wK.jsonl per worker, NAME.shardK.log per server for "
             "async); summary.json holds every number above and each run's commands.", ""]
    (out / "report.md").write_text("\n".join(text) + "\n")


def plot(out: Path, results: list[Result], floor: float | None,
         target: float) -> tuple[list[str], str]:
    """The PNG plots written, or none and why."""
    done = [r for r in results if r.curve is not None]
    if not done:
        return [], "no plots: no run finished"
    try:
        import matplotlib
    except ImportError:
        return [], NO_MATPLOTLIB
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for name, x, label in (("loss_vs_time.png", "elapsed_s", "seconds of training"),
                           ("loss_vs_samples.png", "samples", "samples seen")):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for r in done:  # async dashed: async-bsp lies on the sync runs where they agree
            (line,) = ax.plot(getattr(r.curve, x), r.curve.smooth, label=r.name, linewidth=1.2,
                              linestyle="-" if r.outcome.spec.topology == "sync" else "--")
            if r.curve.eval_steps.size:  # held-out losses: dots in the run's colour
                at = (r.curve.eval_time_s if x == "elapsed_s"  # each evaluation's own time
                      else getattr(r.curve, x)[r.curve.eval_steps - 1])
                ax.plot(at, r.curve.eval_loss, "o", color=line.get_color(), markersize=3)
        if floor is not None:
            ax.axhline(floor, color="black", linestyle=":", linewidth=1, label="floor")
        ax.axhline(target, color="black", linestyle="--", linewidth=1, label="target")
        ax.set(xlabel=label, ylabel="loss (nats): training, trailing mean; dots: held-out",
               title=PLOTS[name])
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
    fig, ax = plt.subplots(figsize=(7, 0.5 * len(done) + 1.5))
    left = [0.0] * len(done)
    for part in SPLIT:
        widths = [r.stats["split_ms"][part] for r in done]
        ax.barh([r.name for r in done], widths, left=left, label=part)
        left = [a + b for a, b in zip(left, widths, strict=True)]
    ax.invert_yaxis()
    ax.set(xlabel="ms per step", title=PLOTS["time_split.png"])
    ax.legend(fontsize=8, ncol=len(SPLIT), loc="upper center", bbox_to_anchor=(0.5, -0.12))
    fig.savefig(out / "time_split.png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return list(PLOTS), ""
