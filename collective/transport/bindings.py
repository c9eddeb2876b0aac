"""Plans and persistent requests, cached per communicator.

An algorithm first computes a plan for a shape (which element ranges go to
and come from which rank at each step: pure arithmetic on the length, the
dtype and the world), then binds the plan to one buffer: persistent requests
(MPI_Recv_init / MPI_Send_init) on views of that buffer and of scratch
memory. A training loop all-reduces the same memory every step (the
gradient buckets), so each message then costs one Start and one Wait
instead of building a request, a message spec and two views.

A binding keeps its buffer alive, so the address it is keyed by cannot be
reused by other memory while it is cached, and the last buffer bound can be
recognised by identity alone (`buf is last`): the same array object passed
again skips the lookup by address, which matters at a few KB where a whole
all-reduce takes a few microseconds. At most `limit` bindings are
kept (least recently used are freed first), which bounds the memory they
pin. `turn` counts calls by name, for an algorithm that alternates between
bindings (the ring at two ranks, collective/algorithms/ring.py): every rank
makes the same calls in the same order, so the counts agree on all ranks,
whatever each rank's cache kept. Persistent requests must be freed before
MPI_Finalize (MPICH lists leftovers on stderr): `free_all` runs when the
communicator's Link is collected, or at exit (the finalizer's exit hook is
registered after mpi4py's, so runs first).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import Protocol

from mpi4py import MPI

from dtlab.collective.transport.pages import address

PLAN_LIMIT = 64


class Binding(Protocol):
    def free(self) -> None: ...


def free_requests(reqs) -> None:
    """Free persistent requests (not while MPI is finalized)."""
    if not MPI.Is_finalized():
        for req in reqs:
            req.Free()


class RequestCache:
    """Plans by shape (at most PLAN_LIMIT) and bindings by buffer (at most `limit`)."""

    def __init__(self, limit: int):
        self.limit = limit
        self._plans: dict[Hashable, object] = {}
        self._bound: dict[Hashable, Binding] = {}
        self._last: tuple | None = None  # (buffer, key, binding) of the last call
        self.evictions = 0  # bindings freed so far: a runner kept elsewhere checks it
        self._turns: dict[str, int] = {}

    def turn(self, name: str, turns: int) -> int:
        """This call's turn, 0 .. turns - 1: the calls named `name` so far, modulo `turns`."""
        count = self._turns.get(name, 0)
        self._turns[name] = count + 1
        return count % turns

    def plan(self, key: Hashable, make: Callable[[], object]):
        plan = self._plans.get(key)
        if plan is None:
            if len(self._plans) >= PLAN_LIMIT:
                self._plans.clear()
            plan = self._plans[key] = make()
        return plan

    def bound(self, key: Hashable, buf, make: Callable[[], Binding]):
        """The binding of the plan `key` to `buf`: cached, else make().

        Fast path: `buf` is the very array object of the last call with this key.
        Otherwise bindings are found by (key, array type, address).
        """
        last = self._last
        if last is not None and last[0] is buf and last[1] == key:
            return last[2]
        slot = (key, type(buf), address(buf))
        bound = self._bound.pop(slot, None)
        if bound is None:
            if len(self._bound) >= self.limit:
                self._bound.pop(next(iter(self._bound))).free()
                self.evictions += 1
            bound = make()
        self._bound[slot] = bound  # most recently used last
        self._last = (buf, key, bound)
        return bound

    def free_all(self) -> None:
        self._last = None
        self.evictions += 1
        while self._bound and not MPI.Is_finalized():
            self._bound.popitem()[1].free()
