"""Rabenseifner's all-reduce: reduce-scatter by recursive halving, then
all-gather by recursive doubling.

Rabenseifner, "Optimization of collective reduction operations" (ICCS 2004);
Thakur, Rabenseifner & Gropp, "Optimization of collective communication
operations in MPICH" (IJHPCA 2005), section 4.4: MPICH's Allreduce for
messages above a few KB. The buffer is cut into p segments
(ring.segment_bounds). In the reduce-scatter, each rank keeps the half of
its current range on its side of the partner and sends the other half,
adding the partner's copy of the half it keeps; the range halves each step.
The all-gather runs the same exchanges backwards, receiving the partner's
half in place, so the range doubles back to the whole buffer:

    p = 4, segments s0..s3         rank 0        rank 1        rank 2        rank 3
    reduce-scatter, partner r^2:   keeps s0 s1   keeps s0 s1   keeps s2 s3   keeps s2 s3
                                   (sends s2 s3 to rank 2, adds rank 2's s0 s1, ...)
    reduce-scatter, partner r^1:   keeps s0      keeps s1      keeps s2      keeps s3
                                   rank r now holds the SUM of segment r
    all-gather,     partner r^1:   gets s1       gets s0       gets s3       gets s2
    all-gather,     partner r^2:   gets s2 s3    gets s2 s3    gets s0 s1    gets s0 s1

Traffic per rank: (p - 1)/p L each way in each phase, the same 2(p - 1)/p L
as the ring, in 2 log2(p) messages instead of 2(p - 1); the adds total
(p - 1)/p L too. Each segment's sum is computed on one rank only and copied
to the others, so every rank ends with the same bits. A world that is not a
power of two folds first (collective/algorithms/fold.py), which costs one whole-buffer
message before and after; collective/algorithms/choose.py takes the ring there when
that costs more than it saves.
"""

from __future__ import annotations

from dataclasses import replace

from dtlab.collective.algorithms.fold import Fold
from dtlab.collective.algorithms.ring import segment_bounds
from dtlab.collective.algorithms.steps import Bound, Part, Step, bind, exchange
from dtlab.collective.transport.link import Link


def halving_plan(rank: int, n: int, length: int) -> list[Step]:
    """This rank's steps: fold in, log2(p) halving steps, log2(p) doubling steps, fold out."""
    fold = Fold(rank, n, length)
    steps = fold.steps_in()
    vr = fold.vrank
    if vr is None:
        return steps
    bounds = segment_bounds(length, fold.p)
    lo, hi = 0, fold.p  # segments [lo, hi) are this rank's current range
    exchanges = []  # (peer, kept elements, given elements)
    mask = fold.p // 2
    while mask:
        mid = lo + mask
        keep, give = ((mid, hi), (lo, mid)) if vr & mask else ((lo, mid), (mid, hi))
        kept = Part(bounds[keep[0]], bounds[keep[1]])
        exchanges.append((fold.real(vr ^ mask), kept, Part(bounds[give[0]], bounds[give[1]])))
        lo, hi = keep
        mask //= 2
    steps += [exchange(peer, kept, given, add=True) for peer, kept, given in exchanges]
    steps[-1] = replace(steps[-1], divide=exchanges[-1][1])
    steps += [exchange(peer, given, kept, add=False) for peer, kept, given in reversed(exchanges)]
    return steps + fold.steps_out()


def bind_halving(link: Link, buf, xp) -> Bound:
    """The halving-doubling all-reduce of `buf` (L,), ready to `.run()`."""
    key = ("halving", buf.size, buf.dtype.char)
    return bind(link, key, lambda: halving_plan(link.rank, link.size, buf.size), buf, xp,
                "allreduce(halving-doubling)")
