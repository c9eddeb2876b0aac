"""dtlab-compare at a tiny size: every file it writes, async BSP equal to sync step by
step, its numbers against the metrics, failed and interrupted runs cleaned up, bad configs
named before anything starts."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from support import emulated_runs

from dtlab.lab.compare import cli as compare_cli
from dtlab.lab.compare import cluster
from dtlab.models.run.metrics import read_metrics

pytestmark = pytest.mark.usefixtures("mpiexec")

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--model", "mlp", "--d-in", "4", "--d-hidden", "8", "--n-layers", "1",
        "--n-classes", "3", "--n-samples", "512", "--batch-size", "8", "--clip", "0"]
FAST = ["--lr", "0.1", "--warmup", "0"]  # reaches the floor + 0.1 in a few dozen steps
SUMMARY_KEYS = {"command", "config", "model", "n_params", "dataset", "floor", "target_loss",
                "target_rule", "smooth_window", "ranks", "shards", "batch_size", "global_batch",
                "steps", "hardware", "versions", "started", "runs", "plots", "plots_note",
                "cluster", "emulated", "calibration", "load_avg", "grid"}
STATS_KEYS = {"steps", "time_s", "s_per_step", "steps_to_target", "time_to_target_s",
              "measured_time_to_target_s", "samples_to_target", "final_loss", "gap",
              "samples_per_s", "updates_per_s", "split_ms", "allreduce_ms", "staleness",
              "final_eval_loss", "eval_steps_to_target", "eval_time_to_target_s", "held_out",
              "traffic", "pipeline"}


ONCE = ["--tune", "none", "--seeds", "1"]  # each method once, as configured: no study


def compare(*args: str, env: dict | None = None, timeout: float = 120, plots: bool = False):
    """dtlab-compare; without --tune or --seeds each method runs once, into OUT itself.
    Without `plots` it draws none (--no-plots: a second of matplotlib a comparison that
    only the test that checks the plots needs)."""
    once = [] if {"--tune", "--seeds"} & set(args) else ONCE
    drawn = [] if plots else ["--no-plots"]
    return subprocess.run([sys.executable, "-m", "dtlab.lab.compare", *once, *drawn, *args],
                          cwd=ROOT,
                          text=True, capture_output=True, timeout=timeout,
                          env={**os.environ, **(env or {})})


def left_behind(path: Path) -> list[str]:
    """Command lines of live processes that name `path` (every process a run starts does)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if str(path) in cmd and proc.name != str(os.getpid()):
            found.append(f"{proc.name}: {cmd}")
    return found


def losses(path: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(str(path))[1]]


def rows(report: str, name: str) -> list[str]:
    return [line for line in report.splitlines() if line.startswith(f"| {name} |")]


