"""The cost model's step time beside each measured run (dtlab-compare --calibration FILE).

Before the runs, the comparison's own model and batch are benchmarked in one
process at the BLAS thread counts the runs' processes get
(simulate/validate.bench_compute, written as OUT/model-tT.json) and added to
the calibration's compute rows. After the runs, each run's step is predicted
by simulate/validate.predict_run from the run's name, N, S, the
calibration and this host's cores (on an emulated cluster: its hosts and link
rate, simulate/emulated.py) and set beside the measured median step after
warm-up (validate.measure): error = (predicted - measured) / measured.
Nothing measured in the runs goes into a prediction.
"""

from __future__ import annotations

import os
from pathlib import Path

from dtlab.lab.simulate import calibration_fit, validate
from dtlab.lab.simulate.emulated import Cluster
from dtlab.lab.simulate.step import Host
from dtlab.models.config import ConfigError

BUCKET_BYTES = 25e6  # dtlab-sync's --bucket-mb default


def load(path: str, ranks: int, hosts: int) -> dict:
    """The calibration at `path`, refused by name before anything starts if the model
    cannot predict this comparison."""
    cal = calibration_fit.load(path)
    if hosts > 1:
        Cluster(hosts, 1.0).check(ranks)
    return cal


def bench_compute(cal: dict, config: Path, ranks: int, out: Path) -> list[Path]:
    """Benchmark the comparison's model (validate.bench_compute) at the runs' thread count
    and add it to `cal`'s compute rows; the JSON files written."""
    host = Host(os.cpu_count() or 1)
    paths = validate.bench_compute(str(config), [host.threads(ranks)], out)
    cal["compute_rows"] = [*cal.get("compute_rows", []), *validate.compute_rows(paths)]
    return paths


def predict(cal: dict, out: Path, summary: dict) -> None:
    """Sets `predicted_s_per_step`, `measured_median_s_per_step` and `prediction_error` on
    every finished run of `summary` (None on a failed one)."""
    host = Host(os.cpu_count() or 1)
    w = validate.workload(str(out / "config.json"))
    cluster = validate.cluster_of(summary)
    for run in summary["runs"]:
        run["predicted_s_per_step"] = run["measured_median_s_per_step"] = None
        run["prediction_error"] = None
        if run["status"] != "ok":
            continue
        try:
            step, _ = validate.predict_run(run["name"], w, summary["ranks"], summary["shards"],
                                           cal, host, BUCKET_BYTES, cluster)
        except (LookupError, ConfigError) as e:
            run["prediction_note"] = str(e)
            continue
        measured = validate.measure(run, out)["step_s"]
        run["predicted_s_per_step"] = step.step_s
        run["measured_median_s_per_step"] = measured
        run["prediction_error"] = (step.step_s - measured) / measured
