"""Validation of the model-parallel predictions against measured runs on this host.

Pipelines: dtlab.lab.bench.parallel's pp 2 rows (the transformer sizes d128 and
d256, dp 1, tp 1; GPipe, 1F1B, ZB-H1 at 4 and 8 micro-batches), its measured step
(compute_grads + clip + optimizer step, slowest rank) and bubble. MoE: a dtlab-sync
run of a small MoE transformer (4 experts, top-2) on 2 ranks with --ep 2, the median
step after warm-up of its metrics (validate.warm).

Each launch first benchmarks the very model at one micro-batch in one process at the
ranks' thread count (validate.bench_compute: forward + backward, and the optimizer's
update, timed apart), then runs the measured program; its predictions
(simulate/parallel.py) take their compute rate and update time from that benchmark and
their communication from the calibration (calibration_links.host_p2p point to point, the
all-to-all fit, the all-reduce fits). Nothing measured in the runs goes into the
prediction. With several launches the launch figures' medians are compared.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from dtlab.lab import presets
from dtlab.lab.bench.harness import read
from dtlab.lab.bench.parallel_formulas import SIZES
from dtlab.lab.simulate import calibration_fit, parallel, pipeline, table, validate
from dtlab.lab.simulate.calibration_links import host_alltoall, host_network, host_p2p
from dtlab.lab.simulate.step import Host
from dtlab.models.config import ConfigError
from dtlab.models.cost import estimate
from dtlab.models.run.launcher_env import mpiexec_path
from dtlab.models.run.metrics import read_metrics
from dtlab.models.run.session import parse

PP_SIZES = ("d128", "d256")
MICROBATCHES = (4, 8)
MOE_FLAGS = ["--config", str(presets.config_path(presets.DEFAULT)), "--seq-len", "64",
             "--d-model", "128", "--n-heads", "4", "--d-ff", "256", "--moe-experts", "4",
             "--moe-top-k", "2", "--batch-size", "8"]
MOE_EP = 2


def write_config(flags: list[str], folder: Path) -> Path:
    setup = parse(flags, prog="dtlab-simulate --validate-parallel")
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "config.json"
    path.write_text(json.dumps(setup.as_dict(), indent=1) + "\n")
    return path


def size_flags(size: str) -> list[str]:
    flags, b = SIZES[size]
    return [*flags, "--batch-size", str(b)]


def run(cmd: list[str], timeout_s: float) -> None:
    print(f"# measuring: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited with {done.returncode}: "
                           f"{(done.stdout + done.stderr).strip()[-2000:]}")


def measure(out: Path, launches: int, moe_steps: int, threads: int, timeout_s: float) -> None:
    """Every launch's compute benchmarks, bench_parallel rows and MoE run under OUT/launchK."""
    for k in range(launches):
        launch = out / f"launch{k}"
        before = os.getloadavg()[0]
        for size in PP_SIZES:
            config = write_config(size_flags(size), launch / size)
            validate.bench_compute(str(config), [threads], launch / size)
        run([sys.executable, "-m", "dtlab.lab.bench.parallel", "--sizes", ",".join(PP_SIZES),
             "--grids", "1x2", "--microbatches", ",".join(map(str, MICROBATCHES)),
             "--steps", "5", "--json", str(launch / "parallel.json")], timeout_s)
        config = write_config(MOE_FLAGS, launch / "moe")
        validate.bench_compute(str(config), [threads], launch / "moe")
        run([mpiexec_path(), "-n", str(MOE_EP), sys.executable, "-m", "dtlab.collective.train",
             "--config", str(config), "--ep", str(MOE_EP), "--steps", str(moe_steps),
             "--log-every", str(moe_steps), "--metrics", str(launch / "moe" / "metrics.jsonl")],
            timeout_s)
        (launch / "load.json").write_text(json.dumps(
            {"before": before, "after": os.getloadavg()[0]}))


def launch_dirs(out: Path) -> list[Path]:
    found = sorted(p.parent for p in out.glob("launch*/parallel.json"))
    if not found:
        raise ConfigError(f"--measured {out}: no launch*/parallel.json under it (a "
                          "--validate-parallel folder)")
    return found


def compute_of(folder: Path) -> tuple[float, float, object]:
    """(seconds per FLOP of forward + backward, the optimizer's update in seconds, the
    setup) from the one-process benchmark of folder's config (its model-t*.json: the
    launch's, validate.bench_compute)."""
    setup = parse(["--config", str(folder / "config.json")], prog="dtlab-simulate")
    rows = [read(p)[1][0] for p in sorted(folder.glob("model-t*.json"))]
    if not rows:
        raise ConfigError(f"{folder}: no compute benchmark (model-t*.json)")
    r = rows[0]
    return r["grads_s_median"] / r["flops_step"], r["update_s_median"], setup


