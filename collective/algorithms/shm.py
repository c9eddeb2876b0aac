"""All-reduce through shared memory, for the ranks of one node.

Point-to-point messages within a node cost a handshake each (from MPICH's
default 8 KiB on, the sender announces its buffer, the receiver copies it
with process_vm_readv (CMA) and acknowledges), and every step of an
algorithm is a wait in Python; with more ranks than cores each wait is also
a hand-over of a core. MPI-3 shared memory (MPI_Win_allocate_shared) lets
every rank read every other rank's copy directly, so an all-reduce needs
only barriers between its phases, as in MPICH's own intra-node collectives
(the ch4 POSIX "release_gather" algorithms). The two algorithms are the
"one-shot" and "two-shot" all-reduce of NVIDIA TensorRT-LLM's custom
all-reduce, on host memory:

    one-shot   copy in; barrier; every rank adds all N copies in rank order,
               ((x0 + x1) + x2) + ..., straight into its buffer
               1 barrier, (N - 1) L added per rank
    two-shot   copy in (all but our own segment); barrier; rank r adds
               every copy of segment r (ring.segment_bounds) into its own
               shared copy; barrier; every rank copies the N summed
               segments out
               2 barriers, (N - 1)/N L added per rank

Both give every rank the same bits (one order of additions, or one rank per
segment). Each rank owns two halves of its shared segment and alternates
between them call by call: one-shot's adds read the other ranks' half A
after the barrier, while a faster rank may already be in the next call,
which writes half B; the call after that writes A again only after its
own barrier, which every rank passes only when done with the call before.
(Two-shot needs no more: nobody reads a rank's copy-in region after the
second barrier.)

Memory ordering follows the MPI standard's recipe for shared windows under
a passive-target epoch: MPI_Win_sync, barrier, MPI_Win_sync. The barrier
is MPI_Ibarrier completed under our wait policy and stall watch
(collective/transport/waits.py). The window grows (collectively: every rank passes
the same size, checked by collective/transport/agree.py) to the largest buffer seen,
so it costs 2 L of shared memory per rank for the largest L it served;
collective/algorithms/choose.py sends it mid-size buffers only. Freeing a window is
collective, so it is never left to the garbage collector (which runs at
different moments on different ranks): Communicator.free() frees it, else
MPI_Finalize does.

A job that aborts cannot free a window (that is collective). MPICH unlinks
a window's file as soon as every rank has mapped it; what an aborted job
leaves in /dev/shm is MPICH's own node segment (mpich_shm_*, about 2 MB),
removed only by MPI_Finalize. So the abort path (collective/transport/failure.py)
unlinks the segments this process maps (`unlink_node_segments`): every rank
of the node has mapped it since MPI_Init, so the mappings live on until the
processes end, and nothing is left behind.
"""

from __future__ import annotations

import os

import numpy as np
from mpi4py import MPI

from dtlab.collective.algorithms.ring import segment_bounds
from dtlab.collective.transport.failure import before_abort
from dtlab.collective.transport.link import Link

_OP = "allreduce(shared memory)"
_SEGMENTS = "/dev/shm/mpich_shm_"


def unlink_node_segments() -> dict:
    """Unlink the MPICH node segments this process maps (their mappings stay valid)."""
    gone = []
    with open("/proc/self/maps") as maps:
        paths = {line.split(None, 5)[-1].strip() for line in maps if _SEGMENTS in line}
    for path in sorted(p for p in paths if not p.endswith("(deleted)")):
        try:
            os.unlink(path)
            gone.append(path)
        except FileNotFoundError:  # a peer of this node unlinked it first
            pass
    return {"shm_unlinked": gone}


before_abort(unlink_node_segments)


class SharedArena:
    """Two halves of shared memory per rank, visible to every rank of the node."""

    def __init__(self, link: Link):
        self.link, self.comm, self.rank, self.n = link, link.comm, link.rank, link.size
        self.win: MPI.Win | None = None
        self.half_bytes = 0
        self.parity = 0
        self._views: dict[tuple, list] = {}

    @staticmethod
    def usable(comm: MPI.Comm) -> bool:
        """Whether all ranks of `comm` share one node's memory (collective)."""
        node = comm.Split_type(MPI.COMM_TYPE_SHARED)
        together = node.Get_size() == comm.Get_size()
        node.Free()
        return comm.allreduce(together, op=MPI.LAND)

    def _grow(self, nbytes: int) -> None:
        if self.win is not None:
            self.barrier()  # nobody reads the old window any more
        self.free()
        self.half_bytes = max(nbytes, 2 * self.half_bytes, 64 << 10)
        self.win = MPI.Win.Allocate_shared(2 * self.half_bytes, 1, comm=self.comm)
        self.win.Lock_all()
        self._mem = [np.frombuffer(self.win.Shared_query(q)[0], np.uint8)  # (2 H,)
                     for q in range(self.n)]

    def views(self, buf) -> list:
        """This call's half of every rank's segment, as arrays like `buf` (L,) each."""
        if buf.nbytes > self.half_bytes:
            self._grow(buf.nbytes)
        key = (self.parity, buf.size, buf.dtype)
        self.parity ^= 1
        got = self._views.get(key)
        if got is None:
            at = key[0] * self.half_bytes
            got = [m[at : at + buf.nbytes].view(buf.dtype) for m in self._mem]
            if len(self._views) >= 16:
                self._views.clear()
            self._views[key] = got
        return got

    def barrier(self) -> None:
        """Every rank's stores so far are visible to every rank (MPI-3 shared memory)."""
        self.win.Sync()
        self.link.wait(self.comm.Ibarrier(), _OP, 1 - self.rank if self.n == 2 else None)
        self.win.Sync()

    def free(self) -> None:
        """Release the window (collective)."""
        if self.win is not None and not MPI.Is_finalized():
            self.win.Unlock_all()
            self.win.Free()
        self.win, self._mem, self._views = None, [], {}


def shm_one_shot(arena: SharedArena, buf, *, divide: int | None) -> None:
    """Sum (or average, divide=N) `buf` (L,) in place: copy in, barrier, add all."""
    views = arena.views(buf)  # N x (L,)
    np.copyto(views[arena.rank], buf)
    arena.barrier()
    np.add(views[0], views[1], out=buf)
    for v in views[2:]:
        np.add(buf, v, out=buf)
    if divide is not None:
        np.true_divide(buf, divide, out=buf)


def shm_two_shot(arena: SharedArena, buf, *, divide: int | None) -> None:
    """Sum (or average, divide=N) `buf` (L,) in place: segment r summed by rank r."""
    views = arena.views(buf)  # N x (L,)
    r, n = arena.rank, arena.n
    b = segment_bounds(buf.size, n)
    lo, hi = b[r], b[r + 1]
    mine = views[r]
    np.copyto(mine[:lo], buf[:lo])  # our own segment is read by us only
    np.copyto(mine[hi:], buf[hi:])
    arena.barrier()
    total = mine[lo:hi]  # (segment,)
    others = [v[lo:hi] for q, v in enumerate(views) if q != r]
    np.add(buf[lo:hi], others[0], out=total)
    for v in others[1:]:
        np.add(total, v, out=total)
    if divide is not None:
        np.true_divide(total, divide, out=total)
    arena.barrier()
    for q in range(n):
        np.copyto(buf[b[q] : b[q + 1]], views[q][b[q] : b[q + 1]])
