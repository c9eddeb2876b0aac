"""All-to-all(v) by pairwise exchange.

Thakur, Rabenseifner & Gropp (IJHPCA 2005), section 5: in step k = 1..N-1
rank r sends its block for rank (r + k) mod N and receives the block from
rank (r - k) mod N, so every step is a perfect matching and no rank is
flooded by N - 1 senders at once; step 0 is the local copy. Blocks may have
any size, including zero (expert-parallel token routing is uneven).
"""

from __future__ import annotations

from dtlab.collective.transport.link import TAG_ALLTOALL, Link, byte_view

_OP = "alltoallv(pairwise)"


def pairwise_alltoallv(
    link: Link, send, send_bounds: list[int], recv, recv_bounds: list[int], *, xp, sync
) -> None:
    """recv[recv_bounds[s]:recv_bounds[s+1]] <- rank s's send[send_bounds[r]:send_bounds[r+1]].

    send, recv: 1-D arrays of one dtype; bounds: N + 1 element offsets.
    """
    comm, n, r = link.comm, link.size, link.rank
    recv[recv_bounds[r] : recv_bounds[r + 1]] = send[send_bounds[r] : send_bounds[r + 1]]
    if sync is not None:
        sync()
    for k in range(1, n):
        dst, src = (r + k) % n, (r - k) % n
        into = recv[recv_bounds[src] : recv_bounds[src + 1]]
        reqs = [
            comm.Irecv(byte_view(into), src, TAG_ALLTOALL),
            comm.Isend(byte_view(send[send_bounds[dst] : send_bounds[dst + 1]]), dst, TAG_ALLTOALL),
        ]
        link.waitall(reqs, _OP, src)
