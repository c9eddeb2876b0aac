"""One parameter-server shard: its parameters, optimizer and version, behind one lock.

The shard owns the contiguous, balanced element range

    [shard * n // S, (shard + 1) * n // S)

of the model's flat parameter vector (n elements, S shards) and runs the
same optimizer code as single-process training on it (Li et al. 2014,
ps-lite: servers own key ranges and apply the updates). Every method that
reads or changes the state takes `self._cond`'s lock, and everything an
update describes (its staleness, the version it produced, the histograms,
the worker's clock and dedup step) is computed inside that same lock:

    staleness = version at apply - version read        (Zhang et al. 2016)

A push is all or nothing: the servicer assembles and validates the whole
gradient first (finite values, checksum), then calls `push`, which applies it
(or, under BSP, adds it to the round) under the lock, or raises and changes
nothing. Pushes are idempotent by (worker, step): steps below the worker's
next expected step are answered as duplicates and not applied again. A push
may carry only some ranges of the shard (a Mixture-of-Experts worker leaving
out the experts no token reached, pserver.common.ranges): exactly those are updated
(a lazy step, models.optim.Optimizer.step_ranges), a BSP round updates the
union of its pushes' ranges, and the staleness of each expert a push carries
is recorded too (pserver.server.expert_staleness). With backup workers
(pserver.server.consistency) a BSP push read before the round's version is late:
dropped, counted in its worker's `late`, its (worker, step) answered (staleness
> 0, lr 0: under BSP an accepted push always has staleness 0) and remembered
like any other, and journaled, so a backup replica drops it too.

Worker ids. A worker registers under its id, or asks shard 0 to assign one:
one past the highest id the shard has seen, so a new worker never inherits
an old worker's clock and next step (it runs every step it was asked for),
and then registers that id with the other shards (pserver.worker.client). Each
registration carries a random number of the client process. A second
process registering an id is refused (ALREADY_EXISTS) while the holder is
live: a session of it is open, or a call of it in progress, on this shard.
Once it is not (its process ended and the connection with it), the new
process takes the id over with its clock and next step (a restarted worker
goes on where it left off) if it presents the registration it replaces
(`previous`), or where the operator allows any takeover (--allow-takeover),
and calls still carrying the old registration are refused. Two workers never
silently share an id. A worker that deregistered has left: every call of it
is refused until it registers again, and its id is free to register.

Resumed. A server restarted from a checkpoint older than its last state
(periodic checkpoints, pserver.server.periodic) numbers the lost updates' versions
again, with other values. Until a worker the checkpoint names has read from
this server, its pull's known_version is ignored (it gets the values), and a
push it read at a version newer than the shard's counts as read now
(staleness 0) rather than being refused as from the future.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from dtlab.models.optim import Optimizer, Schedule, divided_lr
from dtlab.pserver.common.buffers import ChunkedArray, Snapshot
from dtlab.pserver.common.codec import CHUNK_BYTES
from dtlab.pserver.common.errors import (
    AlreadyExists,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    Unavailable,
)
from dtlab.pserver.common.ranges import Ranges, gather
from dtlab.pserver.server.cache_blocked import BlockedOptimizer
from dtlab.pserver.server.consistency import Clocks, Consistency, Round, WorkerState
from dtlab.pserver.server.expert_staleness import ExpertStaleness
from dtlab.pserver.server.leases import Leases
from dtlab.pserver.server.staleness import Histogram, StalenessLog

log = logging.getLogger(__name__)

_POOL_SIZE = 4  # frozen snapshot arrays kept for reuse (fresh 64 MB arrays cost page faults)


@dataclass(frozen=True)
class ShardLayout:
    """Where this shard sits in the model's flat parameter vector."""

    model: str
    model_size: int
    shard: int
    num_shards: int
    layout_crc: int = 0  # wire.layout_crc of the model's specs

    @property
    def offset(self) -> int:
        return self.shard * self.model_size // self.num_shards

    @property
    def length(self) -> int:
        return (self.shard + 1) * self.model_size // self.num_shards - self.offset


