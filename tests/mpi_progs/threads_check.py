"""Each rank shares the cores (models.threads) and prints what its BLAS pools now run.

    mpiexec -n 2 python tests/mpi_progs/threads_check.py
prints one line per rank: "rank R threads CHOSEN blas IN_USE source SOURCE".
"""

from mpi4py import MPI

from models.threads import share_cores, threads_in_use

choice = share_cores()
in_use = threads_in_use()
print(f"rank {MPI.COMM_WORLD.rank} threads {choice.threads} blas {in_use.get('blas', -1)} "
      f"source {choice.source}", flush=True)