def predict_pipeline(cal: dict, launch: Path, row: dict, host: Host, bucket_bytes: float) -> dict:
    spf, update_s, setup = compute_of(launch / row["size"])
    b = setup.run.batch_size
    work = parallel.Work(setup.model_name, setup.model, b, row["microbatches"], row["schedule"],
                         4, tuple(row["stage_bounds"]),
                         estimate(setup.model_name, setup.model, b).flops_step)
    fabric = parallel.Fabric(host_network(cal, row["world"]), host_p2p(cal), one_host=True)
    return parallel.parallel_step(work, parallel.Layout(1, row["pp"], 1, 1), fabric, spf, host,
                                  bucket_bytes, update_s=update_s)


def predict_moe(cal: dict, launch: Path, host: Host, bucket_bytes: float) -> dict:
    folder = launch / "moe"
    spf, update_s, setup = compute_of(folder)
    b = setup.run.batch_size
    work = parallel.Work(setup.model_name, setup.model, b, setup.run.grad_accum, "1f1b", 4,
                         tuple(pipeline.stage_bounds(setup.model_name, setup.model, b, 1)),
                         estimate(setup.model_name, setup.model, b).flops_step)
    fabric = parallel.Fabric(host_network(cal, MOE_EP), None, host_alltoall(cal), one_host=True)
    return parallel.parallel_step(work, parallel.Layout(1, 1, MOE_EP, 1), fabric, spf, host,
                                  bucket_bytes, update_s=update_s)


def load_of(launch: Path) -> float | None:
    path = launch / "load.json"
    return max(json.loads(path.read_text()).values()) if path.exists() else None


def rows_of(launches: list[Path], cal: dict, host: Host, bucket_bytes: float) -> list[dict]:
    """One row per pipeline case and one for the MoE run: medians over the launches."""
    found: dict[tuple, list[dict]] = {}
    for launch in launches:
        load = load_of(launch)
        for r in read(launch / "parallel.json")[1]:
            if r["pp"] < 2:
                continue
            pred = predict_pipeline(cal, launch, r, host, bucket_bytes)
            key = (f"{r['size']} pp{r['pp']}", r["schedule"], r["microbatches"])
            found.setdefault(key, []).append(
                {"meas_step_s": r["step_ms"] / 1e3, "meas_bubble": r["bubble"],
                 "pred": pred, "load": load})
        metrics = launch / "moe" / "metrics.jsonl"
        if metrics.exists():
            records = validate.warm(read_metrics(str(metrics))[1])
            found.setdefault((f"moe ep{MOE_EP}", "-", 1), []).append(
                {"meas_step_s": statistics.median(x["step_s"] for x in records),
                 "meas_bubble": None, "pred": predict_moe(cal, launch, host, bucket_bytes),
                 "load": load})
    rows = []
    for (case, schedule, m), got in found.items():
        def med(values):
            return statistics.median(list(values))

        pred = med(g["pred"]["step_s"] for g in got)
        meas = med(g["meas_step_s"] for g in got)
        err = (pred - meas) / meas
        loads = [g["load"] for g in got if g["load"] is not None]
        pipelined = got[0]["meas_bubble"] is not None
        rows.append({
            "case": case, "schedule": schedule, "microbatches": m, "launches": len(got),
            "pred_step_s": pred, "meas_step_s": meas, "rel_err": err,
            "within": abs(err) <= validate.BOUND,
            "pred_bubble": med(g["pred"]["bubble"] for g in got) if pipelined else None,
            "meas_bubble": med(g["meas_bubble"] for g in got) if pipelined else None,
            "pred_p2p_s": med(g["pred"]["p2p_s"] for g in got),
            "pred_a2a_s": med(g["pred"]["a2a_s"] for g in got),
            "pred_allreduce_s": med(g["pred"]["allreduce_s"] for g in got),
            "max_load": max(loads) if loads else None,
            "meas_step_s_launches": [g["meas_step_s"] for g in got],
            "pred_step_s_launches": [g["pred"]["step_s"] for g in got]})
    return rows


def main(o, new_folder) -> int:
    cal = calibration_fit.load(o.calibration)
    host_p2p(cal), host_alltoall(cal)  # a ConfigError naming a missing fit, before measuring
    host = Host(os.cpu_count() or 1)
    if o.measured:
        out = Path(o.measured)
    else:
        out = new_folder(o.out)
        measure(out, o.launches, o.moe_steps, host.threads(2), o.timeout)
    launches = launch_dirs(out)
    rows = rows_of(launches, cal, host, o.bucket_mb * 1e6)
    print(f"# parallel validation on this host: {host.cores} cores; calibration "
          f"{o.calibration}; runs in {out}, {len(launches)} launch(es); compute: a one-process "
          "benchmark of each model at one micro-batch beside each launch's runs")
    print(table.parallel_validation(rows))
    validate_json = {"calibration": o.calibration, "cores": host.cores, "bound": validate.BOUND,
                     "rows": rows}
    if o.json:
        Path(o.json).parent.mkdir(parents=True, exist_ok=True)
        Path(o.json).write_text(json.dumps(validate_json, indent=1) + "\n")
    return 0 if all(r["within"] for r in rows) else 1
