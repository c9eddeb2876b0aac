"""What a person sees: one line on Ctrl-C (exit 130), one error line per rank naming it,
help for every flag, resume messages that say what happened, step numbers that count
the same way on the console and in the metrics."""

from __future__ import annotations

import dataclasses
import importlib.util
import signal
import subprocess
import sys
import time

import pytest
from support.mpirun import ROOT, mpiexec_path, mpirun

from dtlab.models.data.factory import DataConfig
from dtlab.models.mlp import MLPConfig
from dtlab.models.optim import OptimConfig
from dtlab.models.run.metrics import read_metrics
from dtlab.models.run.session import RunConfig
from dtlab.models.transformer import TransformerConfig
from dtlab.pserver.common.config import ClientConfig, ServerConfig
from dtlab.pserver.worker.loop import WorkerConfig

pytestmark = pytest.mark.usefixtures("mpiexec")

MLP = ["--model", "mlp", "--d-in", "8", "--d-hidden", "16", "--n-classes", "4",
       "--n-samples", "512", "--batch-size", "8"]


def run(*cmd: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=timeout)


def interrupt(cmd: list[str], after_line: str, timeout: float = 60) -> tuple[int, str]:
    """Start `cmd`, wait for `after_line` on stderr, send SIGINT to its process group."""
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    deadline, seen = time.monotonic() + timeout, []
    try:
        for line in proc.stderr:
            seen.append(line)
            if after_line in line or time.monotonic() > deadline:
                break
        proc.send_signal(signal.SIGINT)
        _, rest = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, "".join(seen) + rest


@pytest.mark.parametrize("cls", [RunConfig, DataConfig, OptimConfig, MLPConfig,
                                 TransformerConfig, ServerConfig, ClientConfig, WorkerConfig])
def test_every_flag_has_a_help_line(cls):
    missing = [f.name for f in dataclasses.fields(cls) if not f.metadata.get("help")]
    assert not missing, f"{cls.__name__} fields without help: {missing}"


def test_pserver_help_exits_0():
    out = run(sys.executable, "-m", "dtlab.pserver", "--help")
    assert out.returncode == 0 and "serve" in out.stdout


def test_ctrl_c_ends_a_trainer_with_one_line():
    rc, err = interrupt([sys.executable, "-m", "dtlab.models.run.train", *MLP, "--steps", "1000000",
                         "--log-every", "1"], after_line="step      2/")
    assert rc == 130, err  # after the step in progress (models/run/stop.py)
    assert err.rstrip().splitlines()[-1].startswith("stopped by SIGINT after step "), err
    assert "Traceback" not in err


def test_ctrl_c_stops_every_rank_of_an_mpi_job_after_one_step():
    """Every rank gets the signal (mpiexec forwards it), they agree on the step to stop
    after, and rank 0 says so in one line; nothing else is said."""
    rc, err = interrupt([mpiexec_path(), "-n", "2", sys.executable, "-m", "dtlab.collective.train",
                         *MLP, "--steps", "1000000", "--log-every", "1"], after_line="step      2/")
    assert rc == 130, err
    lines = [line for line in err.splitlines() if "SIGINT" in line or "interrupted" in line]
    assert len(lines) == 1 and lines[0].startswith("stopped by SIGINT after step "), err
    assert "Traceback" not in err and "MPI_Abort" not in err


def test_each_rank_names_itself_in_its_error_line():
    """Every rank hits the bad flag; the first to abort may end the others before they
    print, so each line that arrives is whole and names its rank."""
    r = mpirun(2, "-m", "dtlab.collective.train", "--bucket-mb", "-1", wrap=False, timeout=60)
    assert r.rc != 0 and not r.timed_out
    lines = [line for line in r.stderr.splitlines() if "must be positive" in line]
    expected = {f"python -m dtlab.collective.train: rank {k}: error: --bucket-mb must be "
                "positive (got -1.0)" for k in (0, 1)}
    assert lines and set(lines) <= expected and len(set(lines)) == len(lines), r


def test_console_and_metrics_count_steps_alike(tmp_path):
    path = tmp_path / "m.jsonl"
    out = run(sys.executable, "-m", "dtlab.models.run.train", *MLP, "--steps", "5",
              "--log-every", "1", "--metrics", str(path))
    assert out.returncode == 0, out.stderr
    console = [int(line.split()[1].split("/")[0]) for line in out.stderr.splitlines()
               if line.startswith("step ")]
    assert console == [r["step"] for r in read_metrics(str(path))[1]] == [1, 2, 3, 4, 5]
    assert "final training loss" in out.stdout and "(the last step)" in out.stdout
    assert "data teacher: 512 examples, 8 features, 4 classes" in out.stderr


def test_resume_says_what_it_did(tmp_path):
    ck = ["--checkpoint-dir", str(tmp_path / "ck"), "--checkpoint-every", "2"]
    train = [sys.executable, "-m", "dtlab.models.run.train", *MLP, *ck]
    out = run(*train, "--steps", "4", "--resume")
    assert "no checkpoint in" in out.stderr and out.returncode == 0, out.stderr
    out = run(*train, "--steps", "6", "--resume")
    assert f"resumed from step 4 of {tmp_path / 'ck'}" in out.stderr
    assert "--steps is 6, the checkpointed run had 4" in out.stderr
    out = run(*train, "--steps", "6", "--resume")
    assert "already reached step 6 of --steps 6: nothing to do" in out.stderr
    assert "no steps run" in out.stdout and "nan" not in out.stdout
    out = run(*train, "--steps", "8", "--resume", "--d-hidden", "32", "--lr", "0.5")
    assert out.returncode == 1
    assert "model.d_hidden: 16 -> 32" in out.stderr and "optim.lr: 0.01 -> 0.5" in out.stderr


@pytest.mark.parametrize("name", ["pserver", "optim"])
def test_every_benchmark_flag_has_a_help_line(name):
    module = importlib.import_module(f"dtlab.lab.bench.{name}")
    missing = [f.name for f in dataclasses.fields(module.BenchConfig) if not f.metadata.get("help")]
    assert not missing, f"bench {name} flags without help: {missing}"
