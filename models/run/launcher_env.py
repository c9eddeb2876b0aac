"""What the launcher (mpiexec of MPICH or Open MPI, srun) told this process, read
from its environment without importing MPI: rank, size and ranks on this host;
and which mpiexec starts more of them.

    rank, size = launcher_rank(), launcher_size()   # None, None outside a launcher
    who()                                           # "rank 3: " under a launcher of 2+, else ""
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path

RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID")
SIZE_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "SLURM_NTASKS")
LOCAL_SIZE_VARS = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE")


def first_int(names: tuple[str, ...], env: Mapping[str, str] | None = None
              ) -> tuple[int, str] | None:
    """(value, variable) of the first of `names` set to a non-negative integer in `env`
    (default: this process's environment)."""
    env = os.environ if env is None else env
    for name in names:
        value = env.get(name, "")
        if value.isdigit():
            return int(value), name
    return None


def launcher_rank() -> int | None:
    found = first_int(RANK_VARS)
    return None if found is None else found[0]


def launcher_size() -> int | None:
    found = first_int(SIZE_VARS)
    return None if found is None else found[0]


def who() -> str:
    """A prefix naming this process among its launcher's, for messages: "rank 3: " or ""."""
    size, rank = launcher_size(), launcher_rank()
    return f"rank {rank}: " if size and size > 1 and rank is not None else ""


def mpiexec_path() -> str:
    """$DTLAB_MPIEXEC (a cluster's own launcher), else the mpiexec beside this interpreter
    (the `mpich` wheel's), else the one on PATH."""
    chosen = os.environ.get("DTLAB_MPIEXEC")
    if chosen:
        return chosen
    local = Path(sys.executable).parent / "mpiexec"
    if local.exists():
        return str(local)
    found = shutil.which("mpiexec")
    if found is None:
        raise FileNotFoundError("no mpiexec beside the interpreter or on PATH: pip install mpich")
    return found
