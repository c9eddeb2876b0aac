"""The at-scale verdict checked where it can be: predicted against measured time to the
held-out target of finished dtlab-compare runs (N = 2 and 4 on this host, N = 8 across
emulated hosts), and the staleness arrivals.py predicts against the staleness those
runs' async workers saw.

    dtlab-compare --config transformer --ranks 2 --runs sync-ring,async-asp,sync-local8 \
        --eval-every 10 --out runs/val2          # and --ranks 4 --out runs/val4
    python -m dtlab.lab.simulate.verdict_check runs/val2 runs/val4 \
        [--calibration runs/calibration.json] [--json runs/verdict-check.json]
    python -m dtlab.lab.simulate.verdict_check --measure 8 --hosts 8 --link-gbit 1 \
        --config transformer --runs sync-ring,async-asp,sync-local8 --steps 600 \
        --eval-every 10 --out runs/val8 --calibration runs/calibration.json
                                                 # runs the comparison first (verdict_runs.py)

For each run the comparison made (its name read as a verdict method: sync-ring, -auto,
-naive, -mpi, -zeroS and async-bsp as sync; async-asp, async-sspS [-div]; sync-localH,
-dilocoH; sync-topkP, -randkP, -sign; async-bsp-backupB as sync's steps), at the run's N:

    steps    statistical.steps_to_target with the folder's config, target and --eval-every,
             the async workers' speeds as the run measured them (each worker's mean step
             over all workers' mean; the spread of log(step / its worker's mean) as jitter)
    step     with --calibration, the cost model's step of that run on this host (its
             compute that of N processes stepping at once: bench together, measured into
             the folder first, `on_host_compute`), or across the emulated hosts the folder
             ran on (simulate/validate.py predict_run, simulate/emulated.py: plain sync
             and async runs); otherwise, and
             for the other methods, the run's own measured seconds a step (then the row
             checks the statistical half only, and says so)
    error    predicted / measured - 1, of the steps, of the step and of their product,
             the time to target (measured: held-out steps x the run's seconds a step)

An async run on one shard is also replayed in its own push order (each push's version
and staleness from its worker's records, AsyncPushes as statistical.py runs it): the
statistics with the real concurrency, against which the arrivals model's order is judged.

Staleness: arrivals.trace of the run's pushes with the measured speeds (and the SSP
bound) against the measured mean and 95th percentile (compare/analysis.py staleness).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

import numpy as np

from dtlab.lab.compare.analysis import staleness as measured_staleness
from dtlab.lab.compare.study import held_time_to_target
from dtlab.lab.presets import config_path
from dtlab.lab.simulate import calibration_fit, validate, verdict_runs
from dtlab.lab.simulate.arrivals import Speeds, Trace, trace
from dtlab.lab.simulate.statistical import Method, steps_to_target
from dtlab.lab.simulate.step import Host
from dtlab.models.config import ConfigError
from dtlab.models.run.cli import run_cli
from dtlab.models.run.metrics import read_metrics
from dtlab.models.run.session import parse

AS_SYNC = re.compile(r"sync-(ring|auto|naive|mpi|zero[123])|async-bsp")
BUCKET_BYTES = 25e6
CALIBRATED = re.compile(r"sync-(ring|auto|naive|mpi)|async-(bsp|asp|ssp\d+)(-div)?")


def method_of(name: str) -> Method | None:
    """The verdict method a comparison run name stands for (None: not simulated)."""
    if AS_SYNC.fullmatch(name):
        return Method("sync")
    for pattern, text in ((r"async-bsp-backup(\d+)", "backup{}"),
                          (r"(?:async|sim)-(asp(?:-div)?)", "{}"),
                          (r"async-(ssp\d+(?:-div)?)", "{}"),
                          (r"sync-((?:local|diloco)\d+)", "{}"),
                          (r"sync-((?:topk|randk)\d+(?:\.\d+)?|sign)", "{}")):
        m = re.fullmatch(pattern, name)
        if m:
            return Method.parse(text.format(m[1]))
    return None


def records_of(folder: Path, run: dict) -> list[list[dict]]:
    return [read_metrics(str(folder / m))[1] for m in run["metrics"]]


def measured_speeds(records: list[list[dict]]) -> Speeds:
    """The workers' speeds as a run measured them (module docstring); equal for one."""
    steps = [np.array([r["step_s"] for r in rs[1:]]) for rs in records]  # warm-up left out
    steps = [s for s in steps if s.size]
    if len(steps) < 2:
        return Speeds()
    means = np.array([s.mean() for s in steps])  # (W,)
    logs = np.concatenate([np.log(s / m) for s, m in zip(steps, means, strict=True)])
    return Speeds(jitter=float(min(2.9, logs.std())),
                  bases=tuple(float(x) for x in means / means.mean()))


