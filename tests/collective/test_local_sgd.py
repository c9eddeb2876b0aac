"""Sync local SGD and DiLoCo (dtlab-sync --local-steps H; collective/reducers/local_sgd.py) against
the exact cases they reduce to.

H = 1 with inner SGD and outer SGD lr 1 is plain data parallelism: bit for bit on one
rank (models/outer.py, Exactness: theta - (theta - (theta - x)) round-trips); on two
ranks the mean of the outer gradients (theta - theta_r, each carrying theta_r's rounding)
is not the step of the mean gradient, so the parameters agree within 1e-12 relative in
float64 and 1e-6 in float32 (measured: 2e-16 and 1.2e-7), not bit for bit (the dyadic
case where they would, integer data and a power-of-two lr, cannot be built from a
softmax model's gradients; it is checked on arrays in tests/models/test_outer.py).
At H = 4 (10 steps: a shorter last round) a single process running the two replicas one
after another (tests/support/mpi_progs/method_cases.py, written from the definition) ends
on the same bits, for local SGD and for DiLoCo (inner AdamW, outer Nesterov 0.7 / 0.9):
at dp 2 the ring adds a + b = b + a (at dp 3 the ring's order of additions differs from
the twin's: 8e-18 relative in float64, measured, not tested).
"""

from __future__ import annotations

import json
import math
import os
import select
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from support.mpirun import mpirun

from dtlab.collective.train import parse_args
from dtlab.models.config import ConfigError
from dtlab.models.run.launcher_env import mpiexec_path
from dtlab.models.run.metrics import read_metrics

pytestmark = pytest.mark.usefixtures("mpiexec")

PROG = "tests/support/mpi_progs/method_cases.py"
MLP = ["--model", "mlp", "--d-in", "7", "--d-hidden", "10", "--n-layers", "2",
       "--n-classes", "5", "--n-samples", "512", "--batch-size", "4", "--seed", "3",
       "--warmup", "2", "--log-every", "100"]
SGD = ["--optimizer", "sgd", "--lr", "0.05", "--momentum", "0.9", "--clip", "0"]
DILOCO = ["--optimizer", "adamw", "--lr", "3e-3", "--weight-decay", "0.01",
          "--outer-optimizer", "nesterov", "--outer-lr", "0.7", "--outer-momentum", "0.9"]


def run_cases(tmp_path, n: int, cases: list[dict]) -> dict:
    path, out = tmp_path / f"cases{n}.json", tmp_path / f"out{n}.npz"
    path.write_text(json.dumps(cases))
    r = mpirun(n, PROG, str(path), str(out), timeout=120)
    assert r.rc == 0, r
    return dict(np.load(out))


def rel(a, b) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> tuple[dict, object]:
    """Every two-rank case in one launch: H = 1 against plain in float32 and float64, H = 4
    local SGD and DiLoCo with their twins; (final parameters, the H = 4 run's metrics)."""
    tmp = tmp_path_factory.mktemp("local")
    metrics = tmp / "local.jsonl"
    one = [*MLP, *SGD, "--steps", "6"]
    local = [*MLP, *SGD, "--steps", "10", "--local-steps", "4"]
    diloco = [*MLP, *DILOCO, "--steps", "10", "--local-steps", "4"]
    cases = [{"name": f"{kind}{dtype}", "argv": [*one, "--dtype", f"float{dtype}", *extra]}
             for dtype in ("32", "64")
             for kind, extra in (("plain", []), ("local", ["--local-steps", "1"]))]
    cases += [{"name": "local", "argv": [*local, "--metrics", str(metrics)]},
              {"name": "plain_logged", "argv": [*MLP, *SGD, "--steps", "10", "--metrics",
                                                str(tmp / "plain.jsonl")]},
              {"name": "local_twin", "argv": local, "twin": 2},
              {"name": "diloco", "argv": diloco},
              {"name": "diloco_twin", "argv": diloco, "twin": 2}]
    return run_cases(tmp, 2, cases), metrics


def test_one_local_step_is_plain_data_parallelism(tmp_path, two_ranks):
    run = [*MLP, *SGD, "--steps", "6"]
    one = run_cases(tmp_path, 1, [{"name": "plain", "argv": run},
                                  {"name": "local", "argv": [*run, "--local-steps", "1"]}])
    assert np.array_equal(one["local"], one["plain"])  # one rank: bit for bit
    two = two_ranks[0]
    assert rel(two["local64"], two["plain64"]) < 1e-12
    assert rel(two["local32"], two["plain32"]) < 1e-6
    assert not np.array_equal(two["local32"], two["plain32"])  # an ulp here and there


