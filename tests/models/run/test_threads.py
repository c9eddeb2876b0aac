"""Cores shared among the processes of a host (models/run/threads.py), in one process and
under mpiexec, where every rank must run cores // ranks BLAS threads by itself."""

from __future__ import annotations

import json
import os
import re

import pytest
from support.mpirun import mpirun

from dtlab.models.run import threads

pytestmark = pytest.mark.usefixtures("mpiexec")

THREAD_VARS = threads.USER_VARS + threads.LOCAL_SIZE_VARS
CORES = len(os.sched_getaffinity(0))
MLP = ["--model", "mlp", "--d-in", "8", "--d-hidden", "16", "--n-classes", "4",
       "--n-samples", "256", "--batch-size", "8", "--steps", "2"]


@pytest.fixture
def clean_env(monkeypatch):
    for var in THREAD_VARS:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_alone_a_process_takes_every_core(clean_env):
    choice = threads.choose()
    assert (choice.threads, choice.processes) == (CORES, 1)


def test_launcher_local_size_divides_the_cores(clean_env):
    clean_env.setenv("MPI_LOCALNRANKS", "2")
    assert threads.choose().threads == max(1, CORES // 2)
    clean_env.setenv("MPI_LOCALNRANKS", str(4 * CORES))
    choice = threads.choose()
    assert choice.threads == 1 and choice.source == "MPI_LOCALNRANKS"


def test_a_variable_the_user_set_wins(clean_env):
    clean_env.setenv("MPI_LOCALNRANKS", "2")
    clean_env.setenv("OPENBLAS_NUM_THREADS", "3")
    choice = threads.choose()
    assert choice.threads == 3 and "OPENBLAS_NUM_THREADS=3" in choice.describe()


def test_share_cores_sets_the_blas_pool(clean_env):
    try:
        assert threads.share_cores(threads=1).threads == 1
        assert threads.threads_in_use()["blas"] == 1
    finally:
        threads.share_cores()
    assert threads.threads_in_use()["blas"] == CORES


def _clean_env() -> dict[str, str]:
    return {var: "" for var in threads.USER_VARS}


def test_two_ranks_each_run_their_share():
    r = mpirun(2, "tests/support/mpi_progs/threads_check.py", env=_clean_env(), timeout=60)
    assert r.rc == 0, r
    lines = sorted(re.findall(r"rank (\d) threads (\d+) blas (-?\d+) source (\S+)", r.stdout))
    expected = str(max(1, CORES // 2))
    assert lines == [(str(rank), expected, expected, "MPI_LOCALNRANKS") for rank in (0, 1)], r


def test_sync_trainer_records_its_threads(tmp_path):
    metrics = tmp_path / "sync.jsonl"
    r = mpirun(2, "-m", "dtlab.collective.train", *MLP, "--metrics", str(metrics),
               env=_clean_env(), timeout=120)
    assert r.rc == 0, r
    header = json.loads(metrics.read_text().splitlines()[0])
    assert header["threads"]["threads"] == max(1, CORES // 2)
    assert header["threads"]["processes"] == 2
    assert "BLAS/OpenMP thread" in r.stderr, r
