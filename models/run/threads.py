"""BLAS and OpenMP threads per process: the host's cores shared by the processes on it.

NumPy's BLAS (OpenBLAS, MKL) and OpenMP start one thread per core of the
machine in every process. N ranks or workers on one host then run N x cores
threads that preempt each other inside every matmul: a sync or async run
becomes several times slower than it needs to be, and a comparison of
topologies measures how badly each oversubscribes. Every entry point calls
`share_cores()` once at start:

    threads = share_cores(role="rank")   # before the first matmul
    print(threads.describe())            # "1 BLAS/OpenMP thread: 2 cores / 2 processes ..."

The count is the cores this process may run on (its affinity mask) divided
by the processes the launcher put on this host (MPICH/Hydra's
MPI_LOCALNRANKS, Open MPI's OMPI_COMM_WORLD_LOCAL_SIZE, Slurm's
SLURM_NTASKS_PER_NODE), at least 1. A mask narrower than the machine means
the launcher already gave each process its cores (`-bind-to core`,
`--cpus-per-task`), so the mask's size is used as it is. A thread variable
the user set (OMP_NUM_THREADS, OPENBLAS_NUM_THREADS, MKL_NUM_THREADS) wins
and is reported as such. The limit is applied through threadpoolctl, which
works after NumPy has loaded its BLAS.

Where the process owns its cores (alone on its host by the launcher's count, or
given a mask by the launcher) and runs T > 1 threads, its T - 1 helper threads (the
BLAS's workers and the passes' pool) are bound to the cores after the first
(models/placement.py says why); DTLAB_BIND_HELPERS=0 leaves them to the scheduler.
A process with a thread variable the user set is not bound: it may share its host.

How long an idle BLAS thread spins before it sleeps is read when the BLAS
loads, so models/__init__.py (which collective/, pserver/ and the lab import
first) sets it, and says why.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, replace

import numpy  # noqa: F401 - loads the BLAS whose thread pool is limited here
from threadpoolctl import threadpool_info, threadpool_limits

from dtlab.models import placement
from dtlab.models.layers import numpy_blas
from dtlab.models.run.launcher_env import LOCAL_SIZE_VARS, first_int

USER_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")
BIND_VAR = "DTLAB_BIND_HELPERS"  # "0": the helper threads are left to the scheduler


@dataclass(frozen=True)
class ThreadChoice:
    """What share_cores() chose and why (recorded in every metrics header)."""

    threads: int  # BLAS/OpenMP threads per process now in force
    cores: int  # cores in this process's affinity mask
    processes: int  # processes sharing them (1 when the mask is already per process)
    source: str  # where `processes` or the count came from
    placement: str = ""  # where the helper threads run (placement.bind_helpers), if T > 1

    def describe(self) -> str:
        noun = "thread" if self.threads == 1 else "threads"
        placed = f"; {self.placement}" if self.placement else ""
        if self.source.startswith("user"):
            return f"{self.threads} BLAS/OpenMP {noun} ({self.source}){placed}"
        return (f"{self.threads} BLAS/OpenMP {noun}: {self.cores} core(s) / {self.processes} "
                f"process(es) on this host ({self.source}){placed}")

    def as_dict(self) -> dict:
        return asdict(self)


def _cpu_count() -> int:
    return os.cpu_count() or 1


def _mask() -> set[int]:
    try:
        return os.sched_getaffinity(0)
    except AttributeError:  # not Linux
        return set(range(_cpu_count()))


def _affinity() -> int:
    return len(_mask())


def local_processes() -> tuple[int, str]:
    """(processes the launcher started on this host, the variable that said so), else (1, ...)."""
    found = first_int(LOCAL_SIZE_VARS)
    return found if found and found[0] > 0 else (1, "no launcher variable: one process")


def user_threads() -> tuple[int, str] | None:
    """The thread count the user fixed through the environment, if any."""
    for name in USER_VARS:
        value = os.environ.get(name, "")
        if value.isdigit() and int(value) > 0:
            return int(value), f"user set {name}={value}"
    return None


def choose(processes: int | None = None) -> ThreadChoice:
    """The thread count for this process; `processes` overrides the launcher's local size."""
    cores = _affinity()
    user = user_threads()
    if user is not None:
        return ThreadChoice(user[0], cores, 1, user[1])
    if cores < _cpu_count():
        return ThreadChoice(cores, cores, 1, "affinity mask set by the launcher")
    if processes is None:
        processes, source = local_processes()
    else:
        source = "caller"
    return ThreadChoice(max(1, cores // processes), cores, processes, source)


def share_cores(processes: int | None = None, threads: int | None = None) -> ThreadChoice:
    """Limit BLAS and OpenMP to this process's share of the host's cores (see module doc).

    `threads` fixes the count for processes that do no BLAS work of their
    own (the parameter-server daemon) unless the user set a variable.
    """
    choice = choose(processes)
    if threads is not None and not choice.source.startswith("user"):
        choice = ThreadChoice(threads, choice.cores, 1, "fixed by this program")
    threadpool_limits(limits=choice.threads)
    placed = placement.bind_helpers(helper_cores(choice), numpy_blas())
    return replace(choice, placement=placed if choice.threads > 1 else "")


def helper_cores(choice: ThreadChoice) -> tuple[int, ...]:
    """The cores for the choice's T - 1 helper threads: this process's after the first,
    where it owns them (module doc); () leaves the helpers to the scheduler."""
    owned = choice.processes == 1 and not choice.source.startswith(("user", "fixed"))
    if choice.threads < 2 or not owned or os.environ.get(BIND_VAR) == "0":
        return ()
    return tuple(sorted(_mask())[1:choice.threads])


def threads_in_use() -> dict[str, int]:
    """{library api: threads} as the loaded thread pools report them (for tests and logs)."""
    return {pool["user_api"]: pool["num_threads"] for pool in threadpool_info()}
