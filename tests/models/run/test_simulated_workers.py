"""dtlab-train --simulate-workers W [--staleness S]: asynchronous workers in one process.

Truth: W = 1 is plain training bit for bit; W workers with S = 0 are W sequential
updates per round on the workers' own batches (a twin written here on the model API);
S = W - 1 is recomputed by hand, each gradient on the parameters S updates back, at
the servers' lr (Schedule over W x --steps updates, optionally / staleness). Bad
flags are named. All real single-process runs.
"""

import json
import subprocess
import sys

import numpy as np
import pytest

from dtlab.models.config import ConfigError
from dtlab.models.data import ShardedLoader
from dtlab.models.optim import Schedule
from dtlab.models.run import train as train_cli
from dtlab.models.run.cli import run_cli
from dtlab.models.run.metrics import MetricsLog, read_metrics, run_header
from dtlab.models.run.session import build_session, parse
from dtlab.models.run.simulated import SimulatedWorkers, add_simulate_flags, simulate_config
from dtlab.models.run.trainer import Trainer

# Adam with warm-up, cosine decay and clipping: the lr schedule's index, the optimizer's
# step count and the clip all take part.
MLP = ["--model", "mlp", "--d-in", "8", "--n-classes", "4", "--d-hidden", "32",
       "--n-samples", "2048", "--batch-size", "16", "--optimizer", "adam", "--lr", "1e-2",
       "--warmup", "4", "--clip", "0.5", "--seed", "5"]


def simulate(argv, metrics=""):
    """A simulated run as dtlab-train makes it: (session, summary)."""
    setup = parse(argv + (["--metrics", metrics] if metrics else []), prog="test",
                  add_extra=add_simulate_flags)
    cfg = simulate_config(setup)
    session = build_session(setup)
    log = MetricsLog(setup.run.metrics, run_header(session, "single", **cfg.header(setup.run)))
    try:
        summary = SimulatedWorkers(session, log, cfg).run()
    finally:
        log.close()
    return session, summary


def plain(argv, metrics):
    setup = parse(argv + ["--metrics", metrics], prog="test")
    session = build_session(setup)
    log = MetricsLog(setup.run.metrics, run_header(session, "single"))
    try:
        Trainer(session, log).run()
    finally:
        log.close()
    return session


def records(path):
    return read_metrics(str(path))[1]


def test_one_worker_without_staleness_is_plain_training(tmp_path):
    argv = MLP + ["--steps", "24", "--eval-every", "8"]
    a = plain(argv, str(tmp_path / "plain.jsonl"))
    b, summary = simulate(argv + ["--simulate-workers", "1"], str(tmp_path / "sim.jsonl"))
    np.testing.assert_array_equal(a.params.data, b.params.data)
    ra, rb = records(tmp_path / "plain.jsonl"), records(tmp_path / "sim.jsonl")
    for key in ("step", "loss", "lr", "grad_norm"):
        assert [r[key] for r in ra] == [r[key] for r in rb], key
    assert [r.get("eval_loss") for r in ra] == [r.get("eval_loss") for r in rb]
    assert [r["update"] for r in rb] == list(range(1, 25))
    assert {r["staleness"] for r in rb} == {0} and summary.steps == 24


def sharded(session, workers):
    """Worker w's loader, as an async worker builds it (pserver.worker.loop.train)."""
    run = session.setup.run
    return [ShardedLoader(session.dataset, run.batch_size, rank=w, world=workers, seed=run.seed,
                          micro_batches=run.grad_accum) for w in range(workers)]


def test_workers_without_staleness_equal_their_sequential_twin(tmp_path):
    W, R = 3, 5
    sim, _ = simulate(MLP + ["--steps", str(R), "--simulate-workers", str(W),
                             "--staleness", "0"], str(tmp_path / "sim.jsonl"))
    setup = parse(MLP + ["--steps", str(R)], prog="twin")
    twin = build_session(setup)
    loaders, schedule = sharded(twin, W), Schedule(setup.optim, R * W)
    losses = []
    for _ in range(R):
        for w in range(W):  # one update per worker, each on its own batch of the round
            losses.append(twin.replica.compute_grads(loaders[w].next()))
            twin.model.clip_grad_norm(twin.params, setup.optim.clip)
            twin.optimizer.step(twin.params.data, twin.params.grad,
                                schedule(twin.optimizer.steps))
    np.testing.assert_array_equal(sim.params.data, twin.params.data)
    got = records(tmp_path / "sim.jsonl")
    assert [r["loss"] for r in got] == losses
    assert [r["worker"] for r in got] == [0, 1, 2] * R
    assert [r["round"] for r in got] == [r for r in range(1, R + 1) for _ in range(W)]
    assert {r["staleness"] for r in got} == {0}


