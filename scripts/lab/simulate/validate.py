"""Validation: the model's step times next to measured runs on this host.

The runs are dtlab-compare's (sync ring / naive / MPI under mpiexec,
async with S fresh shards and N workers), one comparison per N, or read
from a folder of earlier ones (--measured DIR: every folder under it with a
summary.json). The measured step is the median over the steps after
warm-up (the first tenth, at least 2) of rank 0's step_s (sync) or of the
workers' mean step_s (async), and with several launches (--launches K, the
N interleaved) the median over the launches. On this host the model's
compute comes from dtlab.lab.bench.together run before each launch: the
trainers' own compute in N processes at once, per N and role (a sync rank's,
a worker's), written beside the runs; a benchmark of the very model in one
process (as bench model JSON) serves the emulated hosts and a folder
without the former. The communication comes from the calibration; nothing
measured in the runs goes into the prediction.
A folder run across emulated hosts (its summary's `emulated`: hosts and link
rate) is predicted with that cluster's link (simulate/emulated.py).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from threadpoolctl import threadpool_limits

from dtlab.lab.bench import model as bench_model
from dtlab.lab.bench.harness import flatten, read, write
from dtlab.lab.simulate.calibration_fit import exact_rows
from dtlab.lab.simulate.calibration_links import host_network, host_server
from dtlab.lab.simulate.emulated import Cluster, ps_step_on, sync_step_on
from dtlab.lab.simulate.precision import Precision
from dtlab.lab.simulate.step import (
    Host,
    Workload,
    compute_rate,
    ps_step,
    ps_step_together,
    sync_step,
)
from dtlab.models.config import ConfigError
from dtlab.models.cost import estimate
from dtlab.models.model import Replica
from dtlab.models.optim import make_optimizer
from dtlab.models.run.allocator import keep_freed_memory
from dtlab.models.run.launcher_env import mpiexec_path
from dtlab.models.run.metrics import read_metrics
from dtlab.models.run.session import parse, replica_cost
from dtlab.models.zoo import build_model

BOUND = 0.25


def workload_of(setup) -> Workload:
    """What one rank's step of a session.Setup costs (models/cost.py), its gradient in bytes."""
    cost = replica_cost(setup)
    wire = precision_of(setup).gradient
    return Workload(setup.model_name, cost.config, cost.batch_size, cost.flops_step,
                    cost.params_total * wire, cost.optimizer, setup.run.grad_accum,
                    not getattr(setup.extra, "grad_reduce_after", False))


def precision_of(setup) -> Precision:
    """The bytes of each tensor class as the run's --dtype, --precision and --wire set
    them (simulate/precision.py)."""
    return Precision.of(setup.run.dtype, setup.run.precision,
                        getattr(setup.extra, "wire", None) or "fp32")


def workload(config_path: str) -> Workload:
    return workload_of(parse(["--config", config_path], prog="dtlab-simulate --validate"))


def bench_compute(config_path: str, threads: list[int], out: Path, reps: int = 40,
                  warmup: int = 5) -> list[Path]:
    """One process's training step of the runs' model (zero grads, forward, backward,
    update, as bench model times it) at each thread count: every rep's time kept, so
    the step model can take the slowest of N ranks (step.ComputeRate.slowest_of), and the
    medians of its two parts (compute_grads, the optimizer's update) beside them; written
    as bench model JSON rows. The process keeps freed memory from then on, as the
    trainers whose steps this predicts do (models/run/allocator.py)."""
    keep_freed_memory()  # as every trainer does: the same allocator as the runs timed
    setup = parse(["--config", config_path], prog="dtlab-simulate --validate")
    batch = setup.run.batch_size * setup.run.grad_accum
    model = build_model(setup.model_name, setup.model)
    P = model.init_params(setup.run.seed)
    replica = Replica(model, P)
    opt = make_optimizer(setup.optim, P.data, P.decay_mask())
    data = model.prepare(bench_model.make_batch(setup.model_name, setup.model, batch), P)
    cost = estimate(setup.model_name, setup.model, batch, optimizer=replica_cost(setup).optimizer)

    def step() -> tuple[float, float]:
        t0 = time.perf_counter()
        replica.compute_grads([data])
        t1 = time.perf_counter()
        opt.step(P.data, P.grad)
        return t1 - t0, time.perf_counter() - t1

    paths = []
    for t in threads:
        with threadpool_limits(limits=t):
            for _ in range(warmup):
                step()
            parts = [step() for _ in range(reps)]  # (grads, update) seconds
        times = [g + u for g, u in parts]
        row = {"table": "step", "model": setup.model_name, "size": "validate",
               **flatten("config", cost.config),
               "batch_size": batch, "params": cost.params_total, "flops_step": cost.flops_step,
               "step_s_best": min(times), "step_s_median": statistics.median(times),
               "step_s_samples": times,
               "grads_s_median": statistics.median(g for g, _ in parts),
               "update_s_median": statistics.median(u for _, u in parts)}
        path = out / f"model-t{t}.json"
        write(path, "model", [row], threads={"threads": t}, reps=reps, warmup=warmup)
        paths.append(path)
    return paths


