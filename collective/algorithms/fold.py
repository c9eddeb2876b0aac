"""Folding a world that is not a power of two into one that is.

Thakur, Rabenseifner & Gropp, "Optimization of collective communication
operations in MPICH" (IJHPCA 2005), section 4: with p the largest power of
two <= N and extra = N - p, each of the first `extra` even ranks sends its
whole buffer to the odd rank above it, which adds it in and stands for both
in the power-of-two algorithm under virtual rank r // 2; the other ranks
take virtual rank r - extra. At the end each odd rank sends the result back
down:

    N = 3:   rank 0 --buf--> rank 1 (adds)      vranks: 1 -> 0, 2 -> 1
             ... the 2-rank algorithm on ranks 1, 2 ...
             rank 0 <--SUM-- rank 1

The even rank's part is two steps, send and then receive; it waits through
the whole algorithm in between.
"""

from __future__ import annotations

from dtlab.collective.algorithms.steps import Part, Step


class Fold:
    """This rank's place in the folded world of `n` ranks."""

    def __init__(self, rank: int, n: int, length: int):
        self.p = 1 << (n.bit_length() - 1)
        self.extra = n - self.p
        self.rank, self.whole = rank, Part(0, length)
        folded = rank < 2 * self.extra
        self.sits_out = folded and rank % 2 == 0
        self.vrank = None if self.sits_out else (rank // 2 if folded else rank - self.extra)

    def real(self, vrank: int) -> int:
        """The rank that plays virtual rank `vrank`."""
        return 2 * vrank + 1 if vrank < self.extra else vrank + self.extra

    def steps_in(self) -> list[Step]:
        """Before the power-of-two algorithm (all of it for a rank that sits out)."""
        r, whole = self.rank, self.whole
        if self.sits_out:
            return [Step(sends=((r + 1, whole),)), Step(recvs=((r + 1, whole),))]
        if r < 2 * self.extra:
            got = Part(0, whole.hi, 0)
            return [Step(recvs=((r - 1, got),), adds=((whole, whole, got),))]
        return []

    def steps_out(self) -> list[Step]:
        """After it: the odd rank returns the result."""
        if self.vrank is not None and self.rank < 2 * self.extra:
            return [Step(sends=((self.rank - 1, self.whole),))]
        return []
