"""Calibration: alpha, beta and compute rates fitted to benchmark JSON by least squares.

    bench allreduce --json    rows (algo, n, bytes, time_us, via), one launch or the
                                 medians of --launches: per algorithm (via), alpha and
                                 beta of t = s (a alpha + (b + c) n beta)
                                 (formulas.terms; on a host an add is one more pass over
                                 memory, so the fit takes gamma = beta; s = max(1, n /
                                 cores): ranks beyond the cores take turns on them)
    bench pserver --json      rounds rows (path, bytes, pull_ms, push_ms): per data path
                                 t = alpha + n beta for pull and for push; sweep rows with
                                 the shards' apply_ms: gamma_apply per optimizer
    bench fanout --json       fanout rows (path, bytes, shards, gap_ms, round_ms, CPU):
                                 per data path, over the cold rows, a worker's round over
                                 S shards t = alpha + (S - 1) per_shard + n beta, and the
                                 same form over the round's CPU (worker and shards)
    bench moe --json          alltoall rows (ranks, bytes, ours_s, mpi_s): per
                                 all-to-all (ours, MPI's) alpha and beta of
                                 t = s ((n-1) alpha + (n-1)/n B beta) (formulas.terms
                                 "alltoall"; B bytes per rank, s as above)
    bench model --json        rows (model, config, flops_step, step_s_median) by BLAS
                                 threads: t = t0 + F / R per model kind (t0 the per-step
                                 overhead, R the FLOP rate), and each row as it is, used
                                 when a prediction asks for exactly that model and batch

Least squares on relative error (each row divided by its measured time), so
a 4 KB row counts as much as a 64 MB one; a negative intercept is refitted
at zero. Every fit keeps its rows' median and largest relative error.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import numpy as np

from dtlab.lab.bench.harness import nested, read, tables
from dtlab.lab.simulate.formulas import terms
from dtlab.models.config import ConfigError

VIA = {"rd": "doubling", "hd": "halving", "ring": "ring", "shm1": "shm-one-shot",
       "shm2": "shm-two-shot"}


def fit_relative(x: np.ndarray, t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Coefficients k >= 0 minimising sum((x k / t - 1)^2), x (R, K), t (R,); and the
    rows' relative errors (R,). A negative coefficient is dropped (fixed at 0) and the
    rest refitted."""
    keep = np.ones(x.shape[1], bool)
    while True:
        k = np.zeros(x.shape[1])
        scaled = x[:, keep] / t[:, None]  # (R, K')
        k[keep] = np.linalg.lstsq(scaled, np.ones_like(t), rcond=None)[0]
        if (k >= 0).all() or keep.sum() == 1:
            k = np.maximum(k, 0.0)
            return k, (x @ k - t) / t
        keep &= k > 0


def errors(rel: np.ndarray) -> dict:
    return {"rows": int(rel.size), "median_rel_err": float(np.median(np.abs(rel))),
            "max_rel_err": float(np.max(np.abs(rel)))}


def allreduce_rows(rows: list[dict]) -> list[dict]:
    """One launch's rows, or the medians of --launches (the table "median")."""
    return tables(rows, "median") or rows


def fit_allreduce(rows: list[dict], cores: int) -> dict:
    """{algorithm: alpha, beta and the fit's errors} from bench_allreduce rows of one host
    of `cores` cores: n ranks on it run at cores / n of a core each when n > cores, so a
    row's terms are stretched by max(1, n / cores) (step.Host.share)."""
    groups: dict[str, list[dict]] = {}
    for r in rows:
        if r["n"] < 2:
            continue
        name = {"ring": VIA.get(r.get("via"), "ring"), "naive": "naive", "mpi": "mpi"}[r["algo"]]
        groups.setdefault(name, []).append(r)
    out = {}
    for name, rs in groups.items():
        x = np.array([[a * share, (b + c) * r["bytes"] * share] for r in rs
                      for a, b, c in [terms("ring" if name == "mpi" else name, r["n"])]
                      for share in [max(1.0, r["n"] / cores)]])  # (rows, 2)
        t = np.array([r["time_us"] * 1e-6 for r in rs])
        k, rel = fit_relative(x, t)
        out[name] = {"alpha_s": k[0], "beta_s_per_byte": k[1],
                     "ranks": sorted({r["n"] for r in rs}), **errors(rel)}
    return out


