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


def _blas_worker_masks() -> list[set[int]]:
    """Each of OpenBLAS's CORES - 1 workers' cores, read back by openblas_getaffinity (which
    reaches only the workers within the BLAS's thread count: raised to CORES for it)."""
    import ctypes

    from dtlab.models import layers, placement
    blas = layers.numpy_blas()
    getaffinity = placement._symbol(blas.dynlib, "openblas_getaffinity")
    count, masks = blas.num_threads, []
    blas.set_num_threads(CORES)
    try:
        for worker in range(CORES - 1):
            bits = (ctypes.c_uint64 * 16)()
            size = ctypes.c_size_t(ctypes.sizeof(bits))
            assert getaffinity(ctypes.c_int(worker), size, bits) == 0
            masks.append({core for core in range(1024) if bits[core // 64] >> (core % 64) & 1})
    finally:
        blas.set_num_threads(count)
    return masks


def _pool_thread_masks() -> list[set[int]]:
    from dtlab.models import layers, placement
    layers.in_blocks(lambda lo, hi: None, 32 * CORES, 16)  # starts the pool's threads
    return [os.sched_getaffinity(t) for t in placement._POOL_THREADS[os.getpid(), CORES - 1]]


needs_two_cores = pytest.mark.skipif(CORES < 2, reason="one core: no helper thread to place")


@needs_two_cores
def test_a_process_alone_binds_each_helper_to_a_core_after_the_first(clean_env):
    """The BLAS's workers and the passes' pool thread run on cores 1.. (placement.py);
    the calling thread keeps the process's whole mask."""
    mask = sorted(os.sched_getaffinity(0))
    choice = threads.share_cores()
    assert "bound to core(s)" in choice.describe(), choice
    helpers = [{mask[1 + i % (CORES - 1)]} for i in range(CORES - 1)]
    assert _pool_thread_masks() == helpers
    if threads.numpy_blas().internal_api == "openblas":
        assert _blas_worker_masks() == helpers
    assert os.sched_getaffinity(0) == set(mask)


@needs_two_cores
@pytest.mark.parametrize("why", ["opted out", "user's thread count", "ranks share the host"])
def test_helpers_stay_unbound_where_the_process_may_share_its_cores(clean_env, why):
    """...and helpers bound before (the pool's threads, the BLAS's workers, even those idle
    at a lower thread count) are unbound again."""
    whole = os.sched_getaffinity(0)
    threads.share_cores()
    assert _pool_thread_masks() != [whole] * (CORES - 1)  # bound, to be unbound below
    clean_env.setenv(*{"opted out": (threads.BIND_VAR, "0"),
                       "user's thread count": ("OMP_NUM_THREADS", str(CORES)),
                       "ranks share the host": ("MPI_LOCALNRANKS", str(CORES))}[why])
    try:
        choice = threads.share_cores()
        if choice.threads > 1:
            assert "placed by the scheduler" in choice.describe(), choice
        assert _pool_thread_masks() == [whole] * (CORES - 1)
        if threads.numpy_blas().internal_api == "openblas":
            assert _blas_worker_masks() == [whole] * (CORES - 1)
    finally:
        clean_env.delenv(threads.BIND_VAR, raising=False)
        clean_env.delenv("OMP_NUM_THREADS", raising=False)
        clean_env.delenv("MPI_LOCALNRANKS", raising=False)
        threads.share_cores()
