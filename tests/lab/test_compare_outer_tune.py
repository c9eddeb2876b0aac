"""Tuning the outer optimizer's lr and momentum (compare/study.py: --tune outer_lr=...,
outer_momentum=...): the values are checked, they reach the flags of the methods with an
outer optimizer on both topologies (sync: dtlab-sync's --outer-*, async: the servers'),
the methods without one run once per point of the other axes, and without outer axes
every method's flags are the ones they were before the axes existed (GOLDEN, recorded
from runner.method_flags / server_flags before the change). One real tiny comparison
shows it end to end: sync-ring once, sync-diloco2 once per outer lr, each recorded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dtlab.lab.compare import registry, runner, study
from dtlab.lab.compare.analysis import ran_words
from dtlab.lab.compare.cli import parse_args
from dtlab.models.config import ConfigError
from dtlab.models.optim import OptimConfig
from dtlab.models.run.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]

# method_flags (every run) and server_flags (async) of one name per registry method,
# --ranks 2, --eval-every 5: recorded before outer axes existed
DILOCO_SYNC = ["--outer-optimizer", "nesterov", "--outer-lr", "0.7", "--outer-momentum", "0.9"]
DILOCO_ASYNC = ["--consistency", "asp", "--num-workers", "2", "--outer-optimizer",
                "delayed-nesterov", "--outer-lr", "0.7", "--outer-momentum", "0.9",
                "--outer-period", "2"]
LOCAL_ASYNC = ["--consistency", "asp", "--num-workers", "2", "--outer-optimizer", "sgd",
               "--outer-lr", "1.0", "--outer-momentum", "0.0"]
GOLDEN = {
    "sync-ring": ([], None), "sync-zero2": ([], None),
    "sync-zero3-qwz8-qgz4": (["--zero-quantize-weights", "int8", "--zero-quantize-grads",
                              "int4"], None),
    "sync-local4": (["--local-steps", "4", "--eval-every", "8"], None),
    "sync-diloco4": (["--local-steps", "4", "--eval-every", "8", *DILOCO_SYNC], None),
    "sync-stream6x3-t1-int8": (["--local-steps", "6", "--eval-every", "6", *DILOCO_SYNC,
                                "--fragments", "3", "--overlap-steps", "1",
                                "--outer-precision", "int8"], None),
    "sync-qring8": (["--quantize-grads", "int8"], None),
    "sync-onebitadam5": (["--onebit-adam", "5"], None),
    "sync-zerooneadam5": (["--zero-one-adam", "5"], None),
    "sync-pipedream-flush": (["--pipedream", "flush"], None),
    "sync-topk1-noef": (["--compress", "topk:0.01", "--no-error-feedback"], None),
    "async-local4": (["--local-steps", "4", "--eval-every", "8"], LOCAL_ASYNC),
    "async-diloco4": (["--local-steps", "4", "--eval-every", "8"], DILOCO_ASYNC),
    "async-local4-dylu": (["--local-steps", "4", "--eval-every", "8", "--dylu"], LOCAL_ASYNC),
    "async-diloco4-dylu": (["--local-steps", "4", "--eval-every", "8", "--dylu"],
                           DILOCO_ASYNC),
    "async-stream6x2": (["--local-steps", "6", "--eval-every", "6", "--fragments", "2"],
                        DILOCO_ASYNC),
    "async-bsp-backup1": ([], ["--consistency", "bsp", "--num-workers", "3",
                               "--backup-workers", "1"]),
    "async-bsp-topk1": (["--compress", "topk:0.01"], ["--consistency", "bsp",
                                                      "--num-workers", "2"]),
    "async-ssp2-div": ([], ["--consistency", "ssp", "--num-workers", "2"]),
    "async-asp": ([], ["--consistency", "asp", "--num-workers", "2"]),
    "sim-asp": ([], None),
}


@pytest.fixture
def ctx(tmp_path) -> runner.RunContext:
    (tmp_path / "config.json").write_text(json.dumps({"run": {"eval_every": 5}}))
    return runner.RunContext(tmp_path, tmp_path / "config.json", 2, 2, 20, 60.0, "mpiexec")


def flags(spec: registry.RunSpec, ctx: runner.RunContext) -> tuple[list, list | None]:
    return (runner.method_flags(spec, ctx),
            runner.server_flags(spec, ctx) if spec.topology == "async" else None)


def test_golden_names_cover_every_registry_method():
    for method in registry.METHODS:
        assert any(method.match(name) for name in GOLDEN), method.usage


@pytest.mark.parametrize("tune", [[], ["lr=0.01,0.02", "momentum=0,0.9"],
                                  ["lr=0.01", "outer_lr=0.35,0.5"]])
def test_without_outer_values_every_command_is_as_before(ctx, tune):
    """Every method at every point of a grid: its flags are the recorded ones, unless the
    point has outer values and the method an outer optimizer."""
    grid = study.parse_grid(tune, OptimConfig(lr=0.01))
    for name, golden in GOLDEN.items():
        spec = registry.parse(name)
        for point in grid.points():
            ran = study.at_point(spec, point)
            if "outer_lr" in point and spec.has_outer:
                assert flags(ran, ctx) != golden and str(point["outer_lr"]) in \
                    [*flags(ran, ctx)[0], *(flags(ran, ctx)[1] or [])], name
            else:
                assert ran == spec and flags(ran, ctx) == golden, (name, point)


def test_outer_values_reach_the_flags_on_both_topologies(ctx):
    point = {"lr": 0.01, "outer_lr": 0.35, "outer_momentum": 0.5}
    sync = flags(study.at_point(registry.parse("sync-diloco4"), point), ctx)[0]
    assert sync == ["--local-steps", "4", "--eval-every", "8", "--outer-optimizer", "nesterov",
                    "--outer-lr", "0.35", "--outer-momentum", "0.5"]
    # local SGD's outer SGD (lr 1: model averaging) is an outer optimizer too
    local = flags(study.at_point(registry.parse("sync-local4"), {"outer_lr": 0.5}), ctx)[0]
    assert local[-6:] == ["--outer-optimizer", "sgd", "--outer-lr", "0.5",
                          "--outer-momentum", "0.0"]
    for name, optimizer in (("async-diloco4-dylu", "delayed-nesterov"),
                            ("async-stream6x2", "delayed-nesterov"), ("async-local4", "sgd")):
        server = flags(study.at_point(registry.parse(name), point), ctx)[1]
        at = server.index("--outer-optimizer")
        assert server[at:at + 6] == ["--outer-optimizer", optimizer, "--outer-lr", "0.35",
                                     "--outer-momentum", "0.5"], name
    spec = study.at_point(registry.parse("async-diloco4"), {"outer_lr": 0.35})
    assert "outer Delayed Nesterov lr 0.35, momentum 0.9" in spec.describe()


@pytest.mark.parametrize("runs, tune, message", [
    ("sync-ring,async-asp", "outer_lr=0.35,0.7", "none of --runs has an outer optimizer"),
    ("sync-local4,async-diloco4", "outer_momentum=0,0.9",
     "Nesterov outer optimizer of async-diloco4 needs a momentum above 0"),
])
def test_outer_axes_the_methods_cannot_take_are_named(runs, tune, message):
    with pytest.raises(ConfigError, match=message):
        parse_args(["--model", "mlp", "--runs", runs, "--tune", tune])


def test_a_method_without_an_outer_optimizer_runs_each_inner_point_once():
    grid = study.parse_grid(["lr=0.01,0.02,0.04", "outer_lr=0.35,0.7"], OptimConfig())
    specs = [registry.parse(n) for n in ("sync-ring", "sync-diloco2", "async-local4")]
    plan = study.tuning_plan(specs, grid)
    runs = {s.name: [p for p, group in plan if s in group] for s in specs}
    assert runs["sync-ring"] == [{"lr": 0.01}, {"lr": 0.02}, {"lr": 0.04}]
    assert runs["sync-diloco2"] == runs["async-local4"] == grid.points()
    assert len(grid.points()) == 6
    # no outer axes: every method at every point, in the grid's order, as before
    plain = study.parse_grid(["lr=0.01,0.02"], OptimConfig())
    assert study.tuning_plan(specs, plain) == [(p, specs) for p in plain.points()]


def held_out(path: Path) -> dict[int, float]:
    return {r["step"]: r["eval_loss"] for r in read_metrics(str(path))[1] if "eval_loss" in r}


@pytest.mark.usefixtures("mpiexec")
def test_a_tiny_comparison_tunes_diloco_s_outer_lr_and_runs_sync_ring_once(tmp_path):
    out = tmp_path / "out"
    r = subprocess.run(
        [sys.executable, "-m", "dtlab.lab.compare", "--no-plots", "--model", "mlp",
         "--d-in", "4", "--d-hidden", "8", "--n-layers", "1", "--n-classes", "3",
         "--n-samples", "512", "--batch-size", "8", "--clip", "0", "--warmup", "0",
         "--steps", "12", "--eval-every", "4", "--eval-samples", "64", "--ranks", "2",
         "--runs", "sync-diloco2,sync-ring", "--tune", "outer_lr=0.35,0.7", "--seeds", "1",
         "--out", str(out)],
        cwd=ROOT, text=True, capture_output=True, timeout=300, env=dict(os.environ))
    assert r.returncode == 0, r.stderr
    summary = json.loads((out / "summary.json").read_text())
    tune = [x for x in summary["runs"] if x["phase"] == "tune"]
    assert [(x["name"], x["point"]) for x in tune] == [
        ("sync-diloco2", {"outer_lr": 0.35}), ("sync-ring", {}),
        ("sync-diloco2", {"outer_lr": 0.7})]
    for x in tune:
        command = x["commands"][0]
        header = read_metrics(str(out / x["metrics"][0]))[0]
        if x["name"] == "sync-ring":
            assert "--outer-lr" not in command and x["folder"] == "tune/as-configured"
            continue
        lr = x["point"]["outer_lr"]
        at = command.index("--outer-lr")
        assert command[at - 2:at + 4] == ["--outer-optimizer", "nesterov", "--outer-lr",
                                          str(lr), "--outer-momentum", "0.9"]
        assert header["outer"]["outer_lr"] == lr == x["what_ran"]["outer"]["outer_lr"]
        assert f"outer nesterov lr {lr:g}, momentum 0.9" in ran_words(x["what_ran"])
        assert json.loads((out / x["folder"] / "config.json").read_text())["optim"]["lr"] \
            == summary["config"]["optim"]["lr"]  # the outer lr stays out of the inner config
    diloco, ring = summary["methods"]
    keys = {}  # the selection recomputed from the metrics: steps to target, final loss
    for x in tune[::2]:
        held = held_out(out / x["metrics"][0])
        reached = [s for s, v in sorted(held.items()) if v <= summary["target_loss"]]
        keys[x["point"]["outer_lr"]] = (reached[0] if reached else 99, held[12])
    assert diloco["best"] == {"outer_lr": min(keys, key=keys.get)}, keys
    assert ring["best"] == {} and [x["folder"] for x in summary["runs"]
                                   if x["name"] == "sync-ring"] == \
        ["tune/as-configured", "seed-1/as-configured"]
    best = diloco["best"]["outer_lr"]
    seed = next(x for x in summary["runs"] if x["phase"] == "seed" and x["name"] ==
                "sync-diloco2")
    assert seed["what_ran"]["outer"]["outer_lr"] == best and \
        f"lr {best:g}, momentum 0.9" in diloco["what"]
    report = (out / "report.md").read_text()
    assert f"chosen: sync-diloco2 outer_lr {best:g}" in report
    ring_row = next(line for line in report.split("## Sensitivity")[1].splitlines()
                    if line.startswith("| sync-ring |"))
    cells = ring_row.strip("|").split("|")[1:]
    assert len(cells) == 2 and cells[0] == cells[1]  # one run, shown under both outer lrs
