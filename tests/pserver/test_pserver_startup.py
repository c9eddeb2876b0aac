"""Start-up never hangs (pserver.common.rendezvous, `end_job`): a program of the async
job that fails before or during the rendezvous ends the whole job within seconds, its
line printed, in either direction (servers or workers failing), under mpiexec and with
a rendezvous folder under a launcher without MPI (Slurm's environment, given here).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from support.mpirun import mpirun
from support.pserver_util import ONE_BLAS_THREAD, ROOT

from dtlab.pserver.common import rendezvous

pytestmark = pytest.mark.usefixtures("mpiexec")

CONFIG = {"model_name": "mlp", "model": {"d_in": 4, "d_hidden": 8, "n_layers": 1,
                                         "n_classes": 3},
          "optim": {"optimizer": "sgd", "lr": 0.05, "clip": 0.0, "warmup": 0},
          "run": {"steps": 4, "batch_size": 8, "seed": 3}}
ENDS_WITHIN_S = 20  # "within seconds" on a loaded 2-core machine (about 2-4 s when quiet)
SERVER = [sys.executable, "-m", "dtlab.pserver", "serve"]
WORKER = [sys.executable, "-m", "dtlab.pserver.worker"]


def config(tmp) -> str:
    path = tmp / "run.json"
    path.write_text(json.dumps(CONFIG))
    return str(path)


def mpmd(servers: list[str], workers: list[str]):
    """mpiexec -n 1 SERVER... : -n 1 WORKER..., bounded well past ENDS_WITHIN_S."""
    return mpirun(1, *SERVER[1:], *servers, ":", "-n", "1", *WORKER, *workers, wrap=False,
                  timeout=60, env=ONE_BLAS_THREAD)


def test_servers_failing_on_a_flag_end_the_mpmd_job(tmp_path):
    """The workers wait in MPI_Init for the servers, which fail before they start MPI."""
    c = config(tmp_path)
    r = mpmd(["--config", c, "--rendezvous", "auto", "--bogus", "1"],
             ["--config", c, "--servers", "auto"])
    assert not r.timed_out and r.rc == 2 and r.seconds < ENDS_WITHIN_S, r
    assert "serve: error: unrecognized arguments: --bogus 1" in r.stderr, r


def test_workers_given_no_servers_end_the_mpmd_job(tmp_path):
    """The servers wait for the workers in the rendezvous; a worker given no --servers
    is not one of them, and says so."""
    c = config(tmp_path)
    r = mpmd(["--config", c, "--rendezvous", "auto"], ["--config", c])
    assert not r.timed_out and r.rc == 2 and r.seconds < ENDS_WITHIN_S, r
    assert "rank 1: error: --servers needs at least one host:port" in r.stderr, r


def test_a_program_that_takes_no_part_ends_the_job_after_the_join_timeout(tmp_path):
    """Every rank waits in MPI_Init for all: past --rendezvous-timeout-s the worker gives
    up with a line, and mpiexec ends the rest (here a program that never starts MPI)."""
    r = mpirun(1, "-c", "import time; time.sleep(50)", ":", "-n", "1", *WORKER,
               "--config", config(tmp_path), "--servers", "auto", "--rendezvous-timeout-s",
               "2", wrap=False, timeout=60, env=ONE_BLAS_THREAD)
    assert not r.timed_out and r.rc != 0 and r.seconds < ENDS_WITHIN_S + 2, r
    assert "worker: rank 1: error: MPI did not start within 2 s" in r.stderr, r


def slurm(rank: int, size: int, **extra: str) -> dict[str, str]:
    """The environment srun gives task `rank` of `size` (job 77, step 0), no MPI's."""
    env = {k: v for k, v in ONE_BLAS_THREAD.items() if not k.startswith(("PMI_", "OMPI_"))}
    return {**env, "SLURM_PROCID": str(rank), "SLURM_NTASKS": str(size), "SLURM_JOB_ID": "77",
            "SLURM_STEP_ID": "0", **extra}


def run_together(programs: list[tuple[list[str], dict]]) -> list[tuple[int, str, float]]:
    """Start every (argv, env) at once; each one's exit status, stderr and seconds."""
    start = time.monotonic()
    procs = [subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True) for argv, env in programs]
    out = []
    try:
        for p in procs:
            _, err = p.communicate(timeout=60)
            out.append((p.returncode, err, time.monotonic() - start))
    finally:
        for p in procs:
            p.kill()
            p.wait()
    return out