def bench_together(config_path: str, ranks: list[int], roles: list[str], out: Path,
                   timeout_s: float = 600.0) -> list[Path]:
    """dtlab.lab.bench.together at every N of `ranks` for every role (rank: the sync runs',
    worker: the async runs'): the compute of N processes stepping at once on this host, as
    FOLDER/together-ROLE-nN.json."""
    paths = []
    for n in ranks:
        for role in roles:
            path = out / f"together-{role}-n{n}.json"
            cmd = [mpiexec_path(), "-n", str(n), sys.executable,
                   "-m", "dtlab.lab.bench.together", "--config", config_path,
                   "--role", role, "--json", str(path)]
            done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                  text=True, timeout=timeout_s)
            if done.returncode != 0:
                raise RuntimeError(f"bench together at N={n} ({role}) exited with "
                                   f"{done.returncode}: {done.stderr.strip()[-2000:]}")
            paths.append(path)
    return paths


def roles_of(runs: str) -> list[str]:
    """bench together's roles that dtlab-compare's runs (a comma list of names) need."""
    names = runs.split(",")
    return [role for role, prefix in (("rank", "sync-"), ("worker", "async-"))
            if any(n.startswith(prefix) for n in names)]


@dataclass(frozen=True)
class Together:
    """The compute of N processes stepping at once (bench together), medians: a
    process's own step (wall), the step's makespan over the N, a process's CPU time."""

    own_s: float
    makespan_s: float
    cpu_s: float

    @property
    def spread_s(self) -> float:
        return max(0.0, self.makespan_s - self.own_s)


def together_rows(paths: list[Path]) -> dict[tuple[str, int], Together]:
    """{(role, N): Together} of bench together files, the samples of one (role, N) in
    several files (launches) pooled."""
    pooled: dict[tuple[str, int], dict[str, list[float]]] = {}
    for path in paths:
        for row in read(path)[1]:
            into = pooled.setdefault((row["role"], row["ranks"]), {})
            for key in ("wall", "makespan", "cpu"):
                into.setdefault(key, []).extend(row[f"{key}_s_samples"])
    return {key: Together(*(statistics.median(v[k]) for k in ("wall", "makespan", "cpu")))
            for key, v in pooled.items()}


def compute_rows(paths: list[Path]) -> list[dict]:
    """bench_compute's files as calibration rows (calibrate.exact_rows), the launches'
    steps at one thread count pooled into one row (their median, all samples)."""
    pooled: dict[int, dict] = {}
    for path in paths:
        meta, rows = read(path)
        for row in exact_rows(rows, meta["threads"]["threads"]):
            into = pooled.setdefault(row["threads"], {**row, "samples_s": []})
            into["samples_s"] += row["samples_s"]
    for row in pooled.values():
        if row["samples_s"]:
            row["step_s"] = statistics.median(row["samples_s"])
    return list(pooled.values())


