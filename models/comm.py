"""The communicator models are handed: the operations a model may call.

    def forward(self, P, x):
        y = x @ P["W"]
        self.comm.allreduce(y)        # in place: the sum over the group's ranks

Models never create communicators nor compute ranks; a launcher (collective/
grid.py) builds one per parallel dimension and hands it to the model's
constructor. `dtlab.collective.comm.Communicator` satisfies this protocol
(tests/models/test_tensor_parallel.py checks it member by member), and a world of
size 1 is a real communicator whose operations are identities, so a model
split over one rank runs the same code as its split over many.

Semantics: arrays are C-contiguous NumPy or CuPy arrays; reductions are sums;
results land in place (allreduce, broadcast, recv) or in `out`, and every
method returns its result array. Every rank of the group calls a collective
with the same shapes, in the same order.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class Comm(Protocol):
    """A group of `size` ranks, this process being `rank` (0 <= rank < size)."""

    rank: int
    size: int

    def allreduce(self, x, *, average: bool = False, algo: str | None = None):
        """Sum `x` over the ranks in place (divided by size if `average`); return x."""
        ...

    def allgather(self, x, out=None, counts: list[int] | None = None):
        """Every rank's `x` concatenated along axis 0 in rank order; return out."""
        ...

    def reduce_scatter(self, x, *, average: bool = False):
        """Sum `x` over the ranks; return this rank's rows of the sum."""
        ...

    def alltoallv(self, x, send_counts, out=None, recv_counts=None):
        """Rows of `x` to every rank, grouped by destination; return (out, recv_counts)."""
        ...

    def broadcast(self, x, root: int = 0):
        """Rank `root`'s `x` into `x` on every rank; return x."""
        ...

    def send(self, x, dest: int, tag: int = 0) -> None:
        """Send `x` to rank `dest`."""
        ...

    def isend(self, x, dest: int, tag: int = 0):
        """Start sending `x` to rank `dest`; return a request whose wait() returns once
        `x` may be reused (pipeline stages keep several sends in flight)."""
        ...

    def recv(self, x, source: int, tag: int = 0):
        """Receive into `x` from rank `source`; return x."""
        ...

    def sendrecv(self, x, dest: int, out, source: int, tag: int = 0):
        """Send `x` to `dest` while receiving `out` from `source`; return out."""
        ...
