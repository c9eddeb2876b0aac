"""Consistency models of the parameter server: ASP, SSP(s), BSP.

Each worker has a clock: the clock it started at (0 for the first workers; the
slowest active worker's for one that joins late or comes back: Clocks.register,
answered in RegisterReply.clock) plus one per gradient this shard accepted
from it since. A pull is served when the worker's lead over the slowest active
worker is within the bound:

    ASP  (asynchronous, Dean et al. 2012 Downpour SGD)  no bound; every push applied at once
    SSP  (stale synchronous parallel, Ho et al. 2013)   clock[w] - min_v clock[v] <= s
    BSP  (bulk synchronous)                             bound 0, and the pushes of one clock
                                                         are averaged and applied once

so an SSP worker never computes on parameters that miss updates from more
than s clocks ago, and BSP reproduces synchronous data-parallel SGD: one
update per round from the mean of one gradient per worker, which equals the
gradient of the union of their batches.

BSP with b backup workers (--backup-workers b, --num-workers N + b; Chen et al.
2016, "Revisiting distributed synchronous SGD"): a round closes as soon as N
gradients have arrived (or every active worker's, when fewer are active) and
applies their mean. A gradient read at a version older than the shard's was
computed for a round that closed: it is late, dropped (counted per worker) and
answered, so its worker reads the new parameters and goes on; it never joins a
later round. The read rule is then "nothing of yours waits in the open round":
a worker whose gradient is in it waits for the round to close, any other reads,
so the slowest b hold nobody back. With b = 0 everything is as above.

The structures here hold no lock of their own: the shard store calls them
under its lock (the same lock as the update they describe).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from dtlab.pserver.common.buffers import ChunkedArray
from dtlab.pserver.common.errors import FailedPrecondition
from dtlab.pserver.common.ranges import merged, packed


@dataclass(frozen=True)
class Consistency:
    mode: str = "asp"
    staleness: int = 0  # SSP's bound s
    backups: int = 0  # BSP's backup workers b

    @property
    def bound(self) -> int | None:
        """The largest clock lead a reader may have, None for unbounded (ASP)."""
        return {"asp": None, "ssp": self.staleness, "bsp": 0}[self.mode]

    @property
    def aggregate(self) -> bool:
        return self.mode == "bsp"


@dataclass
class WorkerState:
    clock: int = 0  # the clock it started at (Clocks.register) + gradients accepted since
    next_step: int = 0  # the lowest step still accepted; lower ones are duplicates
    active: bool = True
    registration: int = 0  # the client process that holds the id (0: none known)
    live: int = 0  # that client's open sessions and calls in progress on this shard
    late: int = 0  # BSP with backup workers: gradients that came after their round closed
    left: bool = False  # it deregistered: its calls are refused until it registers again


class Clocks:
    """Per-worker clocks and the quorum of expected workers.

    `expected` (--num-workers) makes SSP and BSP wait until that many workers
    have registered, so the first rounds are not decided by whoever came first.
    A worker that joins late starts at the slowest active clock, and one that
    comes back (after Deregister, or dropped when its lease ran out: pserver.server.leases)
    is raised to it: a clock behind every active one would hold SSP readers back
    for clocks the others already ran, and under BSP its pushes could never
    complete a round together with theirs.
    """

    def __init__(self, expected: int = 0):
        self.expected = expected
        self.workers: dict[int, WorkerState] = {}

    def register(self, worker: int) -> WorkerState:
        state = self.workers.get(worker)
        if state is None:
            state = self.workers[worker] = WorkerState(clock=self.min_clock())
        elif not state.active:
            state.clock = max(state.clock, self.min_clock())
        state.active = True
        return state

    def new_id(self) -> int:
        """One past the highest id ever registered: a worker that never ran here."""
        return max(self.workers, default=-1) + 1

    def deregister(self, worker: int) -> None:
        if worker in self.workers:
            self.workers[worker].active = False

    def active(self) -> list[int]:
        return [w for w, s in self.workers.items() if s.active]

    def min_clock(self) -> int:
        clocks = [s.clock for s in self.workers.values() if s.active]
        return min(clocks) if clocks else 0

    def lead(self, worker: int) -> int:
        return self.workers[worker].clock - self.min_clock()

    def quorum(self) -> bool:
        return len(self.workers) >= self.expected

    def blocker(self, worker: int, policy: Consistency) -> str:
        """Why `worker` may not read yet, in words."""
        if not self.quorum():
            return f"{len(self.workers)} of --num-workers {self.expected} workers registered"
        if policy.backups:
            return (f"worker {worker}'s gradient waits for the BSP round to close "
                    f"(--num-workers {self.expected} less --backup-workers {policy.backups})")
        return f"worker {worker} is {self.lead(worker)} clocks ahead of the slowest worker"

    def may_read(self, policy: Consistency, worker: int, pending=()) -> bool:
        """Whether `worker` may read; `pending`: the workers whose gradient waits in the
        open BSP round (the rule with backup workers)."""
        if policy.backups:
            return self.quorum() and worker not in pending
        bound = policy.bound
        return bound is None or (self.quorum() and self.lead(worker) <= bound)


@dataclass
class Round:
    """BSP: the gradients of one clock, summed until every active worker has pushed, or
    with backup workers until `needed` have (0: every active worker)."""

    total: np.ndarray
    needed: int = 0
    contributors: dict[int, tuple[int, int]] = field(default_factory=dict)  # worker -> (step, read)
    # the union of the round's ranged pushes (pserver.common.ranges), None once a push covered all
    covered: list[tuple[int, int]] | None = None

    def add(self, worker: int, step: int, version_read: int,
            grad: np.ndarray | ChunkedArray, ranges: list[tuple[int, int]] | None = None) -> None:
        """Add one worker's gradient; `ranges`: it holds only these ranges, packed (the
        rest of it is exactly zero, so the round's sum is the dense one)."""
        if worker in self.contributors:
            raise FailedPrecondition(
                f"worker {worker} already pushed step {self.contributors[worker][0]} in this BSP "
                "round; pull (which waits for the round) before pushing again", reason="round")
        if ranges is not None:
            self._add_ranges(grad, ranges)
            self.contributors[worker] = (step, version_read)
            return
        self.covered = None
        chunked = isinstance(grad, ChunkedArray)
        for lo, piece in zip(grad.starts, grad.pieces, strict=True) if chunked else [(0, grad)]:
            total = self.total[lo : lo + piece.size]
            if self.contributors:
                total += piece
            else:
                total[...] = piece
        self.contributors[worker] = (step, version_read)

    def _add_ranges(self, grad: np.ndarray | ChunkedArray, ranges: list[tuple[int, int]]) -> None:
        if not self.contributors:  # the first push of the round: the sum so far is zero
            self.total[...] = 0
            self.covered = []
        for lo, hi, at in packed(ranges):
            self.total[lo:hi] += grad[at : at + hi - lo]
        if self.covered is not None:
            self.covered = merged(self.covered + ranges)

    def complete(self, clocks: Clocks) -> bool:
        if not self.contributors or not clocks.quorum():
            return False
        return (0 < self.needed <= len(self.contributors)
                or all(w in self.contributors for w in clocks.active()))

    def mean(self) -> np.ndarray:
        self.total /= len(self.contributors)
        return self.total
