"""Collectives as a fixed list of exchange steps, bound to a buffer once.

Recursive doubling, halving-doubling and the fold that makes a world a
power of two are, on each rank, a short list of steps:

    post the step's receives, then its sends; wait for all of them;
    then run the step's adds, in order: out = a + b.

A `Step` says that with element ranges of the buffer and numbered scratch
slots. doubling.py and halving.py compute the list once per (length, world,
rank); `Bound` turns it into persistent requests and array
views on one buffer (collective/transport/bindings.py), so that running a step from
Python is one Startall, one Waitall and one `xp.add` per add. A message
whose range is empty is skipped: the peer's matching message has the same
range, so both sides skip alike.

Scratch: slot k is a page-aligned region of the communicator's pool; a
receive into a slot lands at the page offset of the buffer range it stands
for (collective/transport/pages.py). Steps run one after the other, so slots are
reused from step to step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mpi4py import MPI

from dtlab.collective.transport.bindings import free_requests
from dtlab.collective.transport.link import TAG_STEPS, Link, byte_view
from dtlab.collective.transport.pages import PAGE, address, mirror

BUF = -1  # slot number of the buffer itself


@dataclass(frozen=True)
class Part:
    """Elements [lo, hi) of the buffer, held in the buffer (slot BUF) or in scratch slot k."""

    lo: int
    hi: int
    slot: int = BUF


@dataclass(frozen=True)
class Step:
    """recvs: (peer, where it lands); sends: (peer, part of the buffer sent);
    adds: (out, a, b), out = a + b after the messages; divide: the part to
    divide by N afterwards when averaging."""

    recvs: tuple[tuple[int, Part], ...] = ()
    sends: tuple[tuple[int, Part], ...] = ()
    adds: tuple[tuple[Part, Part, Part], ...] = ()
    divide: Part | None = None

    def peer(self) -> int | None:
        """The one rank this step waits for, or None for several (stall reports)."""
        peers = {p for p, _ in self.recvs + self.sends}
        return peers.pop() if len(peers) == 1 else None


def exchange(peer: int, recv: Part, send: Part, add: bool) -> Step:
    """Receive `recv` from `peer` while sending it `send`; add: receive into slot 0
    and add it into the buffer."""
    if not add:
        return Step(recvs=((peer, recv),), sends=((peer, send),))
    got = Part(recv.lo, recv.hi, 0)
    mine = Part(recv.lo, recv.hi)
    return Step(recvs=((peer, got),), sends=((peer, send),), adds=((mine, mine, got),))


class Bound:
    """A list of steps bound to one buffer: persistent requests and views.

    steps[i] = (requests, peer, [(out, a, b) views], view to divide or None)
    """

    def __init__(self, link: Link, plan: list[Step], buf, xp, operation: str):
        comm, item, base = link.comm, buf.itemsize, address(buf)
        parts = [p for s in plan for _, p in s.recvs] + [p for s in plan for a in s.adds for p in a]
        slots = 1 + max((p.slot for p in parts), default=BUF)
        stride = -(-max((p.hi - p.lo for p in parts), default=0) * item // PAGE) * PAGE + PAGE
        scratch = link.ws.pages("steps", slots * stride, xp) if slots else None

        def view(p: Part):
            if p.slot == BUF:
                return buf[p.lo : p.hi]  # (hi - lo,)
            at = mirror(scratch, p.slot * stride, base + p.lo * item, (p.hi - p.lo) * item)
            return at.view(buf.dtype)  # (hi - lo,)

        self.steps = []
        for s in plan:
            reqs = [comm.Recv_init(byte_view(view(p)), peer, TAG_STEPS)
                    for peer, p in s.recvs if p.hi > p.lo]
            reqs += [comm.Send_init(byte_view(view(p)), peer, TAG_STEPS)
                     for peer, p in s.sends if p.hi > p.lo]
            adds = [tuple(view(p) for p in add) for add in s.adds if add[0].hi > add[0].lo]
            div = view(s.divide) if s.divide is not None else None
            self.steps.append((reqs, s.peer(), adds, div))
        self.buf, self.waitall, self.operation = buf, link.waitall, operation

    def run(self, xp, sync, divide: int | None) -> None:
        """Run the steps: the collective on the bound buffer, in place.
        sync: called before MPI reads device memory; divide: N when averaging."""
        startall, waitall, add, operation = MPI.Prequest.Startall, self.waitall, xp.add, \
            self.operation
        for reqs, peer, adds, div in self.steps:
            if reqs:
                if sync is not None:
                    sync()
                startall(reqs)
                waitall(reqs, operation, peer)
            for out, a, b in adds:  # (chunk,) each
                add(a, b, out=out)
            if div is not None and divide is not None:
                xp.true_divide(div, divide, out=div)

    def free(self) -> None:
        free_requests([r for reqs, _, _, _ in self.steps for r in reqs])


def bind(link: Link, key: tuple, make_plan: Callable[[], list[Step]], buf, xp,
         operation: str) -> Bound:
    """The plan cached under `key` (else made by make_plan()) bound to `buf` (L,)."""
    cache = link.cache
    return cache.bound(key, buf,
                       lambda: Bound(link, cache.plan(key, make_plan), buf, xp, operation))