def test_four_local_steps_are_the_replicas_run_one_after_another(two_ranks):
    got, metrics = two_ranks
    assert np.array_equal(got["local"], got["local_twin"])
    assert np.array_equal(got["diloco"], got["diloco_twin"])
    assert rel(got["local"], got["diloco"]) > 1e-2  # two different trainings
    header, records = read_metrics(str(metrics))
    assert header["local_steps"] == 4 and header["outer"]["outer_optimizer"] == "sgd"
    ends = [r["step"] for r in records if r["comm_rounds"]]
    assert ends == [4, 8, 10] and sum(r["comm_rounds"] for r in records) == math.ceil(10 / 4)
    # each round one ring all-reduce of n float32: at dp 2 a rank sends the other's half
    # (reduce-scatter), then its own (all-gather), 2 (W - 1) / W = 1 of the bytes
    n = got["local"].size
    assert {r["sent_bytes"] for r in records if r["comm_rounds"]} == {4 * n}
    assert all(r["sent_bytes"] == 0 for r in records if not r["comm_rounds"])


def test_the_logged_loss_is_the_global_batch_mean_as_in_plain_sync(two_ranks):
    """`loss` means the mean over the step's global batch for every method: local SGD's
    records wait for their round's end, when one all-reduce averages the round's losses.
    At step 1 (the same weights and data as plain sync) the two logged losses are equal
    bit for bit; afterwards the replicas drift apart and so do the losses."""
    _, metrics = two_ranks
    local = read_metrics(str(metrics))[1]
    plain = read_metrics(str(metrics.parent / "plain.jsonl"))[1]
    assert [r["step"] for r in local] == list(range(1, 11))
    assert local[0]["loss"] == plain[0]["loss"]
    assert local[1]["loss"] != plain[1]["loss"]


def test_the_ranks_meet_only_at_round_ends_and_a_signal_stops_them_after_one(tmp_path):
    """The stop agreement runs at round ends only (collective/reducers/methods.py, agreement): a
    SIGTERM mid-round stops both ranks after that round, exit 0, no abort."""
    metrics = tmp_path / "m.jsonl"
    cmd = [mpiexec_path(), "-n", "2", sys.executable, "-m", "dtlab.collective.train", *MLP,
           *SGD, "--local-steps", "7", "--steps", "1000000", "--log-every", "20",
           "--schedule", "constant", "--metrics", str(metrics)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    err, deadline = "", time.monotonic() + 60
    try:
        while "step " not in err:
            ready, _, _ = select.select([proc.stderr], [], [], deadline - time.monotonic())
            assert ready and proc.poll() is None, f"no progress line before the deadline: {err}"
            err += proc.stderr.readline()
        proc.send_signal(signal.SIGTERM)
        _, rest = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    err += rest
    assert proc.returncode == 0 and "Traceback" not in err and "Abort" not in err, err
    line = next(x for x in err.splitlines() if x.startswith("stopped by SIGTERM"))
    step = int(line.split("after step ")[1].split(";")[0])
    records = read_metrics(str(metrics))[1]
    assert step % 7 == 0 and records[-1]["step"] == step and records[-1]["comm_rounds"] == 1


@pytest.mark.parametrize("flags, named", [
    (["--local-steps", "2", "--zero", "1"], "--local-steps 2 with --zero 1"),
    (["--local-steps", "2", "--tp", "2"], "--local-steps 2 with --tp 2"),
    (["--local-steps", "2", "--precision", "bf16"], "with --precision bf16"),
    (["--local-steps", "2", "--checkpoint-dir", "ck"], "with --checkpoint-dir ck"),
    (["--local-steps", "2", "--compress", "sign"], "one of them at a time"),
    (["--local-steps", "3", "--eval-every", "4"], "--eval-every 4 must be a multiple"),
    (["--outer-optimizer", "sgd"], "has no effect without --local-steps"),
    (["--local-steps", "2", "--outer-optimizer", "nesterov"], "needs --outer-momentum > 0"),
    (["--local-steps", "-1"], "--local-steps must not be negative"),
])
def test_what_local_sgd_cannot_run_with_is_named(flags, named):
    with pytest.raises(ConfigError, match=named.replace("+", r"\+")):
        parse_args([*MLP, *flags])
