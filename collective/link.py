"""Per-communicator state shared by every algorithm, and the messages they send.

A `Link` ties together what the algorithms keep between calls, each kept in
its own module:

    scratch.py    Workspace: the scratch pool (receive buffers that only grow)
    pages.py      receive buffers at the sender's offset within a page
    order.py      the ring order of the ranks (node, then CPU)
    waits.py      how to wait: block in MPI, or poll and yield when oversubscribed
    bindings.py   plans per shape and persistent requests per buffer
    failure.py    the stall watch every wait runs under

Messages are raw bytes (`byte_view`): our algorithms do the arithmetic
themselves, so every dtype (float16, bfloat16-as-uint16, ints) travels the
same way. Their tags sit above the small tags user send/recv use, so a user
message can never match a collective's receive on the same communicator.
"""

from __future__ import annotations

import weakref

from mpi4py import MPI

from dtlab.collective.bindings import RequestCache
from dtlab.collective.failure import Watch
from dtlab.collective.order import ring_order
from dtlab.collective.scratch import Workspace
from dtlab.collective.waits import Waiter

TAG_RING = 32001
TAG_NAIVE = 32002
TAG_BCAST = 32003
TAG_ALLTOALL = 32004
TAG_STEPS = 32005


def byte_view(a):
    """`a` (contiguous, any dtype) as an MPI message of raw bytes."""
    return [a, MPI.BYTE]


class Link:
    """An MPI communicator plus what the algorithms keep between calls."""

    def __init__(self, comm: MPI.Comm, label: str, timeout: float, yield_waits: bool = False,
                 persistent_buffers: int = 4):
        self.comm = comm
        self.label = label
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        group, world_group = comm.Get_group(), MPI.COMM_WORLD.Get_group()
        self.world_ranks = list(group.Translate_ranks(None, world_group))
        group.Free()
        world_group.Free()
        self.ws = Workspace()
        self.watch = Watch(label, timeout, self.world_ranks)
        waiter = Waiter(self.watch, yield_waits)
        self.wait, self.waitall = waiter.wait, waiter.waitall
        self.cache = RequestCache(persistent_buffers)
        self.release = weakref.finalize(self, self.cache.free_all)
        self._ring: tuple[list[int], int] | None = None

    def ring(self) -> tuple[list[int], int]:
        """(ring order of the ranks, this rank's position in it); collective on first use."""
        if self._ring is None:
            self._ring = ring_order(self.comm)
        return self._ring

    def left(self) -> int:
        """The rank we receive from in the ring."""
        order, p = self.ring()
        return order[(p - 1) % self.size]

    def right(self) -> int:
        """The rank we send to in the ring."""
        order, p = self.ring()
        return order[(p + 1) % self.size]