def fit_alltoall(rows: list[dict], cores: int) -> dict:
    """{"ours", "mpi": alpha, beta and the fit's errors} from bench_moe's alltoall rows."""
    out = {}
    for name in ("ours", "mpi"):
        rs = [r for r in rows if r["ranks"] >= 2 and r.get(f"{name}_s")]
        if not rs:
            continue
        x = np.array([[a * share, b * r["bytes"] * share] for r in rs
                      for a, b, _ in [terms("alltoall", r["ranks"])]
                      for share in [max(1.0, r["ranks"] / cores)]])  # (rows, 2)
        k, rel = fit_relative(x, np.array([r[f"{name}_s"] for r in rs]))
        out[name] = {"alpha_s": k[0], "beta_s_per_byte": k[1],
                     "ranks": sorted({r["ranks"] for r in rs}), **errors(rel)}
    return out


def fit_line(nbytes: list[float], seconds: list[float]) -> dict:
    x = np.column_stack([np.ones(len(nbytes)), nbytes])
    k, rel = fit_relative(x, np.asarray(seconds))
    return {"alpha_s": k[0], "beta_s_per_byte": k[1], **errors(rel)}


def fit_pserver(rows: list[dict]) -> tuple[dict, dict]:
    """({path: {pull, push}} from rounds rows, {optimizer: gamma_apply} from sweep rows)."""
    paths: dict[str, list[dict]] = {}
    for r in rows:
        if r.get("mode") == "rounds":
            paths.setdefault(r["path"], []).append(r)
    fits = {}
    for path, rs in paths.items():
        if len({r["bytes"] for r in rs}) < 2:
            continue
        if all(r.get("pull_ms") is not None for r in rs):
            fits[path] = {op: fit_line([r["bytes"] for r in rs],
                                       [r[f"{op}_ms"] * 1e-3 for r in rs])
                          for op in ("pull", "push")}
        elif all(r.get("round_ms") is not None for r in rs):
            # a path timed by the whole round only (the push carries the next pull: fused,
            # shared memory, half wire): each half of the round is taken as the pull, the
            # other as the push, so that pull + push is the round
            half = fit_line([r["bytes"] for r in rs], [r["round_ms"] * 0.5e-3 for r in rs])
            fits[path] = {"pull": half, "push": half}
    apply: dict[str, list[float]] = {}
    for r in rows:
        if r.get("op") == "push" and r.get("apply_ms") is not None:
            apply.setdefault(r["optimizer"], []).append(
                r["apply_ms"] * 1e-3 / (r["bytes"] / r["shards"]))
    return fits, {o: float(np.median(v)) for o, v in apply.items()}


def fit_fanout(rows: list[dict]) -> dict:
    """{path: alpha, per_shard, beta} of round = alpha + (S - 1) per_shard + n beta over
    bench fanout's cold rows (a compute gap before each round): a worker's round over
    S shards as a training loop meets it."""
    paths: dict[str, list[dict]] = {}
    for r in rows:
        if r.get("mode") == "fanout" and r["gap_ms"] > 0 and not r.get("co_runners"):
            paths.setdefault(r["path"], []).append(r)
    out = {}
    for path, rs in paths.items():
        if len({r["shards"] for r in rs}) < 2 or len({r["bytes"] for r in rs}) < 2:
            continue
        x = np.array([[1.0, r["shards"] - 1.0, r["bytes"]] for r in rs])  # (rows, 3)
        k, rel = fit_relative(x, np.array([r["round_ms"] * 1e-3 for r in rs]))
        out[path] = {"alpha_s": k[0], "per_shard_s": k[1], "beta_s_per_byte": k[2],
                     "gap_ms": rs[0]["gap_ms"], **errors(rel)}
        if all("client_cpu_ms" in r for r in rs):
            c, crel = fit_relative(x, np.array([(r["client_cpu_ms"] + r["server_cpu_ms"]) * 1e-3
                                                for r in rs]))
            out[path]["cpu"] = {"alpha_s": c[0], "per_shard_s": c[1], "beta_s_per_byte": c[2],
                                **errors(crel)}
    return out