def test_tiny_comparison_writes_everything_and_bsp_equals_sync(tmp_path):
    out, steps = tmp_path / "out", 40
    r = compare(*TINY, *FAST, "--steps", str(steps), "--runs", "sync-ring,async-bsp",
                "--eval-every", "10", "--out", str(out), plots=True)
    assert r.returncode == 0, r.stderr
    assert f"report: {out / 'report.md'}" in r.stdout
    assert not left_behind(tmp_path)

    sync = losses(out / "sync-ring.jsonl")
    workers = [losses(out / f"async-bsp.w{w}.jsonl") for w in (0, 1)]
    assert len(sync) == steps and all(len(w) == steps for w in workers)
    bsp = list(np.mean(workers, axis=0))
    assert bsp == sync  # the README's claim, every step, to the last bit
    held = {name: {r["step"]: r["eval_loss"] for r in read_metrics(str(out / name))[1]
                   if "eval_loss" in r}
            for name in ("sync-ring.jsonl", "async-bsp.w0.jsonl", "async-bsp.w1.jsonl")}
    assert sorted(held["sync-ring.jsonl"]) == [10, 20, 30, 40]
    assert held["async-bsp.w0.jsonl"] == held["async-bsp.w1.jsonl"] == held["sync-ring.jsonl"]

    summary = json.loads((out / "summary.json").read_text())
    assert set(summary) == SUMMARY_KEYS
    assert summary["global_batch"] == 16 and summary["steps"] == steps
    assert summary["target_loss"] == summary["floor"] + 0.1
    assert json.loads((out / "config.json").read_text()) == summary["config"]
    assert [run["name"] for run in summary["runs"]] == ["sync-ring", "async-bsp"]
    window = summary["smooth_window"]
    for run in summary["runs"]:
        assert run["status"] == "ok" and not run["error"], run
        s = run["stats"]
        assert set(s) == STATS_KEYS
        assert s["steps"] == steps
        assert s["final_loss"] == pytest.approx(np.mean(sync[-steps // 10:]), rel=1e-12)
        smooth = [np.mean(sync[max(0, k - window):k]) for k in range(1, steps + 1)]
        first = next(k for k, v in enumerate(smooth, 1) if v <= summary["target_loss"])
        assert s["steps_to_target"] == first
        assert s["samples_to_target"] == first * 16
        assert s["time_to_target_s"] == pytest.approx(s["s_per_step"] * first)
        assert s["samples_per_s"] == pytest.approx(steps * 16 / s["time_s"])
    sync_stats, bsp_stats = (run["stats"] for run in summary["runs"])
    assert sync_stats["staleness"] is None
    assert bsp_stats["staleness"] == {"mean": 0.0, "p50": 0.0, "p95": 0.0, "max": 0,
                                      "pushes": 2 * 2 * steps}  # workers x shards x steps

    report = (out / "report.md").read_text()
    for name in ("sync-ring", "async-bsp"):
        assert len(rows(report, name)) == 2  # one row in each table
        assert rows(report, name)[0].endswith("| ok |")
    for run in summary["runs"]:  # MB/step and rounds/step: the run's own traffic
        cells = [c.strip() for c in rows(report, run["name"])[1].split("|")]
        moved = run["stats"]["traffic"]
        assert cells[12:14] == [f"{moved['bytes_per_step'] / 1e6:.3g}",
                                f"{moved['rounds_per_step']:.3g}"], cells
    if importlib.util.find_spec("matplotlib"):
        assert summary["plots"] == ["loss_vs_time.png", "loss_vs_samples.png", "time_split.png"]
        for png in summary["plots"]:
            assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
            assert f"]({png})" in report
    else:
        assert "matplotlib is missing" in report and not summary["plots"]


def test_a_failed_run_is_reported_with_its_log_and_the_others_go_on(tmp_path):
    out = tmp_path / "out"
    # only the sync trainer reads this variable, and it refuses the value
    r = compare(*TINY, "--steps", "5", "--runs", "sync-ring,async-asp", "--out", str(out),
                env={"DTLAB_COLLECTIVE_CHECK": "bogus"})
    assert r.returncode == 1, r.stderr
    assert "1 of 2 runs failed (sync-ring)" in r.stderr
    assert not left_behind(tmp_path)
    failed, ok = json.loads((out / "summary.json").read_text())["runs"]
    assert failed["status"] == "failed" and failed["error"].startswith("exited with")
    assert "'bogus'" in failed["log_tail"] and failed["stats"] is None
    assert ok["status"] == "ok" and ok["stats"]["steps"] == 5
    report = (out / "report.md").read_text()
    assert rows(report, "sync-ring")[0].endswith("| FAILED |")
    assert "## Failed runs" in report and "### sync-ring" in report and "'bogus'" in report


def test_ctrl_c_stops_every_process_it_started(tmp_path):
    """SIGINT stops dtlab-compare and every process it started, also where it was started
    with SIGINT ignored, as a shell starts a background job (Python would keep it ignored);
    whatever a failure leaves behind is killed, not left to run a million steps."""
    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-m", "dtlab.lab.compare", *ONCE, *TINY,
                             "--steps", "1000000", "--runs", "async-asp", "--shards", "2",
                             "--out", str(out)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    try:
        deadline = time.monotonic() + 60
        while not (out / "async-asp.w1.jsonl").exists():  # servers and workers are up
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)
        assert left_behind(tmp_path)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            for line in left_behind(tmp_path):
                with contextlib.suppress(OSError):
                    os.kill(int(line.split(":")[0]), signal.SIGKILL)
    assert proc.returncode == 130, err
    assert err.rstrip().endswith("dtlab-compare: interrupted")
    assert not left_behind(tmp_path)


CALIBRATION = {"cores": 2, "allreduce": {"ring": {"alpha_s": 1e-3, "beta_s_per_byte": 1e-9}},
               "pserver": {"shm": {op: {"alpha_s": 2e-3, "beta_s_per_byte": 1e-9}
                                   for op in ("pull", "push")}},
               "apply_s_per_byte": {}, "compute": []}


def expected_max_of_two(samples: list[float]) -> float:
    """E[slowest of 2] - median for a normal of the samples' robust spread (IQR / 1.349)."""
    q1, _, q3 = statistics.quantiles(samples, n=4)
    return (q3 - q1) / 1.349 / math.sqrt(math.pi)


def test_traces_merged_and_the_cost_model_beside_each_run(tmp_path):
    out, steps = tmp_path / "out", 12
    cal = tmp_path / "cal.json"
    cal.write_text(json.dumps(CALIBRATION))
    r = compare(*TINY, "--steps", str(steps), "--runs", "sync-ring,async-bsp", "--trace",
                "--calibration", str(cal), "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert not left_behind(tmp_path)
    summary = json.loads((out / "summary.json").read_text())
    report = (out / "report.md").read_text()
    names = {"sync-ring": "sync rank", "async-bsp": "async worker"}
    for run in summary["runs"]:
        # one trace of both processes, each its own pid, every step's compute span in it
        assert run["trace"] == f"{run['name']}.trace.json"
        assert f"[{run['name']}]({run['trace']})" in report
        events = json.loads((out / run["trace"]).read_text())["traceEvents"]
        procs = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
        workers = {pid: who for pid, who in procs.items() if not who.startswith("shard")}
        assert sorted(workers.values()) == [f"{names[run['name']]} {i}" for i in (0, 1)]
        for pid in workers:
            compute = [e for e in events if e["pid"] == pid and e["name"] == "compute"]
            assert sorted(e["args"]["step"] for e in compute) == list(range(1, steps + 1))
        if run["name"] == "async-bsp":  # each shard's trace: a BSP round applied per step
            shards = [pid for pid, who in procs.items() if who.startswith("shard")]
            assert sorted(procs[p] for p in shards) == ["shard 0", "shard 1"]
            for pid in shards:
                applies = [e for e in events if e["pid"] == pid and e["name"] == "apply"]
                assert sorted(e["args"]["version"] for e in applies) == list(
                    range(1, steps + 1))
                assert all(sorted(e["args"]["workers"]) == [0, 1] for e in applies)
                assert any(e["pid"] == pid and e["name"] == "receive push" for e in events)
    # the model's step beside the measured median step after warm-up
    cores = os.cpu_count()
    share, threads = max(1.0, 2 / cores), max(1, cores // 2)
    bench = json.loads((out / f"model-t{threads}.json").read_text())["rows"][0]
    samples = bench["step_s_samples"]
    sync, bsp = summary["runs"]
    rank0 = read_metrics(str(out / "sync-ring.jsonl"))[1]
    assert sync["measured_median_s_per_step"] == pytest.approx(
        statistics.median(x["step_s"] for x in rank0[2:]))
    # 268 bytes of gradient: recursive doubling (alpha + n beta + n gamma), nothing hidden
    allreduce = 1e-3 + 67 * 4 * 2e-9
    assert sync["predicted_s_per_step"] == pytest.approx(
        share * (statistics.median(samples) + expected_max_of_two(samples) + allreduce))
    for run in (sync, bsp):
        assert run["predicted_s_per_step"] > 0
        assert run["prediction_error"] == pytest.approx(
            run["predicted_s_per_step"] / run["measured_median_s_per_step"] - 1)
        cells = rows(report, run["name"])[0].split("|")[-4:-1]
        assert float(cells[1]) == pytest.approx(1e3 * run["predicted_s_per_step"], abs=0.006)
        assert cells[2].strip() == f"{100 * run['prediction_error']:+.1f}%"
    assert "median ms/step | predicted ms/step | error |" in report
    assert "Host load average" in report


@pytest.mark.parametrize("grid", [["--tp", "2"], ["--pp", "2", "--pp-schedule", "gpipe",
                                                  "--grad-accum", "2"]], ids=["tp2", "pp2"])
def test_model_parallel_replicas_run_under_both_topologies(tmp_path, grid):
    """--tp/--pp pass through: a sync replica and a worker group of 2 ranks each; one
    group under BSP is the sync computation bit for bit; held-out losses, per-rank traces
    merged."""
    out, steps = tmp_path / "out", 10
    r = compare(*TINY, *FAST, "--steps", str(steps), "--runs", "sync-ring,async-bsp",
                "--ranks", "1", *grid, "--eval-every", "5", "--trace", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert not left_behind(tmp_path)
    sync, bsp = losses(out / "sync-ring.jsonl"), losses(out / "async-bsp.w0.jsonl")
    assert len(sync) == steps and bsp == sync
    summary = json.loads((out / "summary.json").read_text())
    assert summary["grid"]["tp" if "--tp" in grid else "pp"] == 2
    for run in summary["runs"]:
        assert run["status"] == "ok" and run["stats"]["final_eval_loss"] is not None, run
        events = json.loads((out / run["trace"]).read_text())["traceEvents"]
        names = [e["args"]["name"] for e in events if e["name"] == "process_name"]
        assert len([n for n in names if not n.startswith("shard")]) == 2  # the replica's ranks
    assert "every replica: " in (out / "report.md").read_text()


@pytest.mark.parametrize("args, named", [
    (["--runs", "sync-ring,async-foo"], "unknown run 'async-foo'"),
    (["--runs", "async-ssp"], "unknown run 'async-ssp'"),  # SSP needs its bound: async-ssp2
    (["--runs", "sync-ring,sync-ring"], "names sync-ring twice"),
    (["--ranks", "0"], "--ranks must be at least 1"),
    (["--shards", "-1"], "--shards must be at least 1"),
    (["--steps", "0"], "--steps"),
    (["--lr", "-1"], "--lr"),
    (["--timeout", "0"], "--timeout must be positive"),
    (["--target-loss", "0.01"], "below the data's floor"),
    (["--config", "no/such.json"], "--config no/such.json"),
    (["--metrics", "m.jsonl"], "--metrics has no effect"),
    (["--calibration", "no/cal.json"], "--calibration no/cal.json: no such file"),
    (["--tp", "3"], "--d-hidden 8 is not divisible by --tp 3"),
    (["--ep", "2"], "--ep 2 needs a model with experts"),
    (["--pp", "9"], "--pp 9 is more stages than the model's 3 layers"),
    (["--ranks", "3", "--ep", "2"], "--ranks 3 (the data ranks) is not divisible by --ep 2"),
    (["--tp", "0"], "--tp must be at least 1"),
])
def test_a_bad_config_is_named_before_anything_starts(tmp_path, args, named):
    out = tmp_path / "out"
    r = compare(*TINY, *args, "--out", str(out), timeout=60)
    assert r.returncode == 2, r
    assert "error:" in r.stderr and named in r.stderr, r.stderr
    assert not out.exists()


def test_data_without_a_floor_needs_a_target(tmp_path):
    r = compare("--model", "transformer", "--data", "text", "--path", "README.md",
                "--out", str(tmp_path / "out"), timeout=60)
    assert r.returncode == 2 and "no known loss floor: give --target-loss" in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


def test_out_must_be_new_or_empty(tmp_path):
    kept = tmp_path / "kept.txt"
    kept.write_text("mine")
    r = compare(*TINY, "--out", str(tmp_path), timeout=60)
    assert r.returncode == 2 and f"--out {tmp_path}: exists" in r.stderr, r.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["kept.txt"] and kept.read_text() == "mine"


def test_an_unknown_model_is_named(tmp_path):
    config = tmp_path / "run.json"
    config.write_text(json.dumps({"model_name": "nosuch"}))
    for args, named in ((["--model", "nosuch"], "invalid choice: 'nosuch'"),
                        (["--config", str(config)], "unknown model 'nosuch'")):
        r = compare(*args, "--out", str(tmp_path / "out"), timeout=60)
        assert r.returncode == 2 and named in r.stderr, r.stderr
        assert not (tmp_path / "out").exists()


def test_a_model_size_sweep_fits_power_laws_on_one_budget(tmp_path):
    out = tmp_path / "sweep"
    r = compare(*TINY, *FAST, "--steps", "40", "--sweep", "model-size", "--sweep-sizes",
                "4,8,16", "--runs", "sync-ring", "--eval-every", "10", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert f"sweep: {out / 'sweep.md'}" in r.stdout and not left_behind(tmp_path)
    result = json.loads((out / "sweep.json").read_text())
    rows = result["rows"]
    assert [row["width"] for row in rows] == [4, 8, 16]
    assert rows[0]["steps"] == 40 and rows[1]["steps"] < 40 and rows[2]["steps"] < rows[1]["steps"]
    budget = rows[0]["compute"]
    assert all(budget - row["flops_per_step"] < row["compute"] <= budget for row in rows)
    assert all(row["final_eval_loss"] is not None for row in rows)
    for key in ("loss_vs_params", "loss_vs_compute"):
        fit = result[key]
        if fit is not None:  # the fit needs every loss above the floor
            assert np.isfinite(fit["exponent"]) and fit["points"] >= 2
    assert "| width | parameters | steps |" in (out / "sweep.md").read_text()


def test_bad_sweep_sizes_are_named(tmp_path):
    r = compare(*TINY, "--sweep", "model-size", "--sweep-sizes", "8", "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and "needs two or more distinct positive widths" in r.stderr
    assert not (tmp_path / "o").exists()


@pytest.mark.skipif(bool(cluster.check()), reason=cluster.check() or "-")
def test_an_emulated_cluster_runs_both_topologies_over_its_shaped_links(emulated_validation):
    """At a tenth of the link rate the all-reduce time grows by what the rate predicts for
    the bytes it moves; the bytes crossed the shaped links; nothing is left behind. The
    comparisons are those dtlab-simulate --validate ran across the emulated hosts
    (support/emulated_runs.py: dtlab-compare --hosts 2 --link-gbit 1, then 0.1), checked
    here instead of a second pair of the same runs."""
    assert compare_cli.parse_args([*TINY, "--hosts", "2"])[0].extra.tcp_cc == "reno"  # default
    comm_ms, sent = {}, {}
    for gbit in emulated_runs.RATES:
        out = emulated_validation.comparison(gbit)
        assert (out / "summary.json").exists(), emulated_validation.done.stderr
        summary = json.loads((out / "summary.json").read_text())
        assert "2 emulated hosts" in summary["cluster"]
        # read back from a host: the namespaces run the congestion control compare.py set
        assert "TCP congestion control reno" in summary["cluster"]
        assert summary["emulated"]["tcp_cc"] == "reno"
        sync, bsp = summary["runs"]
        assert sync["status"] == bsp["status"] == "ok"
        header, records = read_metrics(str(out / "sync-ring.jsonl"))
        # each host owns its share of the machine's CPUs, and its rank sizes its threads by it
        assert header["threads"]["source"] == "affinity mask set by the launcher"
        assert header["threads"]["cores"] == max(1, len(os.sched_getaffinity(0)) // 2)
        comm = [r["comm_s"] for r in records[2:]]
        comm_ms[gbit] = 1e3 * float(np.median(comm))  # after the connections' warm-up
        sent[gbit] = sync["link_bytes"]
        assert all(b > 0 for b in bsp["link_bytes"])  # gRPC crossed the links too
    grad_bytes, steps = emulated_runs.GRAD_BYTES, emulated_runs.STEPS
    for gbit, per_host in sent.items():  # ring, 2 ranks: each host sends the gradient a step
        assert all(b >= steps * grad_bytes for b in per_host), (gbit, per_host)
    # ring, 2 ranks: each host sends one gradient per step over its link
    slow = grad_bytes * 8 / 0.1e9 * 1e3  # ms for one gradient at 0.1 Gbit/s
    predicted = grad_bytes * 8 * (1 / 0.1e9 - 1 / 1.0e9) * 1e3  # ms more per step
    grown = comm_ms[0.1] - comm_ms[1.0]
    print(f"all-reduce ms per step: {comm_ms}; the 0.1 Gbit/s link needs {slow:.0f} ms; "
          f"grew {grown:.0f} ms, the rates predict {predicted:.0f} ms")
    assert 0.9 * slow <= comm_ms[0.1] <= 1.6 * slow  # the link sets the pace
    assert grown >= 0.5 * predicted  # (at 1 Gbit/s this host's CPU adds its own share)
    made = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout + \
        subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert not re.search(r"\bdtl\d+-", made), made  # namespaces, bridge, veths: all gone
    assert not left_behind(emulated_validation.out)


@pytest.mark.skipif(bool(cluster.check()), reason=cluster.check() or "-")
def test_emulated_hosts_refuse_a_congestion_control_the_kernel_does_not_allow(tmp_path):
    r = compare(*TINY, "--hosts", "2", "--tcp-cc", "no-such-cc", "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and "--tcp-cc no-such-cc: not allowed on this machine" in r.stderr
    assert not (tmp_path / "o").exists() or not any((tmp_path / "o").iterdir())


def test_emulated_hosts_need_a_positive_link_rate(tmp_path):
    r = compare(*TINY, "--hosts", "2", "--link-gbit", "0", "--out", str(tmp_path / "o"))
    assert r.returncode == 2 and "--link-gbit must be a positive rate" in r.stderr


def test_zero_runs_train_what_the_ring_trains_and_report_their_memory(tmp_path):
    out = tmp_path / "out"
    r = compare(*TINY, *FAST, "--steps", "12", "--runs", "sync-ring,sync-zero1,sync-zero3",
                "--out", str(out))
    assert r.returncode == 0, r.stderr
    ring = losses(out / "sync-ring.jsonl")
    for stage in (1, 3):
        assert losses(out / f"sync-zero{stage}.jsonl") == ring  # dp 2: bit for bit
    runs = {run["name"]: run for run in json.loads((out / "summary.json").read_text())["runs"]}
    held = {name: run["what_ran"]["memory"]["per_rank_bytes"] for name, run in runs.items()}
    assert runs["sync-zero3"]["what_ran"]["zero"] == 3
    assert held["sync-zero3"] < held["sync-zero1"] < held["sync-ring"]
