"""Stragglers on purpose (--straggler, --delay-ms): seeded, the same in every topology, and
a sync run's result does not depend on them."""

import subprocess
import sys
import time

import numpy as np
import pytest
from support.mpirun import mpirun
from threadpoolctl import threadpool_limits

from dtlab.models.run.metrics import read_metrics
from dtlab.models.run.straggler import Straggler, compute_clock

pytestmark = pytest.mark.usefixtures("mpiexec")

MLP = ["--model", "mlp", "--d-in", "8", "--n-classes", "4", "--d-hidden", "32",
       "--n-samples", "4096", "--steps", "6", "--seed", "9"]


def test_delays_are_seeded_by_seed_rank_and_step():
    a, b = Straggler("", 5.0, seed=9, rank=1), Straggler("", 5.0, seed=9, rank=1)
    assert [a.extra_s(k, 0.0) for k in range(5)] == [b.extra_s(k, 0.0) for k in range(5)]
    assert a.extra_s(0, 0.0) != Straggler("", 5.0, seed=9, rank=2).extra_s(0, 0.0)
    assert Straggler("1:3", 0.0, seed=0, rank=1).extra_s(0, 0.01) == pytest.approx(0.02)
    assert not Straggler("1:3", 0.0, seed=0, rank=0).active
    speeds = [Straggler("2:2,3:4", 0.0, seed=0, rank=r).factor for r in range(4)]
    assert speeds == [1.0, 1.0, 2.0, 4.0]  # workers of different speeds
    drawn = [Straggler("lognormal:0.5", 0.0, seed=3, rank=r).factor for r in range(64)]
    assert drawn == [Straggler("lognormal:0.5", 0.0, seed=3, rank=r).factor for r in range(64)]
    assert min(drawn) >= 1.0 and len(set(drawn)) == 64  # seeded per rank, never faster
    assert 1.2 < float(np.median(drawn)) < 1.6  # exp(0.674 x 0.5) = 1.40
    assert drawn != [Straggler("lognormal:0.5", 0.0, seed=4, rank=r).factor for r in range(64)]


def test_the_factor_reads_the_threads_own_cpu_time_on_a_shared_host():
    """On the host with one BLAS thread the compute is read on the thread's CPU clock, which
    another process's turn on the cores (a waiting peer's polling) does not advance; a
    device's kernels and BLAS threads of its own keep the wall clock."""
    with threadpool_limits(limits=1):
        assert compute_clock(on_device=False) is time.thread_time
    assert compute_clock(on_device=True) is time.perf_counter
    with threadpool_limits(limits=2):
        assert compute_clock(on_device=False) is time.perf_counter


def test_a_sync_run_with_a_straggler_logs_its_delays_and_ends_the_same(tmp_path):
    plain, slow = tmp_path / "plain.jsonl", tmp_path / "slow.jsonl"
    assert mpirun(2, "-m", "dtlab.collective.train", *MLP, "--metrics", plain,
                  timeout=60).rc == 0
    r = mpirun(2, "-m", "dtlab.collective.train", *MLP, "--metrics", slow,
               "--straggler", "0:2", "--delay-ms", "3", timeout=60)
    assert r.rc == 0, r
    _, fast_records = read_metrics(str(plain))
    _, records = read_metrics(str(slow))
    delays = Straggler("", 3.0, seed=9, rank=0)
    for k, rec in enumerate(records):  # the factor applies to the previous step's compute
        assert rec["straggle_s"] >= delays.extra_s(k, 0.0)
    assert [r["loss"] for r in records] == [r["loss"] for r in fast_records]


@pytest.mark.parametrize("flags,message", [
    (["--straggler", "1"], "--straggler '1': expected RANK:FACTOR"),
    (["--straggler", "1:0.5"], "each factor >= 1"),
    (["--straggler", "1:2,1:3"], "rank 1 given twice"),
    (["--straggler", "lognormal:0"], "lognormal:SIGMA takes a positive SIGMA"),
    (["--delay-ms", "-2"], "--delay-ms must not be negative"),
])
def test_bad_straggler_flags_are_named(flags, message):
    r = subprocess.run([sys.executable, "-m", "dtlab.models.run.train", *MLP, *flags],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and message in r.stderr, r.stderr
