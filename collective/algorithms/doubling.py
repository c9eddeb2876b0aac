"""Recursive-doubling all-reduce: the small-message algorithm.

Thakur, Rabenseifner & Gropp, "Optimization of collective communication
operations in MPICH" (IJHPCA 2005), section 4. In round k = 0, 1, ... every
rank exchanges its whole buffer with the rank whose number differs in bit k
and adds what it receives, so after log2(N) rounds every rank holds the sum:

    N = 4     round 0: 0<->1, 2<->3        (x0+x1, x0+x1, x2+x3, x2+x3)
              round 1: 0<->2, 1<->3        (SUM on every rank)

log2(N) messages in sequence (halving-doubling has 2 log2 N, the ring
2(N - 1)), at the price of moving the whole buffer each round (L log2 N
instead of 2(N - 1)/N L), so it wins only while latency dominates
(collective/algorithms/choose.py). A world that is not a power of two folds first
(collective/algorithms/fold.py). The two ranks of a pair add the same two operands
(a + b and b + a are the same IEEE sum), so all ranks end with bit-identical
results.
"""

from __future__ import annotations

from dataclasses import replace

from dtlab.collective.algorithms.fold import Fold
from dtlab.collective.algorithms.steps import Bound, Step, bind, exchange
from dtlab.collective.transport.link import Link


def doubling_plan(rank: int, n: int, length: int) -> list[Step]:
    """This rank's steps: fold in, log2(p) whole-buffer exchanges, fold out."""
    fold = Fold(rank, n, length)
    steps = fold.steps_in()
    if fold.vrank is None:
        return steps
    for k in range(fold.p.bit_length() - 1):
        steps.append(exchange(fold.real(fold.vrank ^ (1 << k)), fold.whole, fold.whole, add=True))
    steps[-1] = replace(steps[-1], divide=fold.whole)
    return steps + fold.steps_out()


def bind_doubling(link: Link, buf, xp) -> Bound:
    """The recursive-doubling all-reduce of `buf` (L,), ready to `.run()`."""
    key = ("doubling", buf.size, buf.dtype.char)
    return bind(link, key, lambda: doubling_plan(link.rank, link.size, buf.size), buf, xp,
                "allreduce(doubling)")