def test_a_server_failing_in_a_rendezvous_folder_ends_the_workers(tmp_path):
    c, rv = config(tmp_path), str(tmp_path / "rv")
    (server, server_err, _), (worker, err, took) = run_together([
        ([*SERVER, "--config", c, "--rendezvous", rv, "--num-shards", "1", "--bogus", "1"],
         slurm(0, 2)),
        ([*WORKER, "--config", c, "--servers", "auto", "--rendezvous", rv], slurm(1, 2))])
    assert server == 2 and worker == 1 and took < ENDS_WITHIN_S, (server_err, err, took)
    assert "worker: rank 1: error: --rendezvous" in err, err
    assert "the job ended: python -m dtlab.pserver serve: rank 0: error: unrecognized arguments: " \
           "--bogus 1 (exit status 2" in err, err
    assert not (tmp_path / "rv" / "failed-1.json").exists()  # ended by another's failure


def test_a_worker_failing_in_a_rendezvous_folder_ends_the_servers(tmp_path):
    c, rv = config(tmp_path), str(tmp_path / "rv")
    (server, err, took), (worker, worker_err, _) = run_together([
        ([*SERVER, "--config", c, "--rendezvous", rv, "--num-shards", "1",
          "--log-level", "warning"], slurm(0, 2)),
        ([*WORKER, "--config", c, "--servers", "auto", "--rendezvous", rv, "--steps", "-1"],
         slurm(1, 2))])
    assert worker == 2 and server == 1 and took < ENDS_WITHIN_S, (worker_err, err, took)
    assert "dtlab.pserver: rank 0: error: --rendezvous" in err, err
    assert "the job ended: python -m dtlab.pserver.worker: rank 1: error: --steps" in err, err
    assert not (tmp_path / "rv" / "shard-0.json").exists()  # no later job reads it as live


def test_which_programs_end_an_mpi_job_they_never_joined():
    """Under mpiexec (2+ ranks) a program that was to join the MPI rendezvous."""
    hydra = {"PMI_RANK": "0", "PMI_SIZE": "4"}
    assert rendezvous.mpi_member("server", ["--rendezvous", "auto", "--bogus"], hydra)
    assert rendezvous.mpi_member("server", ["--rendezvous=auto"], hydra)
    assert not rendezvous.mpi_member("server", ["--rendezvous", "/rv"], hydra)
    assert not rendezvous.mpi_member("server", ["--rendezvous", "auto"],
                                     {"PMI_RANK": "0", "PMI_SIZE": "1"})
    assert not rendezvous.mpi_member("server", ["--rendezvous", "auto"],
                                     {"SLURM_PROCID": "0", "SLURM_NTASKS": "4"})  # no MPI
    assert rendezvous.mpi_member("worker", ["--config", "c"], hydra)  # given no --servers
    assert rendezvous.mpi_member("worker", ["--servers", "auto"], hydra)
    assert not rendezvous.mpi_member("worker", ["--servers", "h:1"], hydra)  # by hand
    assert not rendezvous.mpi_member("worker", ["--servers", "auto", "--rendezvous", "/rv"],
                                     hydra)


def test_a_failure_file_of_another_job_is_not_read(tmp_path, monkeypatch):
    def fail(name: str, **record):
        (tmp_path / name).write_text(json.dumps({"rank": 3, "status": 2, "line": name,
                                                 "job": "", "time": time.time(), **record}))

    monkeypatch.setattr(rendezvous.JobFailed, "seen", False)
    fail("failed-3.json", job="76.0")  # an earlier Slurm job's
    fail("failed-4.json", time=rendezvous.STARTED - 2 * rendezvous.STALE_S)  # long before
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_STEP_ID", "0")
    assert rendezvous.peer_failure(str(tmp_path)) is None and not rendezvous.JobFailed.seen
    fail("failed-5.json", job="77.0", time=time.time() + 1)
    fail("failed-6.json", job="77.0")  # the first of this job's: its line
    assert rendezvous.peer_failure(str(tmp_path)).startswith("failed-6.json (exit status 2")
    assert rendezvous.JobFailed.seen
    monkeypatch.delenv("SLURM_JOB_ID")  # by hand: by time
    assert rendezvous.peer_failure(str(tmp_path)).startswith("failed-3.json")


def test_a_failing_program_writes_its_line_into_the_folder(tmp_path, monkeypatch):
    for name in ("PMI_RANK", "OMPI_COMM_WORLD_RANK"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("SLURM_PROCID", "5")
    path = rendezvous.write_failure(str(tmp_path / "new"), 2, "dtlab-worker: error: x")
    record = json.loads(path.read_text())
    assert path.name == "failed-5.json" and not list(path.parent.glob(".*tmp"))
    assert (record["rank"], record["status"], record["line"]) == (5, 2, "dtlab-worker: error: x")
