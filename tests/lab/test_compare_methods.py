"""The comparison's methods between sync and async (compare/runner.py: local SGD, DiLoCo,
compression, backup workers) and their reproductions (compare/reproductions.py), each at
a small size where its expectation holds, the verdict and the bytes and rounds figures
(compare/analysis.py, traffic) recomputed from the runs' own metrics.

The small sizes, and what they show: diloco, 2 ranks (not 4), an MLP, 1000 steps so that
H = 50 makes 20 outer rounds (at 6 rounds the outer momentum has not built up and H = 50
ends 18% above sync: measured); backup-workers, 2 workers (+ 1 backup), one shard,
exponential delays of 60 ms (not 20: the delay must outweigh the step's own time on a
shared host) and an easy target; error-feedback, 2 ranks, an MLP of 420 parameters
(top-1%: 5 elements a step), 300 steps at lr 0.1 (at 120 steps top-1% with error feedback
is still 3.6% above dense: measured).
"""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dtlab.lab.compare import registry
from dtlab.lab.compare.analysis import ran_words
from dtlab.lab.compare.runner import RunSpec
from dtlab.models.config import ConfigError
from dtlab.models.run.metrics import read_metrics

pytestmark = pytest.mark.usefixtures("mpiexec")

ROOT = Path(__file__).resolve().parents[2]
MLP = ["--model", "mlp", "--d-in", "8", "--d-hidden", "32", "--n-layers", "1",
       "--n-classes", "4", "--n-samples", "4096", "--batch-size", "16", "--warmup", "0",
       "--eval-samples", "256", "--ranks", "2"]
ONCE = ["--tune", "none", "--seeds", "1"]


def compare(*args: str, timeout: float = 300, plots: bool = False):
    """dtlab-compare; without `plots` it draws none (--no-plots: a second of matplotlib a
    comparison that only the test that checks a plot needs)."""
    drawn = [] if plots else ["--no-plots"]
    return subprocess.run([sys.executable, "-m", "dtlab.lab.compare", *drawn, *args],
                          cwd=ROOT,
                          text=True, capture_output=True, timeout=timeout, env=dict(os.environ))


def reproduced(tmp_path: Path, preset: str, *flags: str) -> tuple[dict, Path]:
    """Run `preset` with `flags`; its summary (the expectation held, the report says so)."""
    out = tmp_path / "out"
    r = compare("--preset", preset, *flags, "--out", str(out))
    assert r.returncode == 0, r.stderr
    summary = json.loads((out / "summary.json").read_text())
    rep = summary["reproduction"]
    assert rep["preset"] == preset and rep["held"], rep
    report = (out / "report.md").read_text()
    assert f"## Reproduction: {preset}" in report and "**held**" in report
    return summary, out


def records(path: Path) -> list[dict]:
    return read_metrics(str(path))[1]


def test_run_names_say_the_method():
    cases = {"sync-local10": dict(topology="sync", local_steps=10, outer="sgd"),
             "sync-diloco50": dict(topology="sync", local_steps=50, outer="diloco"),
             "sync-topk1": dict(compress="topk:0.01", error_feedback=True),
             "sync-topk0.5-noef": dict(compress="topk:0.005", error_feedback=False),
             "sync-randk10": dict(compress="randk:0.1"),
             "sync-sign-noef": dict(compress="sign", error_feedback=False),
             "sync-powersgd4": dict(compress="powersgd:4"),
             "async-local8": dict(topology="async", consistency="asp", local_steps=8),
             "async-bsp-backup2": dict(topology="async", consistency="bsp", backups=2),
             "async-diloco20": dict(topology="async", local_steps=20, outer="diloco"),
             "async-stream10x2": dict(topology="async", consistency="asp", local_steps=10,
                                      outer="diloco", worker_flags=("--fragments", "2")),
             "async-bsp-topk1": dict(topology="async", consistency="bsp", compress="topk:0.01"),
             "sync-stream30x3-t1-int4": dict(topology="sync", local_steps=30, outer="diloco",
                                             sync_flags=("--fragments", "3", "--overlap-steps",
                                                         "1", "--outer-precision", "int4")),
             "async-asp-sign-noef": dict(topology="async", consistency="asp", compress="sign",
                                         error_feedback=False)}
    for name, fields in cases.items():
        spec = RunSpec.parse(name)
        assert {k: getattr(spec, k) for k in fields} == fields, name
        assert spec.describe()
    for bad, why in (("sync-topk0", "a percent P in (0, 100]"),
                     ("sync-topk150", "a percent P in (0, 100]"),
                     ("sync-local0", "unknown run"), ("async-bsp-backup0", "unknown run"),
                     ("sync-powersgd", "unknown run"), ("async-bsp-topk0", "a percent P"),
                     ("async-ssp2-sign", "unknown run")):
        with pytest.raises(ConfigError, match=re.escape(why)):
            RunSpec.parse(bad)


