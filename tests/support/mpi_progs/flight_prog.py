"""Planted hangs for the flight recorder (see tests/collective/test_flight.py).

    DTLAB_COLLECTIVE_TIMEOUT=2 DTLAB_FLIGHT_DIR=/tmp/fl mpiexec -n 3 \\
        python tests/support/mpi_progs/flight_prog.py skip
    python -m dtlab.collective.transport.flight /tmp/fl

skip:     rank 1 skips the third of five 4 KB all-reduces, then works alone
          (sleeps): ranks 0 and 2 stall in the fifth, which rank 1 never calls.
mismatch: rank 2 calls allgather where ranks 0 and 1 call their third
          all-reduce (the size check has passed, so only the watchdog sees it).
raise:    rank 0 raises between two all-reduces (the abort path dumps).

Every case runs its all-reduces through shared memory (`ours="shm-one-shot"`),
so the job holds an MPI-3 shared window when it ends. Run without
`-m mpi4py`: dtlab's own abort handler ends the job.
"""

from __future__ import annotations

import sys
import time

import numpy as np

from dtlab.collective import world


def main(case: str) -> None:
    comm = world(ours="shm-one-shot")
    x = np.ones(1024, np.float32)  # (1024,) 4 KB
    comm.barrier()
    for step in range(5):
        if case == "skip" and comm.rank == 1 and step == 2:
            continue
        if case == "mismatch" and comm.rank == 2 and step == 2:
            comm.allgather(x)
            continue
        if case == "raise" and comm.rank == 0 and step == 2:
            raise RuntimeError("planted failure on rank 0")
        comm.allreduce(x)
    time.sleep(60)  # rank 1 of "skip" works alone here; the others never get here


if __name__ == "__main__":
    main(sys.argv[1])
