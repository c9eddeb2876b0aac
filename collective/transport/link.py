"""Per-communicator state shared by every algorithm, and the messages they send.

A `Link` ties together what the algorithms keep between calls, each kept in
its own module:

    scratch.py    Workspace: the scratch pool (receive buffers that only grow)
    pages.py      receive buffers at the sender's offset within a page
    order.py      the ring order of the ranks (node, then CPU)
    waits.py      how to wait: block in MPI, or poll and yield when oversubscribed
    bindings.py   plans per shape and persistent requests per buffer
    failure.py    the stall watch every wait runs under
    stamps.py     timestamps of the ring's calls, off unless a bench sets them

Messages are raw bytes (`byte_view`): our algorithms do the arithmetic
themselves, so every dtype (float16, bfloat16 from ml_dtypes, ints) travels
the same way. Only the transport is untyped: every addition runs on arrays
viewed as the buffer's own dtype, with that dtype's NumPy (or CuPy) `add`,
never on the bit patterns. For float16 and bfloat16 that add computes in
float32 and rounds the sum to the dtype (round to nearest even), so a
partial sum is rounded once per hop, as NCCL does; a sum over N ranks has
gone through at most N - 1 such roundings on any path (the depth of any
summation tree of N values), which bounds its error by
gamma_{N-1} = (N - 1) u / (1 - (N - 1) u) times the sum of |x_r| (Higham,
"Accuracy and Stability of Numerical Algorithms", 2nd ed., section 4.2),
with unit roundoff u = 2^-8 for bfloat16 and 2^-11 for float16.
Their tags sit above the small tags user send/recv use, so a user
message can never match a collective's receive on the same communicator.

MPI's own Allreduce (`mpi_sum`) gets typed messages instead, and a sum
operation that follows the same rule for dtypes MPI has no type for.
"""

from __future__ import annotations

import weakref

import numpy as np
from mpi4py import MPI
from mpi4py.util.dtlib import from_numpy_dtype

from dtlab.collective.transport.bindings import RequestCache
from dtlab.collective.transport.failure import Watch
from dtlab.collective.transport.order import ring_order
from dtlab.collective.transport.scratch import Workspace
from dtlab.collective.transport.stamps import Stamps
from dtlab.collective.transport.waits import Waiter

TAG_RING = 32001
TAG_NAIVE = 32002
TAG_BCAST = 32003
TAG_ALLTOALL = 32004
TAG_STEPS = 32005


def byte_view(a):
    """`a` (contiguous, any dtype) as an MPI message of raw bytes."""
    return [a, MPI.BYTE]


_SUMS: dict[np.dtype, tuple[MPI.Datatype, MPI.Op]] = {}


def mpi_sum(buf):
    """(message, op): `buf` (L,) host, contiguous, as MPI_Allreduce's message and sum.

    A dtype MPI has a type for goes as it is with MPI_SUM (float16 is MPICH's
    MPIX_C_FLOAT16, whose sum is float arithmetic rounded once per operation).
    One it has none for (bfloat16, float8 from ml_dtypes) goes as elements of
    itemsize raw bytes (a contiguous datatype, so MPI cuts messages only
    between elements) with a user-defined commutative op (MPI_Op_create)
    that views the bytes as the dtype and adds them with its NumPy ufunc:
    float32 arithmetic rounded to the dtype once per hop, the rule of our
    algorithms, on the same bytes on the wire. The alternative, converting
    to float32 around a native MPI_SUM, rounds once but moves twice the
    bytes and needs a float32 copy of the buffer; the op keeps MPI a
    like-for-like baseline.
    """
    dtype = buf.dtype
    try:
        from_numpy_dtype(dtype)
        return buf, MPI.SUM
    except (ValueError, KeyError, TypeError):
        pass
    if not isinstance(buf, np.ndarray):
        raise TypeError(f"allreduce(mpi): {dtype} has no MPI type; its sum runs on host "
                        f"arrays only")
    made = _SUMS.get(dtype)
    if made is None:
        try:
            np.add(buf[:0], buf[:0])
        except TypeError:
            raise TypeError(f"allreduce(mpi): {dtype} has no MPI type and no NumPy add "
                            f"to reduce it with") from None

        def add(inbuf, inoutbuf, datatype) -> None:  # inout = in + inout, as MPI orders it
            acc = np.frombuffer(inoutbuf, dtype)  # (count,)
            np.add(acc, np.frombuffer(inbuf, dtype), out=acc)

        element = MPI.BYTE.Create_contiguous(dtype.itemsize).Commit()
        made = _SUMS[dtype] = (element, MPI.Op.Create(add, commute=True))
    element, op = made
    return [buf.view(np.uint8), buf.size, element], op


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
        self.waiter = waiter = Waiter(self.watch, yield_waits)
        self.wait, self.waitall = waiter.wait, waiter.waitall
        self.cache = RequestCache(persistent_buffers)
        self.release = weakref.finalize(self, self.cache.free_all)
        self._ring: tuple[list[int], int] | None = None
        self.stamps: Stamps | None = None  # set: the ring times each call (stamps.py)

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