def test_every_method_is_one_registry_entry():
    """Each name is matched by exactly one entry, whose exchange exists in the package;
    --list-methods prints every entry."""
    names = ("sync-ring", "sync-zero2", "sync-diloco50", "sync-stream30x3-t1-int4",
             "sync-onebitadam100", "sync-qring4", "sync-pipedream-2bw",
             "sync-powersgd4-noef", "async-local8", "async-bsp-backup2", "async-asp-randk5-noef",
             "async-ssp3-div", "sim-asp-div", "async-diloco10-dylu", "async-stream10x2")
    for name in names:
        hits = [m for m in registry.METHODS if m.match(name)]
        assert len(hits) == 1, (name, [m.usage for m in hits])
    for method in registry.METHODS:
        module, _, attr = method.exchange.rpartition(".")
        assert hasattr(importlib.import_module(module), attr), method.exchange
    listed = compare("--list-methods")
    assert listed.returncode == 0, listed.stderr
    for method in registry.METHODS:
        assert method.usage in listed.stdout and method.exchange in listed.stdout


def test_diloco_preset_h50_near_sync_with_50x_fewer_rounds(tmp_path):
    summary, out = reproduced(tmp_path, "diloco", *MLP, *ONCE, "--optimizer", "adamw",
                              "--lr", "0.003", "--steps", "1000")
    runs = {r["name"]: r for r in summary["runs"]}
    cmd = runs["sync-diloco50"]["commands"][0]
    assert cmd[cmd.index("--local-steps") + 1] == "50"
    assert cmd[cmd.index("--outer-optimizer") + 1] == "nesterov"
    assert cmd[cmd.index("--eval-every") + 1] == "50"
    for name, per_round in (("sync-ring", 1), ("sync-diloco10", 10), ("sync-diloco50", 50)):
        recs = records(out / f"{name}.jsonl")
        traffic = runs[name]["stats"]["traffic"]
        assert traffic["rounds"] == 1000 / per_round  # from comm_rounds (ring: one a step)
        assert traffic["bytes"] == sum(2 * r["sent_bytes"] for r in recs)  # N x rank 0's
        held = [r["step"] for r in recs if "eval_loss" in r]
        assert held == list(range(50, 1001, 50))
    rep = summary["reproduction"]["measured"]
    assert "50x fewer communication rounds" in rep