def run_comparisons(config_path: str, ranks: list[int], runs: str, shards: int, steps: int,
                    folder: Path, timeout_s: float, hosts: int = 1,
                    rates: tuple[float, ...] = (), tcp_cc: str = "reno") -> list[Path]:
    """dtlab-compare at every N of `ranks` into FOLDER/nN (on `hosts` emulated hosts running
    TCP congestion control `tcp_cc`: at every link rate of `rates`, into FOLDER/nN-gX);
    the folders."""
    dirs = []
    for n in ranks:
        for gbit in rates if hosts > 1 else (None,):
            d = folder / (f"n{n}" + (f"-g{gbit:g}" if gbit else ""))
            cmd = [sys.executable, "-m", "dtlab.lab.compare", "--tune", "none", "--seeds", "1",
                   "--config", config_path,
                   "--runs", runs, "--ranks", str(n), "--shards", str(shards),
                   "--steps", str(steps), "--log-every", str(steps), "--out", str(d),
                   "--timeout", str(timeout_s)]
            if gbit:
                cmd += ["--hosts", str(hosts), "--link-gbit", f"{gbit:g}", "--tcp-cc", tcp_cc]
            print(f"# measuring N={n}: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
            done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                  text=True)
            if done.returncode not in (0, 1):  # 1: a run failed, which the table leaves out
                raise RuntimeError(f"dtlab-compare at N={n} exited with {done.returncode}: "
                                   f"{done.stderr.strip()[-2000:]}")
            dirs.append(d)
    return dirs


def measured_dirs(root: str) -> list[Path]:
    base = Path(root)
    found = sorted({p.parent for p in base.glob("**/summary.json")})
    if not found:
        raise ConfigError(f"--measured {root}: no dtlab-compare folder (summary.json) under it")
    return found


