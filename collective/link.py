"""Per-communicator state shared by every algorithm: the MPI communicator,
the ring order, scratch memory, the stall watch and the way to wait.

Scratch memory lives here, one pool per communicator, and not per call:
allocating a receive buffer per call would page-fault it in on first touch
every time (what slows MPICH's own Allreduce on 32 MB+ buffers on the 2-core
development machine), while a pool that only grows costs nothing after the
first call. One pool per communicator is safe without locks because MPI
requires collectives on one communicator to be issued one at a time; a
second thread (the bucket reducer) works on a duplicated communicator with
a pool of its own.

Waiting. MPI_Wait spins in the progress engine (MPICH yields the core only
every 1000 polls). When a node runs more ranks than it has cores, the rank
we wait for may be queued behind us on our own core, so every wait of our
algorithms then polls once (MPI_Test) and yields the core (sched_yield) in a
loop: 5-10% faster all-reduce at 4 ranks on 2 cores, measured A/B. With a
core per rank the plain blocking wait is kept. `yield_waits` decides:
True / False, or None for DTLAB_YIELD_WAITS=1/0, else automatic (ranks on
this node, MPI_LOCALNRANKS or OMPI_COMM_WORLD_LOCAL_SIZE, above the cores).
"""

from __future__ import annotations

import os
import weakref

import numpy as np
from mpi4py import MPI

from dtlab.collective.failure import Watch

# Receive buffers in scratch memory start at the same offset within a page as
# the memory the peer sends from (see mirror()).
PAGE = 4096

# Tags of our own algorithms, above the small tags user send/recv use, so a
# user message can never match a collective's receive on the same communicator.
TAG_RING = 32001
TAG_NAIVE = 32002
TAG_BCAST = 32003
TAG_ALLTOALL = 32004
TAG_DOUBLING = 32005


class Workspace:
    """Reusable byte buffers, keyed by purpose and array module; they only grow."""

    def __init__(self):
        self._bufs: dict[tuple[str, str], object] = {}
        self._last: dict[str, tuple] = {}

    def get(self, key: str, nbytes: int, xp=np):
        """A uint8 buffer of exactly `nbytes` (a view of a pooled one)."""
        slot = (key, xp.__name__)
        buf = self._bufs.get(slot)
        if buf is None or buf.nbytes < nbytes:
            buf = xp.empty(max(nbytes, 1), dtype=np.uint8)
            self._bufs[slot] = buf
        return buf[:nbytes]

    def pages(self, key: str, nbytes: int, xp=np):
        """A pooled uint8 buffer of `nbytes` that starts on a page boundary,
        to cut receive buffers from with `mirror()`."""
        raw = self.get(key, nbytes + PAGE - 1, xp)
        skip = (-address(raw)) % PAGE
        return raw[skip : skip + nbytes]

    def typed(self, key: str, count: int, dtype, xp=np):
        """A pooled 1-D array of `count` elements of `dtype`.

        The last view per key is remembered: a training loop asks for the same
        shapes over and over, and this is on the small-message critical path.
        """
        last = self._last.get(key)
        if last is not None and last[0] == count and last[1] == dtype and last[2] is xp:
            return last[3]
        dtype = np.dtype(dtype)
        view = self.get(key, count * dtype.itemsize, xp).view(dtype)
        self._last[key] = (count, dtype, xp, view)
        return view

    def mirrored(self, key: str, like, xp=np):
        """A pooled 1-D array with the size and dtype of `like`, starting at the same
        offset within a page (mirror()); remembered like typed(), for the same reason."""
        shape = (like.size, like.dtype, xp, address(like) % PAGE)
        last = self._last.get(key)
        if last is not None and last[0] == shape:
            return last[1]
        pages = self.pages(key, like.nbytes + PAGE, xp)
        view = mirror(pages, 0, shape[3], like.nbytes).view(like.dtype)
        self._last[key] = (shape, view)
        return view


YIELD_ENV = "DTLAB_YIELD_WAITS"
_LOCAL_SIZE_VARS = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE")


def resolve_yield(yield_waits: bool | None) -> bool:
    """Whether waits poll-and-yield (see the module docstring)."""
    if yield_waits is not None:
        return bool(yield_waits)
    forced = os.environ.get(YIELD_ENV, "")
    if forced in ("0", "1"):
        return forced == "1"
    if forced:
        raise ValueError(f"{YIELD_ENV} must be 0 or 1, not {forced!r}")
    for var in _LOCAL_SIZE_VARS:
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var]) > (os.cpu_count() or 1)
    return False