def test_error_feedback_preset_closes_the_gap_compression_leaves(tmp_path):
    summary, out = reproduced(tmp_path, "error-feedback", *MLP, *ONCE, "--lr", "0.1",
                              "--steps", "300", "--eval-every", "100")
    runs = {r["name"]: r for r in summary["runs"]}
    assert summary["config"]["optim"]["optimizer"] == "sgd"
    assert "--no-error-feedback" in runs["sync-sign-noef"]["commands"][0]
    assert "--no-error-feedback" not in runs["sync-sign"]["commands"][0]
    final = {n: r["stats"]["final_eval_loss"] for n, r in runs.items()}
    for c in ("topk1", "sign"):  # the verdict, recomputed from the held-out losses
        assert final[f"sync-{c}-noef"] - final["sync-ring"] > 0.02 * final["sync-ring"]
        assert abs(final[f"sync-{c}"] - final["sync-ring"]) <= 0.02 * final["sync-ring"]
    per_step = {n: r["stats"]["traffic"]["bytes_per_step"] for n, r in runs.items()}
    n = summary["n_params"]  # dp 2: dense sends n float32 each, top-1% its k values and
    k = -(-n // 100)  # int32 indices, sign n bits and a float32 scale (padded to 8 bytes)
    assert per_step["sync-ring"] == 2 * 4 * n and per_step["sync-topk1"] == 2 * 8 * k
    assert per_step["sync-sign"] == 2 * (-(-(4 + -(-n // 8)) // 8) * 8)
    assert all(r["stats"]["traffic"]["rounds_per_step"] == 1 for r in runs.values())


def test_backup_workers_preset_reaches_the_target_before_bsp(tmp_path):
    summary, out = reproduced(tmp_path, "backup-workers", *MLP, *ONCE, "--lr", "0.05",
                              "--shards", "1", "--steps", "30", "--eval-every", "1",
                              "--delay-ms", "60", "--target-loss", "0.8")
    runs = {r["name"]: r for r in summary["runs"]}
    server, workers = runs["async-bsp-backup1"]["commands"]
    assert server[server.index("--num-workers") + 1] == "3"
    assert server[server.index("--backup-workers") + 1] == "1"
    assert workers[workers.index("-n") + 1] == "3"
    late = [sum(r["late"] for r in records(out / f"async-bsp-backup1.w{w}.jsonl"))
            for w in range(3)]
    assert sum(late) > 0  # the round closed without some gradients: they were dropped
    assert all(r["late"] == 0 for w in range(2) for r in records(out / f"async-bsp.w{w}.jsonl"))


def test_the_study_report_shows_loss_against_bytes_and_rounds(tmp_path):
    """A study (2 seeds): the leading table's MB/step and rounds/step are the seeds' mean
    of what the metrics say; async local SGD's bytes are its workers' pushes and pulls."""
    out = tmp_path / "out"
    r = compare(*MLP, "--runs", "sync-local5,async-local5", "--steps", "20", "--eval-every",
                "5", "--lr", "0.01", "--tune", "none", "--seeds", "2", "--out", str(out),
                plots=True)
    assert r.returncode == 0, r.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert "heldout_vs_bytes.png" in summary["plots"]
    assert (out / "heldout_vs_bytes.png").stat().st_size > 0
    report = (out / "report.md").read_text()
    assert "| MB/step | rounds/step |" in report
    for m in summary["methods"]:
        name = m["name"]
        files = [sorted(out.glob(f"seed-{s}/*/{name}.w*.jsonl")) or
                 sorted(out.glob(f"seed-{s}/*/{name}.jsonl")) for s in m["seeds"]]
        if name.startswith("sync"):
            moved = [sum(2 * x["sent_bytes"] for x in records(f[0])) / 20 for f in files]
        else:
            moved = [sum(x["push_bytes"] + x["pull_bytes"] for p in f for x in records(p)) / 20
                     for f in files]
        assert m["bytes_per_step"]["mean"] == pytest.approx(sum(moved) / len(moved))
        assert m["rounds_per_step"]["mean"] == pytest.approx(0.2)
        row = next(x for x in report.splitlines() if x.startswith(f"| {name} |"))
        assert f"| {m['bytes_per_step']['mean'] / 1e6:.3g}" in row and "| 0.2 |" in row


def test_async_compressed_pushes_and_delayed_nesterov_run_in_the_comparison(tmp_path):
    """async-bsp-topk1 pushes top-1% (indices and values: 8 bytes each of k), async-diloco5
    runs its servers' Delayed Nesterov with one period per worker; both train."""
    out = tmp_path / "out"
    r = compare(*MLP, *ONCE, "--runs", "async-bsp,async-bsp-topk1,async-diloco5", "--steps",
                "10", "--eval-every", "5", "--lr", "0.01", "--shards", "1", "--out", str(out))
    assert r.returncode == 0, r.stderr
    runs = {x["name"]: x for x in json.loads((out / "summary.json").read_text())["runs"]}
    assert all(x["status"] == "ok" for x in runs.values()), runs
    server, workers = runs["async-diloco5"]["commands"]
    assert server[server.index("--outer-optimizer") + 1] == "delayed-nesterov"
    assert server[server.index("--outer-period") + 1] == "2"
    assert "--compress" in runs["async-bsp-topk1"]["commands"][1]
    header = read_metrics(str(out / "async-diloco5.w0.jsonl"))[0]  # what the servers ran
    assert header["outer"] == {"outer_optimizer": "delayed-nesterov", "outer_lr": 0.7,
                               "outer_momentum": 0.9, "outer_period": 2}
    assert "outer delayed-nesterov lr 0.7 period 2" in ran_words(runs["async-diloco5"]["what_ran"])
    assert ran_words(runs["async-bsp-topk1"]["what_ran"]).startswith(
        "topk:0.01 (error feedback) pushes")
    n = json.loads((out / "summary.json").read_text())["n_params"]
    pushed = [x["push_bytes"] for x in records(out / "async-bsp-topk1.w0.jsonl")]
    assert pushed and all(b == 8 * -(-n // 100) for b in pushed), (pushed, n)


def test_streaming_diloco_preset_matches_diloco_with_a_tenth_of_the_peak_bytes(tmp_path):
    summary, _ = reproduced(tmp_path, "streaming-diloco", *MLP, *ONCE, "--optimizer",
                            "adamw", "--lr", "0.003", "--steps", "600")
    runs = {r["name"]: r for r in summary["runs"]}
    cmd = runs["sync-stream30x3-t1-int4"]["commands"][0]
    for flag, value in (("--local-steps", "30"), ("--fragments", "3"),
                        ("--overlap-steps", "1"), ("--outer-precision", "int4")):
        assert cmd[cmd.index(flag) + 1] == value
    traffic = {n: r["stats"]["traffic"] for n, r in runs.items()}
    per_sync = {n: t["bytes"] / t["rounds"] for n, t in traffic.items()}
    assert per_sync["sync-diloco30"] >= 10 * per_sync["sync-stream30x3-t1-int4"]
    assert traffic["sync-stream30x3-t1-int4"]["rounds"] == 600 // 10 + 2  # the last: all 3


def test_onebit_adam_preset_ends_near_adam_with_fewer_bytes(tmp_path):
    summary, _ = reproduced(tmp_path, "onebit-adam", *MLP, *ONCE, "--optimizer", "adamw",
                            "--lr", "0.003", "--steps", "400")
    runs = {r["name"]: r for r in summary["runs"]}
    dense, onebit = (runs[n]["stats"]["traffic"]["bytes"] for n in ("sync-ring",
                                                                     "sync-onebitadam100"))
    assert dense >= 3 * onebit


@pytest.mark.parametrize("preset, straggler", [("heterogeneous", ["--straggler", "1:4"]),
                                               ("heterogeneous-drawn", [])])
def test_heterogeneous_preset_names_the_winner_the_numbers_name(tmp_path, preset, straggler):
    """Timing on a shared host decides the winner, so the check recomputes the verdict
    from the runs' own figures instead of expecting one; the drawn preset's speeds come
    from its lognormal (--ranks 2 given: 2 of its 8 workers)."""
    out = tmp_path / "out"
    r = compare("--preset", preset, *MLP, *ONCE, "--runs", "sync-ring,async-asp", *straggler,
                "--optimizer", "adamw", "--lr", "0.003", "--steps",
                "200", "--eval-every", "20", "--target-loss", "0.9", "--out", str(out))
    assert r.returncode == 0, r.stderr
    summary = json.loads((out / "summary.json").read_text())
    config = json.loads((out / "config.json").read_text())
    # the flag given wins over the preset's
    assert config["run"]["straggler"] == ("1:4" if straggler else "lognormal:0.5")
    # sync: seconds a step x steps; ASP, out of step: the evaluation's own time
    times = {x["name"]: x["stats"]["eval_time_to_target_s"]
             or x["stats"]["eval_steps_to_target"] * x["stats"]["s_per_step"]
             for x in summary["runs"] if x["stats"]["eval_steps_to_target"]}
    winner = min(times, key=times.get)
    rep = summary["reproduction"]
    assert rep["held"] == (winner != "sync-ring")
    assert rep["measured"].startswith(f"time to the held-out target: {winner}")


def test_speed_aware_h_preset_judges_dylu_against_sync_local_sgd(tmp_path):
    """Liu et al.'s baseline is synchronous local SGD: the check recomputes its verdict
    from the runs' own figures (loss at equal steps within sync DiLoCo's noise, sooner
    within it in time), since timing on a shared host decides half of it."""
    out = tmp_path / "out"
    r = compare("--preset", "speed-aware-h", *MLP, *ONCE, "--straggler", "1:2",
                "--optimizer", "adamw", "--lr", "0.003", "--steps", "60", "--eval-every", "20",
                "--out", str(out))
    assert r.returncode == 0, r.stderr
    summary = json.loads((out / "summary.json").read_text())
    stats = {x["name"]: x["stats"] for x in summary["runs"]}
    assert set(stats) == {"sync-ring", "sync-diloco10", "async-diloco10", "async-diloco10-dylu"}
    base, dylu = stats["sync-diloco10"], stats["async-diloco10-dylu"]
    off = dylu["final_eval_loss"] - base["final_eval_loss"]
    level = base["final_eval_loss"] * 1.02

    def time_to(s):
        c = s["held_out"]
        return next((t for t, x in zip(c["time_s"], c["loss"], strict=True) if x <= level),
                    s["time_s"])
    rep = summary["reproduction"]
    assert rep["held"] == (off <= 0.02 * base["final_eval_loss"]
                           and time_to(dylu) < time_to(base))
    assert f"speed-aware H {off:+.4f} against sync DiLoCo" in rep["measured"]
