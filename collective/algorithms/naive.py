"""Naive all-reduce: every rank sends to a root, the root adds and sends back.

The baseline the ring is measured against (Gibiansky 2017, "Bringing HPC
techniques to deep learning"): the root receives (N - 1) L elements and
sends (N - 1) L, so its link carries traffic that grows with N while the
ring's stays at 2(N - 1)/N L per rank. Written, like the ring, on
point-to-point messages with receives posted ahead into the communicator's
scratch pool, so the comparison is between algorithms, not implementations.
Contributions are added in rank order, so the result is deterministic.
"""

from __future__ import annotations

from dtlab.collective.transport.link import TAG_NAIVE, Link, byte_view

_OP = "allreduce(naive)"
ROOT = 0


def naive_allreduce(link: Link, buf, *, xp, sync, divide: int | None) -> None:
    """Sum (or average, divide=N) `buf` (L,) through rank 0, in place."""
    comm, n, r = link.comm, link.size, link.rank
    msg = byte_view(buf)
    if sync is not None:
        sync()
    if r != ROOT:
        link.wait(comm.Isend(msg, ROOT, TAG_NAIVE), _OP, ROOT)
        link.wait(comm.Irecv(msg, ROOT, TAG_NAIVE), _OP, ROOT)
        return
    size = buf.size
    pool = link.ws.typed("naive", 2 * size, buf.dtype, xp)  # (2 L,): double buffer
    slots = [pool[:size], pool[size:]]
    reqs = {src: comm.Irecv(byte_view(slots[src % 2]), src, TAG_NAIVE) for src in (1, 2) if src < n}
    for src in range(1, n):
        link.wait(reqs.pop(src), _OP, src)
        xp.add(buf, slots[src % 2], out=buf)
        if src + 2 < n:
            reqs[src + 2] = comm.Irecv(byte_view(slots[src % 2]), src + 2, TAG_NAIVE)
    if divide is not None:
        xp.true_divide(buf, divide, out=buf)
    if sync is not None:
        sync()
    link.waitall([comm.Isend(msg, dst, TAG_NAIVE) for dst in range(1, n)], _OP, None)
