"""Run a real MPI job from a test, with a timeout so that a hang fails fast.

    from support.mpirun import mpirun      # tests/ is on sys.path under pytest

    r = mpirun(3, "tests/support/mpi_progs/collectives_check.py", "--quick", timeout=60)
    assert r.rc == 0, r            # str(r) shows the command, rc and output tails

    r = mpirun(2, "-m", "dtlab.collective.train", "--steps", "4", timeout=120)
    r = mpirun(2, "-c", "from mpi4py import MPI; print(MPI.COMM_WORLD.rank)")

The job is `mpiexec -n N python -m mpi4py ARGS...`, run from the repository
root with this interpreter and the `mpiexec` beside it (the `mpich` wheel's)
or on PATH. `python -m mpi4py` aborts the whole job when a rank raises;
pass `wrap=False` to run `python ARGS...` instead, e.g. to test that dtlab's
own abort handler does that without it.

The environment is this one plus `env`, with PYTHONUNBUFFERED=1 (output
survives MPI_Abort); dtlab's entry points share the cores among the ranks
themselves (models/run/threads.py). Oversubscription (N above the core count) needs
nothing with MPICH's Hydra: it does not bind ranks to cores by default.

On timeout the whole process group (mpiexec, its proxy and every rank) is
killed and the result has `timed_out` set and rc -9. A job that failed
leaves MPICH's shared-memory files in /dev/shm (they go in MPI_Finalize);
the ones it made are removed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from dtlab.models.run.launcher_env import mpiexec_path

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class MPIResult:
    cmd: list[str]
    rc: int
    stdout: str
    stderr: str
    seconds: float
    timed_out: bool

    def __str__(self) -> str:
        state = "TIMED OUT" if self.timed_out else f"rc={self.rc}"
        return (
            f"{' '.join(self.cmd)}\n{state} after {self.seconds:.1f} s\n"
            f"--- stdout (tail) ---\n{self.stdout[-4000:]}\n"
            f"--- stderr (tail) ---\n{self.stderr[-4000:]}"
        )


def mpirun(
    n: int,
    *args: str,
    timeout: float = 60.0,
    env: dict[str, str] | None = None,
    wrap: bool = True,
    launcher_args: tuple[str, ...] = (),
) -> MPIResult:
    """Run `mpiexec [launcher_args] -n n python [-m mpi4py] args...`; see the module docstring."""
    cmd = [mpiexec_path(), *launcher_args, "-n", str(n), sys.executable]
    if wrap:
        cmd += ["-m", "mpi4py"]
    cmd += [str(a) for a in args]
    full_env = dict(os.environ)
    full_env["PYTHONUNBUFFERED"] = "1"
    full_env.update(env or {})
    # a job that aborts dumps its flight recorder here, not into the checkout
    full_env.setdefault("DTLAB_FLIGHT_DIR", tempfile.mkdtemp(prefix="dtlab-flight-"))
    before = _mpich_segments()
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        timed_out = True
    if proc.returncode != 0:  # MPICH unlinks its node segments only in MPI_Finalize
        for path in _mpich_segments() - before:
            path.unlink(missing_ok=True)
    return MPIResult(cmd, proc.returncode, out, err, time.monotonic() - start, timed_out)


def _mpich_segments() -> set[Path]:
    """MPICH's shared-memory files of the jobs on this host (a failed job leaves its own)."""
    return set(Path("/dev/shm").glob("mpich_shm_*"))