def warm(records: list[dict]) -> list[dict]:
    return records[max(2, len(records) // 10):] or records


def measure(run: dict, folder: Path) -> dict:
    """Median step, compute and exposed communication of one finished run."""
    files = [read_metrics(str(folder / m))[1] for m in run["metrics"]]
    per = [warm(rs) for rs in files]
    k = min(len(rs) for rs in per)

    def median(key) -> float:
        return statistics.median(sum(key(rs[i]) for rs in per) / len(per) for i in range(k))

    if run["topology"] == "sync":
        comm = median(lambda r: r["wait_s"])
    else:
        comm = median(lambda r: r["pull_s"] + r["push_s"])
    return {"step_s": median(lambda r: r["step_s"]), "compute_s": median(lambda r: r["compute_s"]),
            "comm_s": comm, "steps": len(files[0])}


def predict_run(name: str, w: Workload, n: int, shards: int, cal: dict, host: Host,
                bucket_bytes: float, cluster: Cluster | None = None,
                together: dict[tuple[str, int], Together] | None = None):
    """The step of run `name` (dtlab-compare's run names) at N ranks or workers on this host,
    or across `cluster`'s emulated hosts (simulate/emulated.py). On this host the
    compute is `together`'s (N processes measured stepping at once) where it holds N for
    the run's role, else one process's rate over its share of the cores."""
    threads = host.threads(n)
    rate = compute_rate(cal, w, threads)
    lockstep = name.startswith("async-bsp")
    role = "rank" if name.startswith("sync-") else "worker"
    measured = (together or {}).get((role, n)) if cluster is None else None
    if measured is not None:
        rate = replace(rate, source=f"{n} processes stepping together")
        if role == "rank":
            kind = name.removeprefix("sync-")
            return sync_step(kind, w, n, host_network(cal, n), measured.own_s, bucket_bytes,
                             host, measured.spread_s), rate
        return ps_step_together(w, n, shards, host_server(cal, w.optimizer), measured.own_s,
                                host, measured.spread_s if lockstep else 0.0), rate
    compute = rate.seconds(w.flops_step) * host.share(n)
    straggler = rate.straggler_s(n) * host.share(n)
    if name.startswith("sync-"):
        kind = name.removeprefix("sync-")
        if cluster:
            return sync_step_on(cluster, kind, w, n, cal, compute, bucket_bytes, host,
                                straggler), rate
        return sync_step(kind, w, n, host_network(cal, n), compute, bucket_bytes, host,
                         straggler), rate
    # a worker's own compute and spread: ps_step shares the cores itself
    own, late = rate.seconds(w.flops_step), rate.straggler_s(n) if lockstep else 0.0
    if cluster:
        return ps_step_on(cluster, w, n, shards, cal, own, host, late), rate
    return ps_step(w, n, shards, host_server(cal, w.optimizer), own, host, late), rate


def cluster_of(summary: dict) -> Cluster | None:
    """The emulated cluster a dtlab-compare folder ran on (its summary's `emulated`), if any."""
    e = summary.get("emulated")
    return Cluster(e["hosts"], e["link_gbit"]) if e else None


def any_local(folders: list[Path]) -> bool:
    """Whether any dtlab-compare folder ran on this host alone (not across emulated hosts)."""
    return any(cluster_of(json.loads((f / "summary.json").read_text())) is None for f in folders)


def launch_together(pooled: dict, folder: Path) -> dict:
    """bench together's figures of `folder`'s launch (its parent's together-*.json,
    measured just before its runs) in place of the pooled ones, when there are any."""
    own = sorted(folder.parent.glob("together-*.json"))
    return {**pooled, **together_rows(own)} if own else pooled


def launch_calibration(cal: dict, folder: Path) -> dict:
    """`cal` with the compute benchmark of `folder`'s launch (its parent's model-t*.json,
    measured just before its runs) in place of the pooled one, when there is one."""
    own = sorted(folder.parent.glob("model-t*.json"))
    return {**cal, "compute_rows": compute_rows(own)} if own else cal


def load_of(folder: Path, summary: dict) -> float | None:
    """The host's highest 1-minute load average around `folder`'s launch (its load.json), or
    around its runs (dtlab-compare's summary), if recorded."""
    path = folder.parent / "load.json"
    if path.exists():
        return max(json.loads(path.read_text()).values())
    load = summary.get("load_avg")
    return max(load["before"][0], load["after"][0]) if load else None


def validate(folders: list[Path], cal: dict, host: Host, bucket_bytes: float,
             together: dict[tuple[str, int], Together] | None = None) -> list[dict]:
    """One row per (run, N, S): the medians over the folders (launches) that hold it of the
    measured figures and of the predictions (each launch's from its own compute benchmarks;
    `together`: bench together's, pooled, where a launch has none of its own)."""
    found: dict[tuple, list[dict]] = {}
    for folder in folders:
        summary = json.loads((folder / "summary.json").read_text())
        n, shards = summary["ranks"], summary["shards"]
        w = workload(str(folder / "config.json"))
        launch_cal = launch_calibration(cal, folder)
        launch_tog = launch_together(together or {}, folder)
        cluster = cluster_of(summary)
        gbit = cluster.gbit if cluster else None
        for run in summary["runs"]:
            if run["status"] != "ok":
                continue
            shards_of = shards if run["topology"] == "async" else None
            step, rate = predict_run(run["name"], w, n, shards or 1, launch_cal, host,
                                     bucket_bytes, cluster, launch_tog)
            found.setdefault((run["name"], n, shards_of, gbit), []).append(
                {"m": measure(run, folder), "stats": run["stats"], "step": step, "rate": rate,
                 "load": load_of(folder, summary), "hosts": cluster.hosts if cluster else 1})
    rows = []
    # by link (this host first, then the fastest), then N
    for (name, n, shards, gbit), got in sorted(
            found.items(), key=lambda kv: (-(kv[0][3] or float("inf")), kv[0][1])):
        def med(values):
            return statistics.median(list(values))

        m = {k: med(g["m"][k] for g in got) for k in ("step_s", "compute_s", "comm_s")}
        pred = med(g["step"].step_s for g in got)
        reached = [g["stats"] for g in got if g["stats"].get("steps_to_target")]
        to_target = med(r["steps_to_target"] for r in reached) if len(reached) == len(got) \
            else None
        err = (pred - m["step_s"]) / m["step_s"]
        loads = [g["load"] for g in got if g["load"] is not None]
        rows.append({
            "run": name, "n": n, "shards": shards, "link_gbit": gbit,
            "hosts": got[0]["hosts"], "launches": len(got),
            "threads": host.threads(n), "share": host.share(n),
            "pred_step_s": pred, "meas_step_s": m["step_s"], "rel_err": err,
            "within": abs(err) <= BOUND,
            "pred_compute_s": med(g["step"].compute_s for g in got),
            "meas_compute_s": m["compute_s"],
            "pred_comm_s": med(g["step"].comm_s for g in got), "meas_comm_s": m["comm_s"],
            "algo": got[0]["step"].algo, "compute_source": got[0]["rate"].source,
            "pred_parts": [g["step"].parts for g in got], "steps": got[0]["m"]["steps"],
            "steps_to_target": to_target,
            "pred_ttt_s": pred * to_target if to_target else None,
            "meas_ttt_s": med(r["measured_time_to_target_s"] for r in reached)
            if to_target else None,
            "max_load": max(loads) if loads else None,
            "meas_step_s_launches": [g["m"]["step_s"] for g in got],
            "pred_step_s_launches": [g["step"].step_s for g in got]})
    return rows