@dataclass(frozen=True)
class PushResult:
    duplicate: bool
    staleness: int
    version: int
    pending: bool = False
    lr: float = 0.0
    # push(copy_to=...): the Adler-32 of the parameters at `version`, copied into copy_to
    # by the update this push made (None: nothing copied; never on a duplicate's reply)
    copied: int | None = None


@dataclass(frozen=True)
class WorkerStats:
    clock: int  # the clock it started at (Clocks.register) + pushes accepted since
    next_step: int
    active: bool
    staleness: Histogram
    expired: bool = False  # dropped when its lease ran out (pserver.server.leases), not back yet
    late: int = 0  # BSP with backup workers: gradients dropped, their round closed before


@dataclass(frozen=True)
class ShardStats:
    """A consistent copy of the shard's counters (StatsReply's fields, as numbers)."""

    version: int
    updates: int  # optimizer steps taken
    pushes: int  # gradients accepted
    duplicates: int
    rejected: Counter[str]  # by reason
    pulls: int
    pulls_not_modified: int
    bytes_received: int
    bytes_sent: int
    staleness: Histogram  # every gradient this shard applied
    workers: dict[int, WorkerStats]
    max_clock_lead: int  # largest lead over the slowest worker a pull was served at
    lr: float  # of the last update
    apply_seconds: float  # in the optimizer
    pushes_in_flight: int
    receive_seconds: float  # receiving pushes, header to checked data
    check_seconds: float  # of which checking the data (Adler-32, finite values)
    workers_dropped: int = 0  # leases that ran out (pserver.server.leases)
    late: int = 0  # BSP with backup workers: late gradients dropped, of every worker
    # per MoE expert on this shard: staleness of the pushes that carried it
    expert_staleness: dict[str, Histogram] = dataclasses.field(default_factory=dict)


@dataclass(frozen=True)
class Read:
    """What a pull gets: the version, and the encoded values (None: not modified)."""

    version: int
    tensor: Snapshot | None