def order_of(records: list[list[dict]]) -> Trace | None:
    """A one-shard async run's pushes in apply order, from its workers' records (each
    push's version made v and staleness s: push v - 1 read version v - 1 - s); None when
    the run had several shards or a version is missing (a dropped push)."""
    made = {}
    for w, rs in enumerate(records):
        for r in rs:
            if len(r.get("version", ())) != 1:
                return None
            made[r["version"][0] - 1] = (w, r["version"][0] - 1 - r["staleness"][0])
    if sorted(made) != list(range(len(made))):
        return None
    worker, read = zip(*(made[p] for p in range(len(made))), strict=True)
    return Trace(np.array(worker), np.array(read), np.arange(len(made), dtype=float))


def staleness_row(name: str, n: int, records, speeds: Speeds) -> dict:
    m = method_of(name)
    bound = int(m.value) if m.kind == "ssp" else None
    got = measured_staleness(records)
    pushes = sum(len(rs) for rs in records)
    pred = trace(n, speeds, pushes, bound).summary()
    return {"run": name, "n": n, "pushes": pushes, "pred_mean": pred["mean"],
            "meas_mean": got["mean"], "pred_p95": pred["p95"], "meas_p95": got["p95"]}


def on_host_compute(folder: Path, config: str, n: int, summary: dict) -> dict:
    """The compute of N processes stepping at once on this host (bench together, as
    `dtlab-simulate --validate` measures it: one process's rate over its share of the cores
    misses what N processes of one thread each cost), kept in FOLDER/together-*.json and
    measured there first if the folder has none."""
    paths = sorted(folder.glob("together-*.json"))
    if not paths:
        runs = ",".join(r["name"] for r in summary["runs"])
        paths = validate.bench_together(config, [n], validate.roles_of(runs), folder)
    return validate.together_rows(paths)


def check_folder(folder: Path, cal: dict | None, host: Host) -> tuple[list[dict], list[dict]]:
    summary = json.loads((folder / "summary.json").read_text())
    n, shards = summary["ranks"], summary.get("shards") or 1
    emulated = validate.cluster_of(summary)
    where = "this host" if emulated is None else \
        f"{emulated.hosts} emulated hosts at {emulated.gbit:g} Gbit/s"
    config = str(folder / "config.json")
    setup = parse(["--config", config], "verdict_check")
    if not setup.run.eval_every:
        raise ConfigError(f"{folder}: the comparison ran without --eval-every; the held-out "
                          "target needs it")
    target = summary["target_loss"]
    together = on_host_compute(folder, config, n, summary) if cal is not None and \
        emulated is None else None
    rows, stale = [], []
    for run in summary["runs"]:
        method = method_of(run["name"])
        if run["status"] != "ok" or method is None:
            continue
        records = records_of(folder, run)
        speeds = measured_speeds(records) if run["topology"] == "async" else Speeds()
        if method.kind in ("asp", "ssp"):
            stale.append(staleness_row(run["name"], n, records, speeds))
        stats = run["stats"]
        sim_method = Method("sync") if method.same_steps_as else method
        sim = steps_to_target(setup, sim_method, n, target, setup.run.eval_every, speeds)
        order = order_of(records) if method.kind in ("asp", "ssp") else None
        replayed = None if order is None else steps_to_target(
            setup, sim_method, n, target, setup.run.eval_every, order=order).steps
        meas_step = stats["s_per_step"]
        if cal is not None and CALIBRATED.fullmatch(run["name"]):
            step, _ = validate.predict_run(run["name"], validate.workload(config), n, shards,
                                           cal, host, BUCKET_BYTES,
                                           validate.cluster_of(summary), together)
            pred_step, source = step.step_s, f"cost model, {where}"
        else:
            pred_step, source = meas_step, "measured (statistics checked only)"
        meas_steps = stats.get("eval_steps_to_target")
        rows.append({
            "run": run["name"], "method": method.label, "n": n, "where": where,
            "pred_steps": sim.steps, "meas_steps": meas_steps, "replayed_steps": replayed,
            "pred_step_s": pred_step, "meas_step_s": meas_step, "step_from": source,
            "pred_ttt_s": None if sim.steps is None else sim.steps * pred_step,
            "meas_ttt_s": held_time_to_target(stats)})  # ASP, SSP: the evaluation's own time
    return rows, stale


