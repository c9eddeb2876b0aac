"""Recursive-doubling all-reduce: the small-message path of the ring.

Thakur, Rabenseifner & Gropp, "Optimization of collective communication
operations in MPICH" (IJHPCA 2005), section 4. In round k = 0, 1, ... every
rank exchanges its whole buffer with the rank whose number differs in bit k
and adds what it receives, so after log2(N) rounds every rank holds the sum:

    N = 4     round 0: 0<->1, 2<->3        (x0+x1, x0+x1, x2+x3, x2+x3)
              round 1: 0<->2, 1<->3        (SUM on every rank)

log2(N) messages in sequence instead of the ring's 2(N - 1), at the price of
moving the whole buffer each round (L log2 N instead of 2(N - 1)/N L), so it
wins only while latency dominates, below `small_bytes` (collective/comm.py).

A world that is not a power of two first folds: of the first 2 * (N - p)
ranks (p the largest power of two <= N) each even rank sends its buffer to
the odd rank above it and waits for the result, which that odd rank sends
back at the end. Every pair adds in the same two operands (a + b and b + a are
the same IEEE sum), so all ranks end with bit-identical results.
"""

from __future__ import annotations

from dtlab.collective.link import TAG_DOUBLING, Link, byte_view

_OP = "allreduce(doubling)"


def doubling_allreduce(link: Link, buf, *, xp, sync, divide: int | None) -> None:
    """Sum (or average, divide=N) `buf` (L,) by recursive doubling, in place."""
    comm, n, r = link.comm, link.size, link.rank
    p = 1 << (n.bit_length() - 1)
    extra = n - p
    tmp = link.ws.mirrored("doubling", buf, xp)  # (L,), at buf's page offset (link.mirror)
    msg, tmp_msg = byte_view(buf), byte_view(tmp)
    if sync is not None:
        sync()
    if r < 2 * extra and r % 2 == 0:
        link.wait(comm.Isend(msg, r + 1, TAG_DOUBLING), _OP, r + 1)
        link.wait(comm.Irecv(msg, r + 1, TAG_DOUBLING), _OP, r + 1)
        return
    if r < 2 * extra:
        link.wait(comm.Irecv(tmp_msg, r - 1, TAG_DOUBLING), _OP, r - 1)
        xp.add(buf, tmp, out=buf)
        vr = r // 2
    else:
        vr = r - extra
    mask = 1
    while mask < p:
        vpeer = vr ^ mask
        peer = 2 * vpeer + 1 if vpeer < extra else vpeer + extra
        if sync is not None:
            sync()
        reqs = [comm.Irecv(tmp_msg, peer, TAG_DOUBLING), comm.Isend(msg, peer, TAG_DOUBLING)]
        link.waitall(reqs, _OP, peer)
        xp.add(buf, tmp, out=buf)
        mask <<= 1
    if divide is not None:
        xp.true_divide(buf, divide, out=buf)
    if r < 2 * extra:
        if sync is not None:
            sync()
        link.wait(comm.Isend(msg, r - 1, TAG_DOUBLING), _OP, r - 1)