class ShardStore:
    def __init__(self, layout: ShardLayout, params: np.ndarray,
                 optimizer: Optimizer | BlockedOptimizer,
                 schedule: Schedule, policy: Consistency, staleness_lr: str = "none",
                 expected_workers: int = 0, chunk_bytes: int = CHUNK_BYTES,
                 log_every: int = 100, worker_timeout: float = 0.0,
                 experts: ExpertStaleness | None = None):
        if params.shape != (layout.length,):
            raise ValueError(f"shard {layout.shard} holds {layout.length} elements, "
                             f"params has shape {params.shape}")
        self.layout, self.params = layout, params
        self.optimizer, self.schedule = optimizer, schedule
        self.policy, self.staleness_lr, self.chunk_bytes = policy, staleness_lr, chunk_bytes
        self.log_every = log_every
        self._cond = threading.Condition()
        self.version = 0
        self.clocks = Clocks(expected_workers)
        self.leases = Leases(worker_timeout)
        if policy.backups and not (policy.aggregate and expected_workers > policy.backups):
            raise ValueError(f"{policy.backups} backup workers need BSP and more expected "
                             f"workers (got {policy.mode}, {expected_workers})")
        # BSP: the open round; with b backup workers it closes at expected - b gradients
        self._round = Round(np.zeros_like(params), expected_workers - policy.backups
                            if policy.backups else 0) if policy.aggregate else None
        self._replies: dict[int, tuple[int, PushResult]] = {}  # worker -> (step, reply)
        self.staleness = StalenessLog()
        # per MoE expert (pserver.server.expert_staleness)
        self.experts = experts or ExpertStaleness({})
        self.counters: Counter[str] = Counter()
        self.rejected: Counter[str] = Counter()
        self.max_lead = 0
        self.last_lr = 0.0
        self.apply_seconds = self.receive_seconds = self.check_seconds = 0.0
        self._snapshot: Read | None = None
        self._spare: list[np.ndarray] = []  # frozen snapshot arrays nobody reads any more
        self._closed = False
        # workers of a resumed checkpoint that have not read from this server yet: the
        # versions they hold are of the server before the restart (load_state)
        self._before_resume: set[int] = set()
        # pserver.server.replication.journal.Journal: every change, in the order made here,
        # for a backup
        self.journal = None
        self.trace = None  # models.run.trace.Trace of the daemon (--trace): apply spans
        # pserver.server.applylog.ApplyLog (--apply-log): every update, in apply order
        self.applylog = None

    # -- workers ---------------------------------------------------------------------------

    def register(self, worker: int | None, model: str, model_size: int, layout_crc: int,
                 registration: int = 0,
                 previous: int | None = None) -> tuple[int, WorkerState, int]:
        """Join (or rejoin) `worker`, or a new id assigned here (None, shard 0 only);
        returns (the id, its state, the current version). `registration`: the client
        process's number (0: unchecked); `previous`: the registration it says it replaces,
        which taking over an idle id held by another registration requires (None: any
        takeover allowed: --allow-takeover, and a backup applying its primary's
        journal)."""
        lay = self.layout
        who = "a new worker" if worker is None else f"worker {worker}"
        if (model, model_size, layout_crc) != (lay.model, lay.model_size, lay.layout_crc):
            raise FailedPrecondition(
                f"{who} runs model {model!r} with {model_size} parameters (layout "
                f"{layout_crc:#010x}); this server holds {lay.model!r} with {lay.model_size} "
                f"({lay.layout_crc:#010x}): give both the same model flags", reason="model")
        if worker is None and lay.shard != 0:
            raise InvalidArgument(f"shard {lay.shard} assigns no worker ids: register with "
                                  "shard 0 first, then the id it gave", reason="worker")
        with self._cond:
            if worker is None:
                worker = self._held_by(registration)
                if worker is None:
                    worker = self.clocks.new_id()
            state = self.clocks.workers.get(worker)
            if state is not None and registration and state.registration not in (0, registration):
                if state.active and state.live:
                    raise AlreadyExists(
                        f"worker {worker} is taken: another worker process holds it and is "
                        f"connected to shard {lay.shard}; give each worker its own "
                        "--worker-id, or none and the servers assign one", reason="duplicate")
                if previous is not None and not state.left and previous != state.registration:
                    raise FailedPrecondition(
                        f"worker {worker} is held by another registration, idle now: a new "
                        "process takes it over only presenting the registration it replaces "
                        "(RegisterRequest.previous_registration), or on servers started with "
                        "--allow-takeover", reason="takeover")
                log.info("worker %d: a new process takes over its id (clock %d, next step %d)",
                         worker, state.clock, state.next_step)
            state = self.clocks.register(worker)
            state.left = False
            if registration and state.registration != registration:
                state.registration, state.live = registration, 0
            if self.journal is not None:
                self.journal.register(worker, registration)
            self._lease_renewed(worker, "registers again")
            self._cond.notify_all()
            log.info("worker %d registered (clock %d, next step %d)", worker, state.clock,
                     state.next_step)
            return worker, state, self.version

    def _held_by(self, registration: int) -> int | None:
        """The id `registration` already holds (a retried assigning Register). Lock held."""
        if registration:
            for w, s in self.clocks.workers.items():
                if s.registration == registration:
                    return w
        return None

    @contextlib.contextmanager
    def holding(self, worker: int, registration: int) -> Iterator[None]:
        """`worker`'s holder is live while this lasts (an open session, a call)."""
        with self._cond:
            state = self._known(worker, registration)
            counted = bool(registration) and state.registration == registration
            state.live += counted
            self.leases.enter(worker)
            self._lease_renewed(worker, "calls again")
        try:
            yield
        finally:
            with self._cond:
                self.leases.leave(worker)
                if counted and state.registration == registration:
                    state.live -= 1

    def deregister(self, worker: int, registration: int = 0, leaves: bool = False) -> None:
        """`worker` stops counting for SSP and BSP; `leaves`: its own Deregister (not a
        backup applying the journal, where a lease's expiry reads the same): its calls
        are refused from now on, until it registers again; a second one changes nothing."""
        with self._cond:
            state = self._known(worker, registration, left_ok=True)
            if state.left:
                return
            state.left = leaves
            self.clocks.deregister(worker)
            self.leases.back(worker)  # it left: no longer counted as expired
            if self.journal is not None:
                self.journal.deregister(worker, registration)
            if self._round is not None and self._round.complete(self.clocks):
                self._apply_round()
            self._cond.notify_all()
            log.info("worker %d left", worker)

    def _lease_renewed(self, worker: int, how: str) -> None:
        """A sign of life of `worker` (lock held): one dropped when its lease ran out is
        active again, at the slowest active clock (Clocks.register)."""
        self.leases.renew(worker)
        if self.leases.back(worker):
            state = self.clocks.register(worker)
            if self.journal is not None:  # the backup takes it back too, at this point
                self.journal.register(worker, state.registration)
            self._cond.notify_all()
            log.info("worker %d rejoins after its lease expired: it %s; clock %d (the "
                     "slowest active worker's or its own), next step %d", worker, how,
                     state.clock, state.next_step)

    def restart_leases(self) -> None:
        """Every worker's lease counted from now on (a backup taking over)."""
        with self._cond:
            self.leases.restart()

    def expire_leases(self) -> list[int]:
        """Drop every active worker whose lease ran out (pserver.server.leases): SSP and BSP stop
        waiting for it, a BSP round it held up is applied; the ids dropped."""
        with self._cond:
            overdue = self.leases.overdue(self.clocks.active())
            for worker, idle in overdue:
                self.clocks.deregister(worker)
                self.leases.expire(worker)
                if self.journal is not None:  # the backup drops it too, at this point
                    self.journal.deregister(worker, self.clocks.workers[worker].registration)
                state = self.clocks.workers[worker]
                log.warning("worker %d dropped: no call and no open session for %.1f s "
                            "(--worker-timeout %g); clock %d, next step %d; %d active "
                            "workers remain", worker, idle, self.leases.timeout, state.clock,
                            state.next_step, len(self.clocks.active()))
            if overdue:
                if self._round is not None and self._round.complete(self.clocks):
                    log.info("the BSP round goes on without them: %d gradients averaged",
                             len(self._round.contributors))
                    self._apply_round()
                self._cond.notify_all()
            return [w for w, _ in overdue]

    def known(self, worker: int, registration: int = 0) -> None:
        """Raise as _known would: `worker` unknown, its `registration` superseded, or it
        deregistered (a session's later operation, checked before its fields)."""
        with self._cond:
            self._known(worker, registration)

    def _known(self, worker: int, registration: int = 0, left_ok: bool = False) -> WorkerState:
        """`worker`'s state; FailedPrecondition if it is unknown, `registration` (0: not
        checked) was superseded, or (unless `left_ok`) it deregistered. Lock held."""
        state = self.clocks.workers.get(worker)
        if state is None:
            raise FailedPrecondition(f"worker {worker} is not registered with shard "
                                     f"{self.layout.shard}; call Register first", reason="worker")
        if registration and state.registration not in (0, registration):
            raise FailedPrecondition(
                f"worker {worker} was registered by another process since this one did (two "
                f"workers with --worker-id {worker}?); this one may not go on",
                reason="superseded")
        if state.left and not left_ok:
            raise FailedPrecondition(
                f"worker {worker} left shard {self.layout.shard} (Deregister): it may not "
                "pull or push until it registers again", reason="deregistered")
        return state

    # -- pull ------------------------------------------------------------------------------

    def read(self, worker: int, known_version: int | None, timeout: float | None,
             alive: Callable[[], bool] = lambda: True) -> Read:
        """The shard's values once `worker` may read them under the consistency policy."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            self._known(worker)
            if worker in self._before_resume:  # its version may name other values here
                known_version = None
            if known_version is not None and known_version > self.version:
                raise InvalidArgument(f"known_version {known_version} is from the future: "
                                      f"shard version is {self.version}", reason="version")
            while True:
                if self._closed:
                    raise Unavailable("server is shutting down", reason="shutdown")
                self._known(worker)  # it may have deregistered while this pull waited
                if self.clocks.may_read(self.policy, worker, self._pending()):
                    break
                if not alive():
                    raise DeadlineExceeded("pull cancelled while waiting", reason="cancelled")
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise DeadlineExceeded(f"gave up waiting: "
                                           f"{self.clocks.blocker(worker, self.policy)}",
                                           reason="wait")
                self._cond.wait(left)
            self.max_lead = max(self.max_lead, self.clocks.lead(worker))
            self._before_resume.discard(worker)
            self.experts.pulled(worker)
            self.counters["pulls"] += 1
            if known_version == self.version:
                self.counters["pulls_not_modified"] += 1
                return Read(self.version, None)
            if self._snapshot is None:  # dropped or frozen by every change of the version
                self._snapshot = Read(self.version, Snapshot(self.params, self.chunk_bytes))
            self._snapshot.tensor.readers += 1
            self.counters["bytes_sent"] += self._snapshot.tensor.nbytes
            return self._snapshot

    def _unshare(self) -> None:
        """Before the parameters change (lock held): pulls still streaming the current
        version get a copy of it to go on from; with none, the snapshot is just dropped."""
        snap, self._snapshot = self._snapshot, None
        if snap is not None and snap.tensor.readers:
            snap.tensor.freeze(self._spare.pop() if self._spare else np.empty_like(self.params))

    def release(self, read: Read) -> None:
        """A pull is done with `read`: a frozen copy nobody reads may serve a later one."""
        if read.tensor is None:
            return
        with self._cond:
            read.tensor.readers -= 1
            if read.tensor.readers == 0 and read.tensor.frozen and len(self._spare) < _POOL_SIZE:
                self._spare.append(read.tensor.values)

    # -- push ------------------------------------------------------------------------------

    def admit(self, worker: int, step: int, version_read: int) -> PushResult | None:
        """Check a push header before its data arrives: the reply if it is a duplicate."""
        with self._cond:
            return self._screen(worker, step, version_read)

    def _screen(self, worker: int, step: int, version_read: int) -> PushResult | None:
        """Refuse an unknown worker or a version from the future; answer a duplicate
        (worker, step) with its earlier reply; None for a new push. Lock held."""
        state = self._known(worker)
        if version_read > self.version and worker not in self._before_resume:
            raise InvalidArgument(
                f"meta.version {version_read} is from the future: shard version is "
                f"{self.version}", reason="version")
        return self._duplicate(worker, step) if step < state.next_step else None

    def _duplicate(self, worker: int, step: int) -> PushResult:
        self.counters["duplicates"] += 1
        last = self._replies.get(worker)
        if last is not None and last[0] == step:
            return dataclasses.replace(last[1], duplicate=True)
        return PushResult(True, 0, self.version)

    @contextlib.contextmanager
    def receiving(self) -> Iterator[None]:
        """Counts one incoming push stream in flight while it is received and applied."""
        with self._cond:
            self.counters["in_flight"] += 1
        try:
            yield
        finally:
            with self._cond:
                self.counters["in_flight"] -= 1

    def received(self, seconds: float, check_seconds: float) -> None:
        """A push stream took `seconds` to arrive, `check_seconds` of them in its checks."""
        with self._cond:
            self.receive_seconds += seconds
            self.check_seconds += check_seconds

    def push(self, worker: int, step: int, version_read: int,
             grad: np.ndarray | ChunkedArray, ranges: Ranges | None = None,
             nbytes: int | None = None, copy_to: np.ndarray | None = None) -> PushResult:
        """Apply (ASP, SSP) or add to the round (BSP) one validated gradient; `ranges`: it
        holds only these ranges of the shard, packed (pserver.common.ranges; None: all of it);
        `nbytes`: the bytes it took on the wire, counted in bytes_received (None: its own,
        grad.nbytes; a compressed push's payload is smaller or larger); `copy_to` (the
        shard's shape, possibly `grad`'s own memory: a shared-memory segment): where an
        update of the whole shard with the blocked optimizer follows, the new parameters
        are copied there block by block as it makes them (PushResult.copied)."""
        nbytes = grad.nbytes if nbytes is None else nbytes
        with self._cond:
            screened = self._screen(worker, step, version_read)
            if screened is not None:
                return screened
            state = self.clocks.workers[worker]
            if worker in self._before_resume:  # read before the restart: counted as read now
                version_read = min(version_read, self.version)
            staleness = self.version - version_read
            if staleness and self.policy.backups:
                return self._late(worker, step, version_read, grad, ranges, nbytes)
            if self._round is not None:
                self._round.add(worker, step, version_read, grad, ranges)
            self.experts.pushed(worker, ranges)
            state.clock += 1
            state.next_step = step + 1
            self.counters["pushes"] += 1
            self.counters["bytes_received"] += nbytes
            lr = self._lr([staleness])
            if self.journal is not None:  # the backup receives it while this applies it
                self.journal.push(worker, step, version_read, grad, ranges)
            copied = None
            if self._round is None:
                copied = self._apply(grad, [(worker, step, version_read)], ranges, copy_to)
            elif self._round.complete(self.clocks):
                copied = self._apply_round(copy_to)
            pending = self._round is not None and worker in self._round.contributors
            result = PushResult(False, staleness, self.version, pending, lr)
            self._replies[worker] = (step, result)  # a duplicate's answer copies nothing
            self._cond.notify_all()
            return dataclasses.replace(result, copied=copied)

    def _pending(self) -> dict:
        """The workers whose gradient waits in the open BSP round (lock held)."""
        return self._round.contributors if self._round is not None else {}

    def _late(self, worker: int, step: int, version_read: int,
              grad: np.ndarray | ChunkedArray, ranges: Ranges | None,
              nbytes: int) -> PushResult:
        """A gradient of a BSP round that closed without it (backup workers; lock held):
        dropped and counted; its worker goes on from the next step."""
        state = self.clocks.workers[worker]
        state.next_step = step + 1
        state.late += 1
        self.counters["late"] += 1
        self.counters["bytes_received"] += nbytes
        if self.journal is not None:  # the backup drops it the same way
            self.journal.push(worker, step, version_read, grad, ranges)
        result = PushResult(False, self.version - version_read, self.version, False, 0.0)
        self._replies[worker] = (step, result)
        log.debug("worker %d step %d: late by %d versions, dropped", worker, step,
                  result.staleness)
        self._cond.notify_all()
        return result

    def _apply_round(self, copy_to: np.ndarray | None = None) -> int | None:
        contributions = [(w, step, read) for w, (step, read) in self._round.contributors.items()]
        mean, covered = self._round.mean(), self._round.covered
        copied = self._apply(mean if covered is None else gather(mean, covered), contributions,
                             covered, copy_to)
        self._round.contributors.clear()
        return copied

    def _apply(self, grad: np.ndarray | ChunkedArray,
               contributions: list[tuple[int, int, int]], ranges: Ranges | None = None,
               copy_to: np.ndarray | None = None) -> int | None:
        """One optimizer step (of `ranges` only, `grad` packed: a lazy step); called with
        the lock held. `copy_to`: see push; the Adler-32 of what it copied there, or None."""
        stalenesses = [self.version - read for _, _, read in contributions]
        lr = self._lr(stalenesses)
        self._unshare()
        t0 = time.perf_counter()
        copied = None
        if ranges is None and copy_to is not None and isinstance(self.optimizer,
                                                                 BlockedOptimizer):
            copied = self.optimizer.step(self.params, grad, lr, copy_to=copy_to)
        elif ranges is None:
            self.optimizer.step(self.params, grad, lr)
        else:
            self.optimizer.step_ranges(self.params, grad, ranges, lr)
        self.experts.applied(ranges)
        t1 = time.perf_counter()
        self.apply_seconds += t1 - t0
        if self.trace is not None:
            self.trace.span("apply", t0, t1, version=self.version + 1,
                            workers=[w for w, _, _ in contributions])
        for (worker, step, _), s in zip(contributions, stalenesses, strict=True):
            self.staleness.record(worker, s)
            log.debug("applied worker %d step %d staleness %d at version %d lr %.3g",
                      worker, step, s, self.version, lr)
        self.version += 1
        self.last_lr = lr
        if self.applylog is not None:
            self.applylog.applied(self.version, lr, contributions, ranges, self.params)
        if self.log_every and self.version % self.log_every == 0:
            h = self.staleness.shard
            log.info("shard %d version %d: %d gradients applied, staleness mean %.2f max %d",
                     self.layout.shard, self.version, h.total, h.sum / max(1, h.total), h.max)
        return copied

    def _lr(self, stalenesses: list[int]) -> float:
        """The scheduled lr of the next update, divided by its staleness if so configured."""
        return divided_lr(self.schedule(self.optimizer.steps), stalenesses, self.staleness_lr)

    def reject(self, reason: str) -> None:
        with self._cond:
            self.rejected[reason] += 1

    # -- lifecycle -------------------------------------------------------------------------

    def wake(self) -> None:
        """Let waiting pulls re-check (e.g. after their RPC was cancelled)."""
        with self._cond:
            self._cond.notify_all()

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """No change happens while this lasts (the store's own lock, reentrant)."""
        with self._cond:
            yield

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Fail waiting and future pulls with UNAVAILABLE; pushes still complete."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def stats(self) -> ShardStats:
        with self._cond:
            c = self.counters
            workers = {w: WorkerStats(s.clock, s.next_step, s.active,
                                      self.staleness.worker(w).copy(),
                                      expired=w in self.leases.expired, late=s.late)
                       for w, s in self.clocks.workers.items()}
            return ShardStats(
                version=self.version, updates=self.optimizer.steps, pushes=c["pushes"],
                duplicates=c["duplicates"], rejected=Counter(self.rejected), pulls=c["pulls"],
                pulls_not_modified=c["pulls_not_modified"],
                bytes_received=c["bytes_received"], bytes_sent=c["bytes_sent"],
                staleness=self.staleness.shard.copy(), workers=workers,
                max_clock_lead=self.max_lead, lr=self.last_lr, apply_seconds=self.apply_seconds,
                pushes_in_flight=c["in_flight"], receive_seconds=self.receive_seconds,
                check_seconds=self.check_seconds, workers_dropped=self.leases.dropped,
                late=c["late"],
                expert_staleness=self.experts.copy())

    def state(self) -> dict:
        """A consistent copy of everything a checkpoint keeps: parameters, optimizer,
        version, the workers' clocks and next steps, the staleness histograms, and
        an unfinished BSP round (the gradient sum so far and who is in it), so that
        a restarted server finishes the round with the workers still to push."""
        with self._cond:
            workers = {w: {"clock": s.clock, "next_step": s.next_step, "active": s.active,
                           **({"late": s.late} if s.late else {}),  # late: backup workers'
                           **({"left": True} if s.left else {})}  # it deregistered
                       for w, s in self.clocks.workers.items()}
            opt = {k: (v.copy() if isinstance(v, np.ndarray) else v)
                   for k, v in self.optimizer.state_dict().items()}
            pending = None
            if self._round is not None and self._round.contributors:
                pending = {"total": self._round.total.copy(),
                           "contributors": dict(self._round.contributors),
                           "covered": self._round.covered}
            return {"version": self.version, "params": self.params.copy(), "optimizer": opt,
                    "workers": workers, "staleness": self.staleness.to_dict(),
                    "round": pending}

    def load_state(self, state: dict) -> None:
        """Restore what `state` returned; ValueError (nothing changed) if it does not fit."""
        pending = state.get("round")
        if state["params"].shape != self.params.shape:
            raise ValueError(f"checkpoint params shape {state['params'].shape} != "
                             f"shard shape {self.params.shape}")
        if pending and self._round is None:
            raise ValueError("it holds an unfinished BSP round: resume with --consistency bsp")
        if pending and pending["total"].shape != self.params.shape:
            raise ValueError(f"BSP round shape {pending['total'].shape} != shard shape "
                             f"{self.params.shape}")
        staleness = StalenessLog.from_dict(state["staleness"]) if "staleness" in state else None
        with self._cond:
            self._unshare()
            self.params[...] = state["params"]
            self.optimizer.load_state_dict(state["optimizer"])
            self.version = int(state["version"])
            for w, s in state["workers"].items():
                self.clocks.workers[int(w)] = WorkerState(int(s["clock"]), int(s["next_step"]),
                                                          bool(s["active"]),
                                                          late=int(s.get("late", 0)),
                                                          left=bool(s.get("left", False)))
            self._before_resume = set(self.clocks.workers)
            if staleness is not None:
                self.staleness = staleness
            if pending:
                self._round.total[...] = pending["total"]
                self._round.contributors = {int(w): (int(step), int(read)) for w, (step, read)
                                            in pending["contributors"].items()}
                self._round.covered = pending.get("covered")  # a round of ranged pushes
