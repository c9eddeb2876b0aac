"""Chain replication of one shard: a primary and a backup that lose no acknowledged push,
and never two primaries.

van Renesse and Schneider (OSDI 2004), as Li et al. (OSDI 2014, section 4.3)
use it for parameter-server key ranges, with a chain of two: the primary
(head) makes every change to its store, the backup (tail) makes the same
changes in the same order, and a worker hears back only once the backup
holds the change. `dtlab-pserver serve --replicas 2` starts a primary;
`--replicas 2 --replica-of HOST:PORT` a backup of the primary at HOST:PORT.

    worker --push--> primary: store.push (records, applies) --entry--> backup: store.push
                            <-------------------------------- applied(seq)
    worker <--reply-- (held until the backup applied every change made so far)

The changes are the store's own: Register, Deregister and an accepted push
(worker, step, version read, gradient bytes). The store records each in the
Journal under its own lock, so the journal's order is the order the primary
applied them; the backup runs the same store code (same optimizer, BSP
rounds, dedup by (worker, step)) on them in that order, so its parameters,
clocks and round stay bit-identical to the primary's. A shared-memory push
is recorded as a copy (the segment is the worker's to reuse). Pulls read the
primary's store but, like every other reply, leave it only once all changes
made before them are on the backup: no worker ever sees a change the backup
lacks, so the version a worker pushes against is never ahead of the backup.

Joining. The backup opens Replicate and sends its layout and config; the
primary, under its store's lock, starts keeping journal entries and takes
ShardStore.state() (the checkpoint's content) at that cut, sends it with its
term, then every entry after the cut, and a heartbeat every quarter of
--replica-timeout-s. Until a first backup has joined, a primary started
with --replicas 2 refuses workers (UNAVAILABLE) and its health says
NOT_SERVING, so no push is ever acknowledged with one copy at the start.

One primary (the rule). Every takeover, and every primary that goes on
without its backup, starts a new term (Journal.term, in ReplicaStatus). Two
replicas cannot tell a silent peer that is paused from one cut off from them;
the workers, which reach both, are the third party that breaks the tie: the
replica they can still reach serves.

- A lease. The backup answers each heartbeat with its beat (when the primary
  sent it) and takes over only after it heard nothing for
  --replica-timeout-s; so until beat + --replica-timeout-s of the last
  heartbeat answered the backup has not taken over, and the primary
  acknowledges nothing and serves no pull after that lease until it knows
  what its backup did: its replies wait (for a second or so), its health still
  says SERVING (a primary that runs keeps its workers), and ReplicaStatus says
  "isolated".
- A backup takes over only when a worker asks it. A backup that hears nothing
  from its primary asks it (ReplicaStatus): an answer as primary drops it
  (it rejoins, below); one that stops or was replaced, or nothing on its port,
  lets it take over at once (the primary's process is gone, or acknowledges
  nothing more); silence makes it an orphan, whose health says UNKNOWN and
  which takes over only when a worker's call asks it (Follower.take_over: the
  worker found the primary silent too, as happens when the primary is paused or
  cut off from its workers), and only if that worker has seen no term of the
  shard above the backup's (the primary went on alone, so acknowledged pushes
  are missing here).
- Dropping is asked, or read from silence that only a running primary hears. A
  primary that lost its backup (its stream broke, or its lease ran out) goes on
  alone, in a new term, once the backup answered ReplicaStatus(term) with
  "dropped" (a backup answering that request never takes over: the two are one
  decision under its lock), or once nothing listens on the backup's port while
  the lease still runs, or when the backup never held the whole snapshot, or
  once the backup has answered nothing for the lease while this primary ran all
  along (PauseWatch: no pause of its own since the backup's last answer). Then no
  worker has asked the backup to take over: none leaves a primary that runs and
  says SERVING. If the backup answers that it took over, this primary was
  replaced: it sends none of the replies it still holds and rejoins.

So a paused primary is replaced (its workers find it silent and ask the
backup, which has heard nothing for the lease) and, once it runs again, learns
that from the backup before it answers anyone (its own pause keeps it from
reading the backup's silence as the backup's); a paused or cut-off backup is
dropped at the lease's end, and its shard acknowledges again within about
--replica-timeout-s + 0.5 s. The rule assumes a single fault: a primary cut off
from its backup and from a worker at once (two faults), or cut off from its
backup and too loaded to answer a worker's health check within half a second,
can be taken over by that worker's call while it goes on alone for the others.

Rejoining (chain replication's recovery: van Renesse and Schneider 2004, section
3; Li et al. 2014, section 4.3). A backup that was dropped (once its primary went
on alone) and a primary that was replaced drop their store and start again,
on the same port, as the backup of the other replica (`rejoin`, given by the
daemon: pserver.__main__ builds a fresh store and daemon with --replica-of
the other), which sends them its snapshot and then its journal as to any
joining backup: the shard is two replicas again within a second or so, and a
push acknowledged meanwhile is in the snapshot or in the journal after it.

Failure. The backup detects the primary's death by its stream breaking (a
killed process's connections are reset) or by hearing nothing, not even a
heartbeat, for --replica-timeout-s; it then asks the primary's
ReplicaStatus (pserver.server.replication.peer): a primary that answers
(alive: it was dropped) keeps it, so it rejoins; one that stops or was
replaced, or nothing listening on its port, lets it take over at once; no
answer makes it an orphan, which takes over at a worker's call. It then serves workers
as primary (alone, until its old primary rejoins it, or a restarted daemon
joins it with --replica-of). A primary that stops (SIGTERM) sends no held
reply either: its workers get UNAVAILABLE and retry at the backup, which
takes over. Workers list each shard as PRIMARY|BACKUP and switch to the
other address on UNAVAILABLE, or where the replica does not say SERVING to a
health check during a call that takes long, and try a replica whose health says
UNKNOWN (an orphan) when none says SERVING (pserver.worker.failover); a push
retried after a failover is applied once, by its (worker, step): if it
reached the backup before the primary died, the new primary answers it as a
duplicate.

Replicas of model-parallel partitions and TLS between replicas are not
supported (refused at start and at Register).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2

from dtlab.protos import dtlab_ps_pb2 as pb
from dtlab.pserver.common import auth
from dtlab.pserver.common import codec as wire
from dtlab.pserver.common.config import ServerConfig
from dtlab.pserver.server.replication import peer
from dtlab.pserver.server.replication.backup import Follower
from dtlab.pserver.server.replication.journal import (
    HEARTBEAT,
    REPLICATION,
    STATE,
    STATE_PART,
    Journal,
    entry_messages,
    pack,
    same_run,
)
from dtlab.pserver.server.replication.pauses import PauseWatch
from dtlab.pserver.server.store import ShardStore

log = logging.getLogger(__name__)

# the calls of workers, held back on a backup and until the backup holds every change
WORKER_METHODS = frozenset(f"/{wire.SERVICE}/{m}" for m in
                           ("Register", "Deregister", "Pull", "Push", "Session"))
# what a replica that is or was a primary answers: asked by its backup-to-be-dropped, it
# means that replica took over
PRIMARY_ROLES = frozenset(("primary", "isolated", "stopping", "replaced"))


class Replication:
    """One daemon's part in its shard's chain: the Replication service, the gate on
    workers' calls, and (on a backup) the Follower of the primary.

    `role`: "joining" -> "backup" -> "primary" (takes over) -> "stopping" | "replaced";
    "joining" | "backup" -> "dropped" (never takes over: dropped by its primary, or it
    stops). Every change of role is made under one lock.

    `fail(why)`: the daemon cannot go on (a backup that could not join, a primary
    that cannot tell whether its lost backup took over); it shuts down and exits
    non-zero. `rejoin(primary, why)`: it goes on as the backup of `primary` (a
    backup dropped by a live primary, a primary replaced by its backup): the daemon
    shuts down and starts again with --replica-of `primary`."""

    def __init__(self, cfg: ServerConfig, store: ShardStore, config: dict):
        self.cfg, self.store, self.config = cfg, store, config
        self.journal = Journal(cfg.replica_timeout_s, self._lost_backup)
        self.journal.term = 0 if cfg.replica_of else 1
        store.journal = self.journal
        self.role = "joining" if cfg.replica_of else "primary"
        self._lock = threading.Lock()  # every change of role
        self.primary = cfg.replica_of
        self.awaiting_backup = not cfg.replica_of  # a new primary serves once backed up
        self.failovers = 0
        self.address = ""
        self.health: object | None = None
        self._health_lock = threading.Lock()
        self.fail: Callable[[str], None] = lambda why: None
        self.rejoin: Callable[[str, str], None] = lambda primary, why: None
        self.drop_reason = ""  # why this backup was dropped (the first reason given)
        self.follower: Follower | None = None
        self.gate = Gate(self)
        self.metadata = auth.call_metadata(auth.read_token(cfg.token_file, cfg.token_env))
        # of one ReplicaStatus to the other: a live replica answers in milliseconds, and
        # the backup's takeover waits for it (after a lease of silence, so the primary
        # answers no worker by then: a live one that answers late costs a takeover, no more)
        self.ask_timeout = min(0.5, cfg.replica_timeout_s / 4)
        # a primary goes on without a silent backup only if it ran all along meanwhile
        self.pauses = PauseWatch(cfg.replica_timeout_s / 8, cfg.replica_timeout_s / 2)
        lay, params = store.layout, store.params
        self.meta = pb.TensorMeta(dtype=wire.dtype_code(params.dtype), shape=[lay.length],
                                  offset=lay.offset)

    def start(self, address: str, health, fail: Callable[[str], None],
              rejoin: Callable[[str, str], None]) -> None:
        """Begin (a backup: join the primary), setting `health` from now on."""
        self.address, self.fail, self.rejoin = address, fail, rejoin
        self.pauses.start()
        with self._health_lock:
            self.health = health
        self._set_health()
        if self.role == "joining":
            self.follower = Follower(self)
            self.follower.start()
        else:
            log.info("shard %d: primary with --replicas %d: serving workers once a backup "
                     "joins", self.store.layout.shard, self.cfg.replicas)

    def serving(self) -> int:
        """SERVING: a primary with a backup (or alone after one), deciding about a lost
        one included (its replies wait); UNKNOWN: an orphaned backup, which takes over
        when a worker asks it (Follower.take_over); else NOT_SERVING."""
        if self.role == "primary" and not self.awaiting_backup and not self.journal.refusing:
            return health_pb2.HealthCheckResponse.SERVING
        if self.role == "backup" and self.follower is not None and self.follower.orphaned:
            return health_pb2.HealthCheckResponse.UNKNOWN
        return health_pb2.HealthCheckResponse.NOT_SERVING

    def orphaned(self) -> None:
        """The follower lost a silent primary: the health says so (UNKNOWN)."""
        self._set_health()

    def _set_health(self) -> None:
        """The health service says what the role says now (none before start)."""
        with self._health_lock:
            if self.health is not None:
                for name in ("", wire.SERVICE):
                    self.health.set(name, self.serving())

    def reported_role(self) -> str:
        """The role as ReplicaStatus says it: a primary outside its lease is "isolated"."""
        role = self.role
        if role == "primary" and not self.journal.answering():
            return "isolated"
        return role

    def refusal(self, context=None) -> str:
        """Why this daemon answers no worker now ("" if it does); an orphaned backup takes
        over first where the worker calling (`context`: the highest term it saw, read only
        here) asks it to."""
        shard = self.store.layout.shard
        follower = self.follower
        if self.role == "backup" and follower is not None and follower.orphaned:
            why = follower.take_over(0 if context is None else worker_term(context))
            if why:
                return (f"shard {shard} at {self.address} is the backup of {self.primary}, "
                        f"which gives it no answer, and does not take over now: {why}")
        role = self.role
        if role in ("joining", "backup"):
            return (f"shard {shard} at {self.address} is a backup (of {self.primary}): "
                    "send to the primary")
        if role != "primary":
            return f"shard {shard} at {self.address} is no primary ({role}): try the other"
        if self.awaiting_backup:
            return (f"shard {shard} at {self.address} waits for its backup to join "
                    f"(--replicas {self.cfg.replicas})")
        return ""

    def joined(self, term: int) -> bool:
        """The backup holds its primary's snapshot of `term`: it follows it (False: it was
        dropped first)."""
        with self._lock:
            if self.role != "joining":
                return False
            self.role, self.journal.term = "backup", term
        self.primary = self.cfg.replica_of
        return True

    def promote(self, why: str) -> bool:
        """This backup takes over, in a new term, unless it was dropped (or stops) first."""
        with self._lock:
            if self.role != "backup":
                return False
            self.role, self.failovers = "primary", self.failovers + 1
            self.journal.term += 1
        log.warning("shard %d: primary %s is gone (%s): this backup takes over at version %d "
                    "(term %d)", self.store.layout.shard, self.primary, why, self.store.version,
                    self.journal.term)
        self.primary = ""
        self._set_health()
        return True

    def dropped(self, why: str) -> bool:
        """This backup never takes over (from now on, under the lock promote takes); False
        if it took over already."""
        with self._lock:
            if self.role not in ("joining", "backup"):
                return self.role == "dropped"
            self.role, self.drop_reason = "dropped", why
        self._set_health()
        log.warning("shard %d: dropped as the backup of %s (%s): it never takes over",
                    self.store.layout.shard, self.primary, why)
        if self.follower is not None:
            self.follower.fence()
        return True

    def stop(self) -> None:
        """The daemon stops: no more workers, and no reply the backup lacks goes out
        (a backup takes over from a primary that stops; a backup that stops never does)."""
        self.journal.refuse()
        with self._lock:
            if self.role == "primary":
                self.role = "stopping"
            elif self.role in ("joining", "backup"):
                self.role = "dropped"
        self.pauses.stop()
        if self.follower is not None:
            self.follower.stop()

    # -- a lost backup ----------------------------------------------------------------------

    def _lost_backup(self, link: int, why: str) -> None:
        self._set_health()
        threading.Thread(target=self._decide, args=(link, why), daemon=True,
                         name="ps-lost-backup").start()

    def _decide(self, link: int, why: str) -> None:
        """The backup of `link` is lost: ask it until it answers that it was dropped (go on
        alone) or that it took over (this primary was replaced), or it is gone; or until
        its silence has outlasted the lease with this primary running all along (go on
        alone: a backup takes over only when a worker asks it, and no worker leaves a
        primary that runs and says SERVING)."""
        j, timeout = self.journal, self.cfg.replica_timeout_s
        backup, term, asked = j.backup, j.term, 0
        silent_from = j.lease_end - timeout  # its last answer: the silence, if unpaused
        while self.role == "primary" and j.deciding(link):
            if not j.whole:
                self._alone(link, backup, f"{why}; it never held the whole snapshot")
                return
            began = time.monotonic()
            answer = peer.ask(backup, self.metadata, self.ask_timeout, term=term)
            asked += 1
            if answer == peer.SILENT:
                if not self.pauses.ran_since(silent_from):  # paused: count from now on
                    silent_from = began
                if not j.leased() and self.pauses.ran_since(silent_from) \
                        and time.monotonic() - silent_from >= timeout:
                    self._alone(link, backup, f"{why}; it answers nothing, and this primary "
                                              f"ran all along for {timeout:g} s of silence")
                    return
                if asked == 1:
                    log.info("shard %d: backup %s gives no answer: asking until it answers "
                             "or has been silent for the lease while this primary ran, its "
                             "replies waiting", self.store.layout.shard, backup)
                time.sleep(timeout / 4)
                continue
            if isinstance(answer, pb.ReplicaStatusReply):
                if answer.role in PRIMARY_ROLES or answer.term > term:
                    self._replaced(backup, answer)
                    return
                if answer.role == "dropped" and answer.term == term:
                    self._alone(link, backup, f"{why}; it answers that it never takes over")
                    return
            # gone, or a daemon there that never held this primary's snapshot
            if j.leased():  # the backup of this link died before it could take over
                self._alone(link, backup, f"{why}; nothing answers for it, within its lease")
                return
            j.refuse()
            with self._lock:
                self.role = "stopping"
            self._set_health()
            self.fail(f"shard {self.store.layout.shard}: the backup {backup} is gone after "
                      "its lease ran out: it may have taken over before, and this daemon "
                      "cannot tell; it stops (restart the shard)")
            return

    def _alone(self, link: int, backup: str, why: str) -> None:
        self.journal.drop(link)
        log.warning("shard %d: backup %s dropped (%s): this primary goes on alone (term %d)",
                    self.store.layout.shard, backup, why, self.journal.term)
        self._set_health()

    def _replaced(self, backup: str, answer: pb.ReplicaStatusReply) -> None:
        self.journal.refuse()
        with self._lock:
            self.role = "replaced"
        self._set_health()
        self.rejoin(backup, f"shard {self.store.layout.shard}: replaced as primary: its "
                            f"backup {backup} took over (it answers {answer.role}, term "
                            f"{answer.term}) while this primary could not reach it")

    # -- the service ------------------------------------------------------------------------

    def Replicate(self, requests: Iterator[bytes], context) -> Iterator[bytes]:
        requests = iter(requests)
        try:
            first = pb.ReplicaUp.FromString(next(requests))
        except (StopIteration, DecodeError) as e:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"Replicate must start with join "
                                                            f"({e!r})")
        if first.WhichOneof("kind") != "join":
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "Replicate must start with join")
        join = first.join
        why = self._refuse_join(join)
        if why:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, why)
        store, journal = self.store, self.journal
        with store.locked():
            link = journal.attach(join.address)
            state = store.state() if link else None
            cut = journal.seq
            held = {w: s.registration for w, s in store.clocks.workers.items()}
        if not link:
            if journal.deciding(journal.link):
                context.abort(grpc.StatusCode.UNAVAILABLE,
                              f"shard {store.layout.shard} at {self.address} is deciding about "
                              f"its lost backup {journal.backup}: try again")
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"shard {store.layout.shard} at {self.address} already has a backup "
                          f"({journal.backup})")
        context.add_callback(lambda: journal.lose(link, "its stream ended"))
        threading.Thread(target=self._read_acks, args=(requests, link),
                         name="ps-replica-acks", daemon=True).start()
        data = pack({**state, "registrations": held})
        log.info("shard %d: backup %s joins at version %d (entry %d, %d bytes of state, "
                 "term %d)", store.layout.shard, join.address, state["version"], cut,
                 len(data), journal.term)
        yield wire.wrap(STATE, pb.ReplicaState(seq=cut, nbytes=len(data),
                                               adler32=wire.adler32(data), term=journal.term))
        step = self.cfg.chunk_bytes
        starts = range(0, len(data), step)
        for lo in starts:
            if not journal.snapshot_part(link, last=lo == starts[-1]):
                return
            yield wire.wrap(STATE_PART, pb.Chunk(start=lo, data=data[lo : lo + step]))
        if self.awaiting_backup:
            self.awaiting_backup = False
            self._set_health()
            log.info("shard %d: backup %s joined: serving workers", store.layout.shard,
                     join.address)
        yield from self._stream(link, cut, context)

    def _stream(self, link: int, sent: int, context) -> Iterator[bytes]:
        """The entries after `sent` as they come, a heartbeat every quarter of the timeout
        (between entries too: each one answered renews the lease)."""
        journal, lay = self.journal, self.store.layout
        every, last = self.cfg.replica_timeout_s / 4, 0.0
        while context.is_active() and journal.attached(link):
            journal.expire(link)
            if time.monotonic() - last >= every:
                last = time.monotonic()
                yield wire.wrap(HEARTBEAT, pb.ReplicaHeartbeat(
                    seq=journal.seq, term=journal.term, beat=time.monotonic_ns()))
            for e in journal.after(link, sent, last + every - time.monotonic()):
                yield from entry_messages(e, lay.shard, self.meta, self.cfg.chunk_bytes)
                sent = e.seq
                if time.monotonic() - last >= every or not journal.attached(link):
                    break

    def _refuse_join(self, join: pb.ReplicaJoin) -> str:
        lay = self.store.layout
        if self.role != "primary":
            return (f"shard {lay.shard} at {self.address} is not a primary ({self.role}"
                    f"{' of ' + self.primary if self.primary else ''}): join its primary")
        mine = (lay.shard, lay.num_shards, lay.model, lay.model_size, lay.layout_crc)
        theirs = (join.shard, join.num_shards, join.model, join.model_size, join.layout_crc32)
        if mine != theirs:
            return (f"the backup holds shard {theirs[0]} of {theirs[1]} of {theirs[2]!r} "
                    f"({theirs[3]} parameters, layout {theirs[4]:#010x}); this primary "
                    f"{mine[0]} of {mine[1]} of {mine[2]!r} ({mine[3]}, {mine[4]:#010x})")
        ours, given = same_run(self.config), json.loads(join.config or "{}")
        differ = sorted(k for k in set(ours) | set(given) if ours.get(k) != given.get(k))
        if differ:
            return (f"the backup's config differs from the primary's in {', '.join(differ)}: "
                    f"give both daemons the same flags (theirs {given}, ours {ours})")
        return ""

    def _read_acks(self, requests: Iterator[bytes], link: int) -> None:
        journal = self.journal
        try:
            for raw in requests:
                up = pb.ReplicaUp.FromString(raw)
                if up.WhichOneof("kind") != "applied":
                    continue
                if up.applied.term != journal.term:
                    why = (f"it acknowledges term {up.applied.term}, this primary's is "
                           f"{journal.term}")
                    break
                journal.applied(link, up.applied.seq, up.applied.beat)
            else:
                why = "its stream ended"
        except (grpc.RpcError, DecodeError) as e:
            why = f"its stream broke: {e}"
        journal.lose(link, why)

    def ReplicaStatus(self, request: pb.ReplicaStatusRequest, context) -> pb.ReplicaStatusReply:
        if request.term:  # a primary drops this daemon as its backup
            self.dropped(f"its primary (term {request.term}) lost it, no answer of this "
                         "backup reaching it within its lease, and goes on alone")
        j = self.journal
        follows = self.follower is not None and self.role in ("joining", "backup", "dropped")
        return pb.ReplicaStatusReply(role=self.reported_role(), primary=self.primary,
                                     backup=j.backup, seq=self.follower.applied if follows
                                     else j.seq, acked=j.acked, version=self.store.version,
                                     shard=self.store.layout.shard, failovers=self.failovers,
                                     term=j.term)

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(REPLICATION, {
            "Replicate": grpc.stream_stream_rpc_method_handler(self.Replicate),
            "ReplicaStatus": grpc.unary_unary_rpc_method_handler(
                self.ReplicaStatus, request_deserializer=pb.ReplicaStatusRequest.FromString,
                response_serializer=pb.ReplicaStatusReply.SerializeToString),
        })


class Gate(grpc.ServerInterceptor):
    """Workers' calls: refused (UNAVAILABLE, so that workers try the other replica) where
    this daemon is no serving primary; on a primary every reply message that starts an
    answer is held until the backup applied every change made so far (a pull's chunks
    and trailer follow their header without a new wait)."""

    def __init__(self, replication: Replication):
        self.r = replication

    def intercept_service(self, continuation, details):
        h = continuation(details)
        if h is None or details.method not in WORKER_METHODS:
            return h
        register = details.method.endswith("/Register")
        if h.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                self._unary(h.unary_unary, register), h.request_deserializer,
                h.response_serializer)
        if h.stream_unary:
            return grpc.stream_unary_rpc_method_handler(
                self._unary(h.stream_unary, False), h.request_deserializer, h.response_serializer)
        if h.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                self._stream(h.unary_stream), h.request_deserializer, h.response_serializer)
        return grpc.stream_stream_rpc_method_handler(
            self._stream(h.stream_stream), h.request_deserializer, h.response_serializer)

    def _admit(self, context) -> None:
        why = self.r.refusal(context)
        if why:
            context.abort(grpc.StatusCode.UNAVAILABLE, why)

    def _unary(self, method, register: bool):
        def call(request, context):
            self._admit(context)
            if register and _names_partition(request):
                context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                              "a replicated shard (--replicas 2) holds no partitions of "
                              "model-parallel worker groups")
            reply = method(request, context)
            self._held(context)
            return reply
        return call

    def _stream(self, method):
        def call(request, context):
            self._admit(context)
            replies = method(request, context)
            try:
                for message in replies:
                    if not message or message[0] >> 3 not in (wire.CHUNK, wire.TRAILER):
                        self._held(context)
                    yield message
            finally:
                replies.close()
        return call

    def _held(self, context) -> None:
        """Wait until the backup holds every change made so far (or this primary goes on
        without it); UNAVAILABLE if that never comes (it stops, or was replaced): the
        worker retries at the other replica."""
        if not self.r.journal.wait_all():
            context.abort(grpc.StatusCode.UNAVAILABLE,
                          f"shard {self.r.store.layout.shard} at {self.r.address}: no longer "
                          "the primary; try the other replica")


def worker_term(context) -> int:
    """The highest term of this shard the calling worker has seen (its wire.TERM_KEY
    metadata, pserver.worker.shard_client; 0 if it sends none)."""
    for key, value in context.invocation_metadata() or ():
        if key == wire.TERM_KEY:
            try:
                return int(value)
            except ValueError:
                return 0
    return 0


def _names_partition(raw: bytes) -> bool:
    try:
        return pb.RegisterRequest.FromString(raw).HasField("partition")
    except DecodeError:
        return False  # the servicer refuses it, naming the problem
