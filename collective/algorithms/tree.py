"""Binomial-tree broadcast.

Thakur, Rabenseifner & Gropp (IJHPCA 2005), section 3: with ranks renumbered
so the root is 0, in round k every rank that already has the data sends it
to the rank 2^k above it, so the data reaches all N ranks in ceil(log2 N)
rounds:

    N = 6, root 0     round 0: 0->1     round 1: 0->2, 1->3     round 2: 0->4, 1->5

Each rank receives once (from the rank that differs in its lowest set bit)
and then sends to its children, largest subtree first. It moves the whole
buffer log2 N times along the critical path, which suits what dtlab
broadcasts (initial parameters, configuration, seeds) at these world sizes;
for very large buffers on large worlds a pipelined chain or
scatter + all-gather (MPICH's choice above 12 KB) would be bandwidth-optimal.
"""

from __future__ import annotations

from dtlab.collective.transport.link import TAG_BCAST, Link, byte_view

_OP = "broadcast(tree)"


def tree_broadcast(link: Link, buf, root: int, *, sync) -> None:
    """Copy `buf` of rank `root` into `buf` of every rank, in place."""
    comm, n = link.comm, link.size
    vr = (link.rank - root) % n
    msg = byte_view(buf)
    mask = 1
    while mask < n:
        if vr & mask:
            parent = (vr - mask + root) % n
            link.wait(comm.Irecv(msg, parent, TAG_BCAST), _OP, parent)
            break
        mask <<= 1
    if sync is not None:
        sync()
    sends = []
    mask >>= 1
    while mask > 0:
        if vr + mask < n:
            sends.append(comm.Isend(msg, (vr + mask + root) % n, TAG_BCAST))
        mask >>= 1
    link.waitall(sends, _OP, None)
