"""Ways for one rank to go wrong, each in a real MPI job (see tests/collective/test_failure.py).

    mpiexec -n 3 python tests/support/mpi_progs/failure_prog.py raise        # job must abort
    mpiexec -n 3 python tests/support/mpi_progs/failure_prog.py thread-raise # job must abort
    DTLAB_COLLECTIVE_TIMEOUT=1 mpiexec -n 2 python tests/support/mpi_progs/failure_prog.py stall
    mpiexec -n 2 python tests/support/mpi_progs/failure_prog.py stall-recv   # timeout=1 argument
    mpiexec -n 3 python -m mpi4py tests/support/mpi_progs/failure_prog.py mismatch

Run without `-m mpi4py` on purpose: dtlab's own abort handler (installed
by `world()`) must end the job. `mismatch` prints one "MISMATCH <message>"
line per scenario from the rank(s) that raised, then "DONE".
"""

from __future__ import annotations

import sys
import threading
import time

import ml_dtypes
import numpy as np

from dtlab.collective import Communicator, MismatchError, world


def raise_on_rank_1(comm: Communicator) -> None:
    comm.barrier()
    if comm.rank == 1:
        raise ValueError("boom on rank 1")
    comm.allreduce(np.ones(1000, np.float32))  # would wait forever for rank 1


def raise_in_thread(comm: Communicator) -> None:
    comm.barrier()
    if comm.rank == 0:
        def work():
            raise RuntimeError("boom in a thread of rank 0")

        threading.Thread(target=work, name="worker").start()
    comm.barrier()  # rank 0 enters too, so nothing but the abort ends the job
    comm.barrier()


def stall(comm: Communicator) -> None:
    comm.ours = "ring"
    x = np.ones(100_000, np.float32)
    comm.allreduce(x)  # together once (this also passes the size check)
    if comm.rank == 1:
        time.sleep(120)
    comm.allreduce(x)  # rank 0 waits in the ring for its left neighbour, rank 1


def stall_recv(comm: Communicator) -> None:
    comm = Communicator(timeout=1.0, name="p2p")
    if comm.rank == 1:
        time.sleep(120)
    comm.recv(np.zeros(10), source=1, tag=3)


def mismatches(comm: Communicator) -> None:
    r, last = comm.rank, comm.size - 1
    scenarios = {
        "size": lambda: comm.allreduce(np.ones(999 if r == last else 1000, np.float32)),
        "dtype": lambda: comm.allreduce(np.ones(1000, np.float64 if r == 1 else np.float32)),
        "half dtype": lambda: comm.allreduce(
            np.ones(64, ml_dtypes.bfloat16 if r == 1 else np.float16)),
        "operation": lambda: (comm.broadcast if r == 0 else comm.allreduce)(np.ones(1000)),
        "algorithm": lambda: comm.allreduce(np.ones(1000), algo="mpi" if r == 1 else "ours"),
        "reduce_scatter": lambda: comm.reduce_scatter(np.ones(10 + (r == last))),
    }
    for name, fn in scenarios.items():
        try:
            fn()
        except MismatchError as e:
            if r == 0:
                print(f"MISMATCH {name}: {e}", flush=True)
        else:
            raise AssertionError(f"rank {r}: no MismatchError for a {name} mismatch")
    for sent, expected in ((10, 12), (12, 10)):
        if r == 0:
            comm.send(np.ones(sent), dest=1, tag=7)
        elif r == 1:
            try:
                comm.recv(np.zeros(expected), source=0, tag=7)
            except MismatchError as e:
                print(f"MISMATCH recv {sent}->{expected}: {e}", flush=True)
            else:
                raise AssertionError("no MismatchError for a recv of the wrong size")
    ok = comm.allreduce(np.ones(1000, np.float32))  # the communicator still works
    assert np.array_equal(ok, np.full(1000, comm.size, np.float32))
    comm.barrier()
    if r == 0:
        print("DONE", flush=True)


MODES = {
    "raise": raise_on_rank_1,
    "thread-raise": raise_in_thread,
    "stall": stall,
    "stall-recv": stall_recv,
    "mismatch": mismatches,
}

if __name__ == "__main__":
    MODES[sys.argv[1]](world())
