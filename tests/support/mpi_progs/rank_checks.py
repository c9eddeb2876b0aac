"""A check for MPI test programs: a failure names the rank; passes are counted.

    check = RankChecks(comm.rank, comm.size)
    check(got == want, f"allreduce n={n}")
    total = comm.mpi.allreduce(check.passed)   # printed by rank 0 as "PASS ... <total>"
"""

from __future__ import annotations


class RankChecks:
    def __init__(self, rank: int, size: int):
        self.rank, self.size, self.passed = rank, size, 0

    def __call__(self, ok, what: str) -> None:
        if not ok:
            raise AssertionError(f"rank {self.rank} of {self.size}: {what}")
        self.passed += 1
