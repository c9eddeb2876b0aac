"""SIGTERM and SIGINT stop a training run after a whole step, with a checkpoint.

Real processes: single-process dtlab-train and a 2-rank dtlab-sync under
mpiexec (which forwards the signal to every rank). The run must exit 0
(SIGTERM) or 130 (SIGINT) with one line naming the step and the checkpoint;
every rank stops after the same step; resuming finishes the run with the
parameters of an uninterrupted one, bit for bit.
"""

import os
import select
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from support.mpirun import mpirun

from dtlab.models.run import checkpoint
from dtlab.models.run.launcher_env import mpiexec_path
from dtlab.models.run.metrics import read_metrics

pytestmark = pytest.mark.usefixtures("mpiexec")

# a constant lr after warm-up: the interrupted run (--steps 1000000) and the whole one
# (--steps total) then follow the same schedule wherever the signal lands
MLP = ["--model", "mlp", "--d-in", "8", "--n-classes", "4", "--d-hidden", "32", "--seed", "4",
       "--log-every", "20", "--schedule", "constant"]


def run_until_signalled(cmd: list, sig: int, timeout: float = 60.0):
    """Start `cmd`, send `sig` once it has printed a progress line; (rc, stderr)."""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    err, deadline = "", time.monotonic() + timeout
    try:
        while "step " not in err:
            ready, _, _ = select.select([proc.stderr], [], [], deadline - time.monotonic())
            assert ready and proc.poll() is None, f"no progress line before the deadline: {err}"
            err += proc.stderr.readline()
        proc.send_signal(sig)
        out, rest = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    return proc.returncode, err + rest


def stopped_step(stderr: str, name: str) -> int:
    line = next(x for x in stderr.splitlines() if x.startswith(f"stopped by {name}"))
    return int(line.split("after step ")[1].split(";")[0])


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 0), (signal.SIGINT, 130)])
def test_single_process_stops_after_a_step_and_resumes_exactly(tmp_path, sig, code):
    ck = str(tmp_path / "ck")
    cmd = [sys.executable, "-m", "dtlab.models.run.train", *MLP, "--checkpoint-dir", ck]
    rc, err = run_until_signalled([*cmd, "--steps", "1000000"], sig)
    name = signal.Signals(sig).name
    assert rc == code, err
    step = stopped_step(err, name)
    assert f"checkpoint {ck}/{checkpoint.step_dir(step)} written" in err, err
    assert checkpoint.latest_valid(ck)[0].endswith(checkpoint.step_dir(step))
    total = str(step + 3)
    r = subprocess.run([*cmd, "--steps", total, "--resume", "--checkpoint-every", total],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and f"resumed from step {step}" in r.stderr, r.stderr
    whole = str(tmp_path / "whole")
    r = subprocess.run([sys.executable, "-m", "dtlab.models.run.train", *MLP, "--steps", total,
                        "--checkpoint-dir", whole, "--checkpoint-every", total],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    resumed, _ = checkpoint.load(checkpoint.latest(ck))
    np.testing.assert_array_equal(resumed["params"], checkpoint.load(checkpoint.latest(whole))[0]
                                  ["params"])


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 0), (signal.SIGINT, 130)])
def test_every_rank_stops_after_the_same_step(tmp_path, sig, code):
    ck = str(tmp_path / "ck")
    argv = ["-m", "dtlab.collective.train", *MLP, "--checkpoint-dir", ck]
    rc, err = run_until_signalled([mpiexec_path(), "-n", "2", sys.executable, *argv,
                                   "--steps", "1000000"], sig)
    assert rc == code, err
    step = stopped_step(err, signal.Signals(sig).name)
    assert "Traceback" not in err and "Abort" not in err, err
    assert os.listdir(ck) == [checkpoint.step_dir(step)]
    r = mpirun(2, *argv, "--steps", str(step + 2), "--resume", timeout=60, wrap=False)
    assert r.rc == 0 and f"resumed from step {step}" in r.stderr, r


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 0), (signal.SIGINT, 130)])
def test_an_async_worker_stops_after_its_push_and_leaves(tmp_path, sig, code):
    """The step in progress is pushed; the worker deregisters and exits; the servers keep
    every push it made (one version per step, one shard)."""
    from support.pserver_util import TINY_MLP_FLAGS, addresses, serve

    with serve(1) as daemons:
        metrics = tmp_path / "w.jsonl"
        rc, err = run_until_signalled(
            [sys.executable, "-m", "dtlab.pserver.worker", "--servers", addresses(daemons),
             *TINY_MLP_FLAGS, "--steps", "1000000", "--log-every", "20",
             "--metrics", str(metrics)], sig)
        assert rc == code, err
        assert f"stopped by {signal.Signals(sig).name} after step" in err, err
        steps = len(read_metrics(str(metrics))[1])
        assert daemons[0].store.version == steps  # each step's push applied, none lost
