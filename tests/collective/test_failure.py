"""A failing rank ends the job quickly and says why (tests/support/mpi_progs/failure_prog.py).

The jobs run `python PROG`, not `python -m mpi4py PROG`: dtlab's own
abort handler has to end them. Each has a timeout far above the few seconds
an abort takes, so a hang fails the test instead of the suite.
"""

from __future__ import annotations

import pytest
from support.mpirun import mpirun

pytestmark = pytest.mark.usefixtures("mpiexec")

PROG = "tests/support/mpi_progs/failure_prog.py"
QUICK_S = 20  # an abort takes about 1 s; generous for a loaded machine


def test_exception_on_one_rank_aborts_the_job_with_its_traceback():
    r = mpirun(3, PROG, "raise", wrap=False, timeout=90)
    assert not r.timed_out and r.rc != 0, r
    assert r.seconds < QUICK_S, r
    assert "uncaught exception on rank 1 of 3" in r.stderr, r
    assert "Traceback" in r.stderr and "ValueError: boom on rank 1" in r.stderr, r


def test_exception_in_a_thread_aborts_the_job():
    r = mpirun(3, PROG, "thread-raise", wrap=False, timeout=90)
    assert not r.timed_out and r.rc != 0, r
    assert r.seconds < QUICK_S, r
    assert "uncaught exception in thread 'worker' on rank 0" in r.stderr, r
    assert "RuntimeError: boom in a thread of rank 0" in r.stderr, r


def test_stalled_ring_names_the_peer_after_the_env_timeout():
    r = mpirun(2, PROG, "stall", wrap=False, timeout=90, env={"DTLAB_COLLECTIVE_TIMEOUT": "1"})
    assert not r.timed_out and r.rc != 0, r
    assert r.seconds < QUICK_S, r  # rank 1 sleeps 120 s: only the watchdog ends this early
    assert "rank 0: allreduce(ring) on 'world' stalled" in r.stderr, r
    assert "waiting for rank 1 (world rank 1)" in r.stderr, r


def test_stalled_recv_names_the_peer_after_the_timeout_argument():
    r = mpirun(2, PROG, "stall-recv", wrap=False, timeout=90)
    assert not r.timed_out and r.rc != 0, r
    assert r.seconds < QUICK_S, r
    assert "recv(tag 3) on 'p2p' stalled: no progress for 1 s" in r.stderr, r
    assert "waiting for rank 1" in r.stderr, r


def test_ranks_that_disagree_get_an_error_naming_both():
    r = mpirun(3, PROG, "mismatch", timeout=90)
    assert r.rc == 0, r
    out = r.stdout
    assert ("rank 0 (world rank 0) has allreduce(1000 x float32, ours), "
            "rank 2 (world rank 2) has allreduce(999 x float32, ours)") in out, r
    assert "rank 1 (world rank 1) has allreduce(1000 x float64, ours)" in out, r
    assert ("rank 0 (world rank 0) has allreduce(64 x float16, ours), rank 1 (world rank "
            "1) has allreduce(64 x bfloat16, ours)") in out, r
    assert "has broadcast(1000 x float64, root 0), rank 1" in out, r
    assert "rank 1 (world rank 1) has allreduce(1000 x float64, mpi)" in out, r
    assert "rank 2 (world rank 2) has reduce_scatter(11 x float64)" in out, r
    assert "rank 1 expected 96 bytes from rank 0 (tag 7), got 80" in out, r
    assert "rank 1 expected 80 bytes from rank 0 (tag 7), which sent more" in out, r
    assert "DONE" in out, r