class Link:
    """An MPI communicator plus what the algorithms keep between calls."""

    def __init__(self, comm: MPI.Comm, label: str, timeout: float, yield_waits: bool = False):
        self.comm = comm
        self.label = label
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self._ring: tuple[list[int], int] | None = None
        group, world_group = comm.Get_group(), MPI.COMM_WORLD.Get_group()
        self.world_ranks = list(group.Translate_ranks(None, world_group))
        group.Free()
        world_group.Free()
        self.yield_waits = yield_waits
        self.ws = Workspace()
        self.plans: dict[tuple, object] = {}  # per-shape message schedules (ring.py)
        self.bound: dict[tuple, object] = {}  # schedules bound to buffers (ring.py)
        self.bound_limit = 4
        self.watch = Watch(label, timeout, self.world_ranks)
        # Persistent requests must be freed before MPI_Finalize (MPICH lists
        # leftovers on stderr): when this Link is collected, or at exit (the
        # finalizer's exit hook is registered after mpi4py's, so runs first).
        self.release = weakref.finalize(self, _free_bound, self.bound)

    def ring(self) -> tuple[list[int], int]:
        """(ring order of the ranks, this rank's position in it); collective on first use.

        Ranks on the same node are adjacent (nodes in order of their lowest
        rank), and within a node ranks bound to one CPU each are ordered by
        that CPU, so ring neighbours share a core or cache where the launcher
        packed them (`mpiexec -bind-to core`); unbound ranks keep rank order.
        """
        if self._ring is None:
            affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
            cpu = min(affinity) if len(affinity) == 1 else -1
            keys = self.comm.allgather((MPI.Get_processor_name(), cpu))
            first_rank = {}
            for r, (node, _) in enumerate(keys):
                first_rank.setdefault(node, r)
            order = sorted(range(self.size),
                           key=lambda r: (first_rank[keys[r][0]], keys[r][1], r))
            self._ring = order, order.index(self.rank)
        return self._ring

    def left(self) -> int:
        """The rank we receive from in the ring."""
        order, p = self.ring()
        return order[(p - 1) % self.size]

    def right(self) -> int:
        """The rank we send to in the ring."""
        order, p = self.ring()
        return order[(p + 1) % self.size]

    def wait(self, req: MPI.Request, operation: str, peer: int | None, status=None) -> None:
        """Complete `req` under the stall watch; peer: whom it waits for."""
        self.watch.waiting(operation, peer)
        try:
            if self.yield_waits:
                while not req.Test(status):
                    os.sched_yield()
            else:
                req.Wait(status)
        finally:
            self.watch.idle()

    def waitall(self, reqs: list, operation: str, peer: int | None) -> None:
        """Complete all of `reqs` under the stall watch (peer None: several)."""
        self.watch.waiting(operation, peer)
        if self.yield_waits:
            while not MPI.Request.Testall(reqs):
                os.sched_yield()
        else:
            MPI.Request.Waitall(reqs)
        self.watch.idle()


def _free_bound(bound: dict) -> None:
    """Free the persistent requests of every bound ring schedule in `bound`."""
    while bound and not MPI.Is_finalized():
        bound.popitem()[1].free()


def address(a) -> int:
    """Address of the first byte of a contiguous host or device array."""
    if isinstance(a, np.ndarray):
        return MPI.buffer(a).address
    return a.__cuda_array_interface__["data"][0]


def mirror(pages, start: int, like: int, nbytes: int):
    """`nbytes` of `pages` (uint8, page-aligned) from the first byte at or after
    `start` (a multiple of PAGE) whose offset within a page is that of the
    address `like`; the caller reserves PAGE bytes of slack per view.

    Within a node MPICH moves large messages by CMA: the receiver's kernel
    copies with `rep movsb`, which on the development machine (AMD Zen 4)
    runs 5-8x slower when the destination lies 8-24 bytes past the source
    modulo 4 KiB (a 4 MB Recv: 1.7-2.5 ms instead of 0.3-0.4 ms; every other
    offset measured, 0..4096 in steps of 8, was fast). Scratch memory that
    glibc hands out right after the user's buffer sits exactly 16 bytes past
    it, so the ring's receives into scratch hit that case on whichever ranks
    had laid out their heap alike: the ring ran at 0.5-0.7x MPI's speed at
    2-16 MB in some launches and not others. A receive buffer that mirrors
    the page offset of our own buffer makes the copy as fast as the copy
    between the two user buffers (same offsets on all ranks when every rank
    allocates alike, which the gather steps rely on anyway).
    """
    at = start + like % PAGE
    return pages[at : at + nbytes]


def byte_view(a):
    """`a` (contiguous, any dtype) as an MPI message of raw bytes.

    Our algorithms move bytes and do arithmetic themselves, so every dtype
    (float16, bfloat16-as-uint16, ints) travels the same way.
    """
    return [a, MPI.BYTE]