def error(pred, meas) -> str:
    if pred is None or meas is None:
        return "-"
    return f"{pred / meas - 1:+.0%}"


def table(rows: list[dict], stale: list[dict]) -> list[str]:
    lines = [f"{'run':<22}{'N':>4}{'steps sim/meas':>17}{'err':>7}{'step s pred/meas':>22}"
             f"{'err':>7}{'time to target pred/meas':>28}{'err':>7}  step from"]
    group = None
    for r in rows:
        if (r["n"], r.get("where")) != group:
            group = (r["n"], r.get("where"))
            lines.append(f"# N = {r['n']} on {r.get('where', 'this host')}")

        def pair(a, b, fmt):
            return f"{'-' if a is None else fmt.format(a)}/{'-' if b is None else fmt.format(b)}"
        lines.append(
            f"{r['run']:<22}{r['n']:>4}{pair(r['pred_steps'], r['meas_steps'], '{}'):>17}"
            f"{error(r['pred_steps'], r['meas_steps']):>7}"
            f"{pair(r['pred_step_s'], r['meas_step_s'], '{:.4f}'):>22}"
            f"{error(r['pred_step_s'], r['meas_step_s']):>7}"
            f"{pair(r['pred_ttt_s'], r['meas_ttt_s'], '{:.2f}'):>28}"
            f"{error(r['pred_ttt_s'], r['meas_ttt_s']):>7}  {r['step_from']}")
        if r["replayed_steps"] is not None or r["method"].startswith(("asp", "ssp")):
            lines.append(f"{'':<22}{'':>4}  in the run's own push order (its versions and "
                         f"staleness replayed): {r['replayed_steps'] or '-'} steps "
                         f"({error(r['replayed_steps'], r['meas_steps'])})")
    if stale:
        lines.append("# staleness of the async runs' pushes: arrivals.trace with the measured "
                     "speeds against the runs")
        for s in stale:
            lines.append(f"{s['run']:<22}{s['n']:>4}  mean {s['pred_mean']:.2f} predicted / "
                         f"{s['meas_mean']:.2f} measured; p95 {s['pred_p95']:.1f} / "
                         f"{s['meas_p95']:.1f}  ({s['pushes']} pushes)")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="verdict_check", description=__doc__.split("\n\n")[0])
    p.add_argument("folders", nargs="*", help="dtlab-compare output folders")
    g = p.add_argument_group("run the comparisons first (simulate/verdict_runs.py)")
    g.add_argument("--measure", default="", help="N of the comparisons, a comma list")
    g.add_argument("--hosts", type=int, default=1, help="emulated hosts (one process each)")
    g.add_argument("--link-gbit", type=float, default=1.0, help="the emulated links' rate")
    g.add_argument("--config", default="transformer")
    g.add_argument("--runs", default="sync-ring,async-asp,sync-local8")
    g.add_argument("--steps", type=int, default=600)
    g.add_argument("--eval-every", type=int, default=10)
    g.add_argument("--out", default="runs/verdict-check")
    p.add_argument("--calibration", default=None, help="this host's dtlab-simulate "
                   "calibration: the step from the cost model (else the measured step)")
    p.add_argument("--json", default=None, help="write the rows here")
    o = p.parse_args(argv)
    cal = calibration_fit.load(o.calibration) if o.calibration else None
    host = Host(os.cpu_count() or 1)
    folders = [f for x in o.folders for f in validate.measured_dirs(x)]
    for n in (int(x) for x in o.measure.split(",") if x.strip()):
        config = str(config_path(o.config))
        folders.append(verdict_runs.compare_at(n, config, o.runs, o.steps, o.eval_every,
                                               Path(o.out) / f"n{n}", o.hosts, o.link_gbit))
    if not folders:
        raise ConfigError("give dtlab-compare folders or --measure N")
    rows, stale = [], []
    for folder in folders:
        r, s = check_folder(folder, cal, host)
        rows += r
        stale += s
    print("\n".join(table(rows, stale)))
    if o.json:
        Path(o.json).write_text(json.dumps({"rows": rows, "staleness": stale}, indent=1))
    return 0


def cli() -> None:
    sys.exit(run_cli(main, "verdict_check"))


if __name__ == "__main__":
    cli()