@pytest.mark.parametrize("rule,extra", [
    ("none", []),
    ("divide", []),
    # a loss scale that overflows at first: skipped pushes apply nothing
    ("none", ["--precision", "fp16", "--loss-scale", "1e6"]),
], ids=["none", "divide", "fp16-skips"])
def test_stale_gradients_match_a_hand_recomputation(tmp_path, rule, extra):
    W, R = 3, 4
    S = W - 1  # the default
    argv = MLP + ["--steps", str(R), "--eval-every", str(R)] + extra
    sim, _ = simulate(argv + ["--simulate-workers", str(W), "--staleness-lr", rule],
                      str(tmp_path / "sim.jsonl"))
    setup = parse(argv, prog="hand")
    hand = build_session(setup)
    loaders, schedule = sharded(hand, W), Schedule(setup.optim, R * W)
    divide = rule == "divide"
    # before[p]: (updates applied, values) before push p
    before = [(0, hand.params.data.copy())]
    want = []
    for p in range(R * W):
        updates_read, values = before[max(0, p - S)]
        hand.params.data[...] = values
        loss = hand.replica.compute_grads(loaders[p % W].next())
        apply, _ = hand.replica.finish_grads()
        updates, live = before[-1][0], before[-1][1].copy()
        staleness = updates - updates_read
        lr = schedule(hand.optimizer.steps) / (max(1, staleness) if divide else 1)
        if apply:
            hand.model.clip_grad_norm(hand.params, setup.optim.clip)
            hand.optimizer.step(live, hand.params.grad, lr)
            updates += 1
        before.append((updates, live))
        want.append({"loss": loss, "lr": lr, "staleness": staleness, "update": updates})
    np.testing.assert_array_equal(sim.params.data, before[-1][1])
    got = records(tmp_path / "sim.jsonl")
    assert [{k: r[k] for k in want[0]} for r in got] == want
    hand.params.data[...] = before[-1][1]
    assert got[-1]["eval_loss"] == hand.replica.evaluate(hand.heldout)
    if "fp16" in extra:
        assert sum(r["skipped"] for r in got) >= 2 and got[-1]["update"] < R * W
    else:
        assert [r["staleness"] for r in got[:4]] == [0, 1, 2, 2]
    if divide:
        assert got[-1]["lr"] == schedule(R * W - 1) / S


def test_the_cli_records_a_simulated_run(tmp_path):
    metrics, trace = tmp_path / "m.jsonl", tmp_path / "t.json"
    out = subprocess.run([sys.executable, "-m", "dtlab.models.run.train", *MLP, "--steps", "4",
                          "--simulate-workers", "2", "--staleness-lr", "divide",
                          "--metrics", str(metrics), "--trace", str(trace)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    header, got = read_metrics(str(metrics))
    assert (header["simulate_workers"], header["staleness"], header["staleness_lr"],
            header["schedule_steps"]) == (2, 1, "divide", 8)
    assert [r["update"] for r in got] == list(range(1, 9))
    assert "simulated: 2 asynchronous worker(s) in one process" in out.stdout
    assert "1 update(s) stale" in out.stdout and "lr / staleness" in out.stdout
    spans = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
    assert sum(e["name"] == "compute" for e in spans) == 8

    plain_metrics = tmp_path / "plain.jsonl"
    out = subprocess.run([sys.executable, "-m", "dtlab.models.run.train", *MLP, "--steps", "4",
                          "--metrics", str(plain_metrics)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "simulated" not in out.stdout + out.stderr
    header, got = read_metrics(str(plain_metrics))
    assert not {"simulate_workers", "staleness", "schedule_steps"} & set(header)
    assert not {"update", "worker", "round"} & set(got[0])


@pytest.mark.parametrize("args,message", [
    (["--simulate-workers", "0"], "--simulate-workers must be at least 1 (got 0)"),
    (["--simulate-workers", "-2"], "--simulate-workers must be at least 1 (got -2)"),
    (["--simulate-workers", "3", "--staleness", "-2"], "--staleness must not be negative"),
    (["--simulate-workers", "1", "--staleness", "1"],
     "--staleness 1 with --simulate-workers 1: one worker reads its own last update"),
    (["--simulate-workers", "3", "--staleness", "3"], "--staleness 3 exceeds W - 1 = 2"),
    (["--staleness", "1"], "--staleness and --staleness-lr need --simulate-workers W"),
    (["--staleness-lr", "divide"], "--staleness and --staleness-lr need --simulate-workers W"),
    (["--simulate-workers", "2", "--checkpoint-dir", "ck"],
     "--simulate-workers does not combine with --checkpoint-dir: a simulated run keeps no "
     "checkpoints"),
    (["--simulate-workers", "2", "--straggler", "1:2"],
     "--simulate-workers does not combine with --straggler: the simulated workers are "
     "equal-speed"),
    (["--simulate-workers", "2", "--delay-ms", "5"],
     "--simulate-workers does not combine with --delay-ms"),
])
def test_bad_flags_name_the_problem(tmp_path, capsys, args, message):
    metrics = tmp_path / "m.jsonl"
    args = [str(tmp_path / a) if a == "ck" else a for a in args]
    rc = run_cli(train_cli.main, "dtlab-train", argv=[*MLP, *args, "--metrics", str(metrics)])
    err = capsys.readouterr().err
    assert rc == 2 and message in err and "Traceback" not in err, err
    assert not metrics.exists() and not (tmp_path / "ck").exists()


def test_more_workers_than_the_data_holds_is_named():
    setup = parse(MLP + ["--simulate-workers", "200"], prog="test", add_extra=add_simulate_flags)
    session = build_session(setup)
    with pytest.raises(ConfigError, match="16 x --grad-accum 1 x 200 rank"):
        SimulatedWorkers(session, MetricsLog("", {}), simulate_config(setup))
