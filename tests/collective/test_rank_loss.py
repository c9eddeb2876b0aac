"""A sync rank killed with -9: the job ends within seconds, the lost rank can be named, and
--resume finishes with the parameters of an uninterrupted run, bit for bit.

MPICH's launcher ends the whole job as soon as one rank dies and names by
its pid (on stdout) the first process it saw end: the killed one, or a peer
that failed on losing it; dtlab-sync's start line maps every pid to its rank.
"""

import os
import re
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

pytestmark = pytest.mark.usefixtures("mpiexec")

ARGV = ["-m", "dtlab.collective.train", "--model", "mlp", "--d-in", "8", "--n-classes", "4",
        "--d-hidden", "32", "--seed", "5", "--log-every", "50", "--checkpoint-every", "40"]
ENDS_WITHIN_S = 10.0


def test_a_killed_rank_ends_the_job_and_the_run_resumes_exactly(tmp_path):
    ck = str(tmp_path / "ck")
    cmd = [mpiexec_path(), "-n", "3", sys.executable, *ARGV, "--checkpoint-dir", ck,
           "--steps", "1000000"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    err, deadline = "", time.monotonic() + 60
    try:
        while checkpoint.latest(ck) is None or "ranks (pid@host)" not in err:
            ready, _, _ = select.select([proc.stderr], [], [], 1.0)
            if ready:
                err += proc.stderr.readline()
            assert time.monotonic() < deadline and proc.poll() is None, err
        pids = dict(re.findall(r"(\d+) (\d+)@", err.split("ranks (pid@host): ")[1]))
        os.kill(int(pids["1"]), signal.SIGKILL)
        killed = time.monotonic()
        out, rest = proc.communicate(timeout=60)
        ended_after = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    err += rest
    print(f"rank 1 (pid {pids['1']}) killed: the job ended {ended_after:.1f} s later")
    assert proc.returncode != 0 and ended_after < ENDS_WITHIN_S, err
    named = re.search(r"PID (\d+) RUNNING AT", out + err)
    assert named and named[1] in pids.values(), out  # a pid the start line maps to its rank
    saved = checkpoint.step_of(checkpoint.latest_valid(ck)[0])
    total = str(saved + 40)
    r = mpirun(3, *ARGV, "--checkpoint-dir", ck, "--steps", total, "--resume", wrap=False,
               timeout=120)
    assert r.rc == 0 and f"resumed from step {saved}" in r.stderr, r
    whole = str(tmp_path / "whole")
    r = mpirun(3, *ARGV, "--checkpoint-dir", whole, "--steps", total, wrap=False, timeout=120)
    assert r.rc == 0, r
    np.testing.assert_array_equal(checkpoint.load(checkpoint.latest(ck))[0]["params"],
                                  checkpoint.load(checkpoint.latest(whole))[0]["params"])