def fit_compute(rows: list[dict], threads: int) -> list[dict]:
    """Per model kind at `threads` BLAS threads: t = t0 + F / R over its rows."""
    out = []
    for model in sorted({r["model"] for r in rows}):
        rs = [r for r in rows if r["model"] == model]
        if len(rs) < 2:
            continue
        x = np.array([[1.0, r["flops_step"]] for r in rs])
        k, rel = fit_relative(x, np.array([r["step_s_median"] for r in rs]))
        out.append({"model": model, "threads": threads, "overhead_s": k[0],
                    "flops_per_s": 1 / k[1] if k[1] else float("inf"), **errors(rel)})
    return out


def exact_rows(rows: list[dict], threads: int) -> list[dict]:
    return [{"model": r["model"], "config": nested(r, "config"), "batch_size": r["batch_size"],
             "threads": threads, "step_s": r["step_s_median"], "flops_step": r["flops_step"],
             "samples_s": r.get("step_s_samples", [])}
            for r in rows]


KINDS = {"allreduce": "allreduce", "pserver": "pserver", "fanout": "pserver", "moe": "moe",
         "model": "model"}  # the benchmarks read: the fit each one's rows go to


def kind_of(meta: dict) -> str:
    kind = KINDS.get(meta.get("bench"))
    if kind is None:
        raise ValueError(f"the JSON of bench {meta.get('bench')}, not of bench "
                         f"{', '.join(KINDS)}")
    return kind


def calibrate(paths: list[str], cores: int) -> dict:
    """The calibration of one host from the benchmark JSON files at `paths`."""
    if not paths:
        raise ConfigError("--calibrate needs benchmark JSON files (--bench FILE ...)")
    ar, ps, a2a, model, sources = [], [], [], [], []
    for path in paths:
        try:
            meta, rows = read(path)
            kind = kind_of(meta)
        except (OSError, ValueError) as e:
            raise ConfigError(f"--bench {path}: {e}") from None
        sources.append({"path": str(path), "kind": kind})
        if kind == "allreduce":
            ar += allreduce_rows(rows)
        elif kind == "pserver":
            ps += rows
        elif kind == "moe":
            a2a += tables(rows, "alltoall")
        else:
            model.append((meta["threads"]["threads"], tables(rows, "step")))
    paths_fit, apply = fit_pserver(ps)
    compute, exact = [], []
    for threads, rows in model:
        compute += fit_compute(rows, threads)
        exact += exact_rows(rows, threads)
    return {"created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "cores": cores, "sources": sources, "allreduce": fit_allreduce(ar, cores),
            "pserver": paths_fit, "fanout": fit_fanout(ps), "alltoall": fit_alltoall(a2a, cores),
            "apply_s_per_byte": apply, "compute": compute,
            "compute_rows": exact}


def load(path: str) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ConfigError(f"--calibration {path}: no such file; write one with --calibrate "
                          "--bench FILE ...") from None
    except ValueError as e:
        raise ConfigError(f"--calibration {path}: not JSON ({e})") from None
    if not isinstance(data, dict) or "allreduce" not in data or "compute" not in data:
        raise ConfigError(f"--calibration {path}: not a calibration (no allreduce/compute)")
    return data
