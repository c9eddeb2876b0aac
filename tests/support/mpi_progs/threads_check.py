"""Each rank shares the cores (models.threads) and prints what its BLAS pools now run.

    mpiexec -n 2 python tests/support/mpi_progs/threads_check.py
prints one line per rank: "rank R threads CHOSEN blas IN_USE source SOURCE".
"""

import sys

from mpi4py import MPI

from dtlab.models.run.threads import share_cores, threads_in_use

choice = share_cores()
in_use = threads_in_use()
sys.stdout.write(f"rank {MPI.COMM_WORLD.rank} threads {choice.threads} "  # one write: whole lines
                 f"blas {in_use.get('blas', -1)} source {choice.source}\n")
sys.stdout.flush()
