"""How our algorithms wait for their messages: block in MPI, or poll and yield.

MPI_Wait spins in the progress engine (MPICH yields the core only every
MPIR_CVAR_POLLS_BEFORE_YIELD = 1000 polls). When a node runs more ranks than
it has cores, the rank we wait for may be queued behind us on our own core,
so every wait then polls once (MPI_Test) and yields the core (sched_yield)
in a loop, handing the core to that rank at once. With a core per rank the
plain blocking wait is kept. `resolve_yield` decides: True / False, or None
for DTLAB_YIELD_WAITS=1/0, else automatic (ranks on this node, from
MPI_LOCALNRANKS or OMPI_COMM_WORLD_LOCAL_SIZE, above the cores).

Every wait runs under the communicator's stall watch (collective/transport/failure.py):
it says what it waits for, and whom, before it blocks.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from mpi4py import MPI

from dtlab.collective.transport.failure import Watch

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


class Waiter:
    """Completes requests under one stall watch, blocking or yielding."""

    def __init__(self, watch: Watch, yield_waits: bool):
        self.watch, self.yield_waits = watch, yield_waits

    def wait(self, req: MPI.Request, operation: str, peer: int | None, status=None) -> None:
        """Complete `req`; peer: the rank it waits for."""
        self.watch.waiting(operation, peer)
        try:
            if self.yield_waits:
                while not req.Test(status):
                    os.sched_yield()
            else:
                req.Wait(status)
        finally:
            self.watch.idle()

    def waits_for(self, operation: str, peer: int | None) -> Callable[[MPI.Request], None]:
        """`wait(req, operation, peer)` as a one-argument function with the layers of
        calls taken out (the stall watch's state set in place): for a loop that waits
        for many messages of one operation and peer, the ring's, where each layer costs
        a fraction of a microsecond per message (on 2 cores shared by 4 ranks every
        rank's Python shares a core with another rank's)."""
        return self._waiting(MPI.Request.Test, MPI.Request.Wait, operation, peer)

    def waitall_for(self, operation: str, peer: int | None) -> Callable[[list], None]:
        """`waitall(reqs, operation, peer)` as a one-argument function, as `waits_for`."""
        return self._waiting(MPI.Request.Testall, MPI.Request.Waitall, operation, peer)

    def _waiting(self, test, block, operation: str, peer: int | None) -> Callable:
        """A one-argument wait for a request or a list of them: `test` polled, the core
        yielded between polls, where waits yield; else `block`."""
        watch, timeout, monotonic = self.watch, self.watch.timeout, time.monotonic
        if self.yield_waits:
            yield_core = os.sched_yield

            def wait_yielding(reqs) -> None:
                if test(reqs):
                    return
                if timeout:
                    watch.state = (monotonic() + timeout, operation, peer)
                try:
                    while not test(reqs):
                        yield_core()
                finally:
                    watch.state = None

            return wait_yielding

        def wait(reqs) -> None:
            if timeout:
                watch.state = (monotonic() + timeout, operation, peer)
            try:
                block(reqs)
            finally:
                watch.state = None

        return wait

    def waitall(self, reqs: list, operation: str, peer: int | None) -> None:
        """Complete all of `reqs` (peer None: several ranks)."""
        self.watch.waiting(operation, peer)
        if self.yield_waits:
            while not MPI.Request.Testall(reqs):
                os.sched_yield()
        else:
            MPI.Request.Waitall(reqs)
        self.watch.idle()
