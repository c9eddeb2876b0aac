"""Chain replication of one shard: a primary and a backup that lose no acknowledged push.

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
ShardStore.state() (the checkpoint's content) at that cut, sends it, then
every entry after the cut. Until a first backup has joined, a primary
started with --replicas 2 refuses workers (UNAVAILABLE) and its health says
NOT_SERVING, so no push is ever acknowledged with one copy at the start.

Failure. The backup detects the primary's death by its stream breaking (a
killed process's connections are reset) or by hearing nothing, not even a
heartbeat, for --replica-timeout-s; if the primary's health check then
fails too, the backup takes over: it serves workers as primary (alone,
until a restarted daemon joins it with --replica-of). A backup that lost the
stream of a primary that still serves (it was dropped) exits with an error,
to be restarted and rejoin. The primary drops a backup whose stream breaks
or that applied nothing for --replica-timeout-s while it had entries, and
asks it (ReplicaStatus): if it took over, this primary was replaced, sends
none of the replies still held and exits with an error; otherwise (dead,
or still a backup) the primary goes on alone. A primary that stops
(SIGTERM) sends no held reply either: its workers get UNAVAILABLE and retry
at the backup, which takes over. Workers list each shard as PRIMARY|BACKUP and switch to the
other address on UNAVAILABLE (pserver.failover); a push retried after a
failover is applied once, by its (worker, step): if it reached the backup
before the primary died, the new primary answers it as a duplicate.

What it does not do: it has no outside arbiter (the chain master of van
Renesse and Schneider): a partition that cuts the backup from a primary
that still serves workers yet answers no health check would let both act
as primary. Replicas of model-parallel partitions and TLS between replicas
are not supported (refused at start and at Register).
"""

from __future__ import annotations

import collections
import contextlib
import io
import json
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc
import numpy as np
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dtlab.protos import dtlab_ps_pb2 as pb
from dtlab.pserver import auth, wire
from dtlab.pserver import ranges as ranges_lib
from dtlab.pserver.config import ServerConfig
from dtlab.pserver.errors import PSError
from dtlab.pserver.ranges import Ranges
from dtlab.pserver.store import ShardStore
from dtlab.pserver.wire import ChunkedArray

log = logging.getLogger(__name__)

REPLICATION = pb.DESCRIPTOR.services_by_name["Replication"].full_name
# ReplicaDown's and ReplicaUp's oneof field numbers
ENTRY, STATE, STATE_PART, HEARTBEAT = 4, 5, 6, 7
JOIN, APPLIED = 1, 2
# the calls of workers, held back on a backup and until the backup holds every change
WORKER_METHODS = frozenset(f"/{wire.SERVICE}/{m}" for m in
                           ("Register", "Deregister", "Pull", "Push", "Session"))
KINDS = {"register": pb.ReplicaEntry.REGISTER, "deregister": pb.ReplicaEntry.DEREGISTER,
         "push": pb.ReplicaEntry.PUSH}


def same_run(config: dict) -> dict:
    """What a primary and its backup must run alike, from the daemon's config record."""
    server = config.get("server", {})
    keep = ("shard", "num_shards", "dtype", "seed", "consistency", "staleness", "staleness_lr",
            "num_workers", "schedule_steps", "replicas")
    return {"model_name": config.get("model_name"), "model": config.get("model"),
            "optim": config.get("optim"), "server": {k: server.get(k) for k in keep}}


# -- the state, packed ----------------------------------------------------------------------


def pack(state: dict) -> bytes:
    """ShardStore.state() (and "registrations": the client process holding each worker
    id) as one .npz: its arrays, and the rest as JSON."""
    arrays = {"params": state["params"]}
    opt = {}
    for k, v in state["optimizer"].items():
        if isinstance(v, np.ndarray):
            arrays[f"opt.{k}"] = v
        else:
            opt[k] = v
    meta = {"version": state["version"], "optimizer": opt,
            "workers": {str(w): s for w, s in state["workers"].items()},
            "registrations": {str(w): r for w, r in state.get("registrations", {}).items()},
            "staleness": state["staleness"], "round": None}
    if state["round"]:
        arrays["round"] = state["round"]["total"]
        meta["round"] = {str(w): list(c) for w, c in state["round"]["contributors"].items()}
    buf = io.BytesIO()
    np.savez(buf, meta=np.frombuffer(json.dumps(meta).encode(), np.uint8), **arrays)
    return buf.getvalue()


def unpack(data: bytes) -> dict:
    """The state `pack` packed, as ShardStore.load_state takes it."""
    with np.load(io.BytesIO(data), allow_pickle=False) as z:
        meta = json.loads(z["meta"].tobytes())
        opt = {**meta["optimizer"], **{k[4:]: z[k] for k in z.files if k.startswith("opt.")}}
        pending = None
        if meta["round"]:
            pending = {"total": z["round"], "contributors": {
                int(w): tuple(c) for w, c in meta["round"].items()}}
        return {"version": meta["version"], "params": z["params"], "optimizer": opt,
                "workers": {int(w): s for w, s in meta["workers"].items()},
                "registrations": {int(w): r for w, r in meta["registrations"].items()},
                "staleness": meta["staleness"], "round": pending}


# -- the primary's journal ------------------------------------------------------------------


@dataclass
class Entry:
    seq: int
    kind: str
    worker: int
    registration: int = 0
    step: int = 0
    version_read: int = 0
    grad: np.ndarray | ChunkedArray | None = None
    ranges: Ranges | None = None  # a ranged push's shard ranges (pserver.ranges)


class Journal:
    """The changes of a store in the order it made them, kept while a backup is attached
    until it applied them. The store calls register/deregister/push under its lock.

    A backup that is lost (its stream broke, or it applied nothing for `timeout` s while
    it had changes to apply) is handed to `on_lost(link, why)`, which decides with
    `drop`: alone (the backup is dead: waiting replies go out, the primary holds every
    change by itself) or not (this primary was replaced or stops: they never go out)."""

    def __init__(self, timeout: float, on_lost: Callable[[int, str], None]):
        self.timeout, self.on_lost = timeout, on_lost
        self._cond = threading.Condition()  # reentrant
        self.seq = 0  # the last change made
        self.acked = 0  # the last change the backup applied (all of them, with no backup)
        self._entries: collections.deque[Entry] = collections.deque()
        self.backup = ""  # the attached backup's address, "" for none
        self.link = 0  # which attachment the entries and acks belong to
        self.lost = 0  # a link whose backup is lost, being decided on
        self.refusing = False  # no reply waiting for the backup goes out any more
        self._progress = time.monotonic()  # when the backup last applied something

    # -- recording (the store's lock held) --------------------------------------------------

    def register(self, worker: int, registration: int) -> None:
        self._record("register", worker, registration)

    def deregister(self, worker: int, registration: int) -> None:
        self._record("deregister", worker, registration)

    def push(self, worker: int, step: int, version_read: int,
             grad: np.ndarray | ChunkedArray, ranges: Ranges | None = None) -> None:
        if isinstance(grad, np.ndarray) and self.backup:
            grad = grad.copy()  # a shared-memory segment's view: the worker reuses it
        self._record("push", worker, 0, step, version_read, grad, ranges)

    def _record(self, kind: str, worker: int, registration: int = 0, step: int = 0,
                version_read: int = 0, grad=None, ranges: Ranges | None = None) -> None:
        with self._cond:
            self.seq += 1
            if not self.backup:
                self.acked = self.seq
                return
            if not self._entries:
                self._progress = time.monotonic()
            self._entries.append(Entry(self.seq, kind, worker, registration, step,
                                       version_read, grad, ranges))
            self._cond.notify_all()

    # -- the backup's link ------------------------------------------------------------------

    def attach(self, backup: str) -> int:
        """Keep entries from now on for `backup`; the link's number (0: there is a backup
        already). Call it with the store's lock held, and take the snapshot under the
        same hold."""
        with self._cond:
            if self.backup:
                return 0
            self.link += 1
            self.backup, self._progress = backup, time.monotonic()
            return self.link

    def attached(self, link: int) -> bool:
        return self.link == link and bool(self.backup) and self.lost != link

    def lose(self, link: int, why: str) -> None:
        """The backup of `link` is gone or stuck: stop sending, let on_lost decide."""
        with self._cond:
            if not self.attached(link):
                return
            self.lost = link
            self._cond.notify_all()
        log.warning("backup %s lost: %s", self.backup, why)
        self.on_lost(link, why)

    def drop(self, link: int, alone: bool) -> None:
        with self._cond:
            if link != self.link or not self.backup:
                return
            self.backup = ""
            self._entries.clear()
            if alone:
                self.acked = self.seq
            else:
                self.refusing = True
            self._cond.notify_all()

    def refuse(self) -> None:
        """Replies not yet held by the backup never go out (the daemon stops)."""
        with self._cond:
            self.refusing = True
            self.lost = self.link
            self._cond.notify_all()

    def applied(self, link: int, seq: int) -> None:
        with self._cond:
            if link != self.link or not self.backup:
                return
            while self._entries and self._entries[0].seq <= seq:
                self._entries.popleft()
            self.acked = max(self.acked, min(seq, self.seq))
            self._progress = time.monotonic()
            self._cond.notify_all()

    def after(self, link: int, sent: int, wait: float) -> list[Entry]:
        """The entries after `sent`, waiting up to `wait` s for one; [] on timeout or
        once the link is lost."""
        with self._cond:
            self._cond.wait_for(lambda: not self.attached(link) or self.seq > sent, wait)
            if not self.attached(link):
                return []
            return [e for e in self._entries if e.seq > sent]

    def wait_all(self) -> bool:
        """Until the backup has applied every change made so far: True; False if it
        never will and the reply must not go out (refusing)."""
        with self._cond:
            target = self.seq
            while self.acked < target and not self.refusing:
                link = self.link
                stalled = time.monotonic() - self._progress
                if self.attached(link) and stalled > self.timeout:
                    self._cond.release()  # on_lost may take time; let others record
                    try:
                        self.lose(link, f"applied nothing for {stalled:.1f} s")
                    finally:
                        self._cond.acquire()
                    continue
                self._cond.wait(max(0.01, self.timeout - stalled))
            return self.acked >= target


def entry_messages(entry: Entry, layout_shard: int, meta: pb.TensorMeta,
                   chunk_bytes: int) -> Iterator[bytes]:
    """One journal entry as ReplicaDown messages: the entry, and for a push its
    header, chunks (from the gradient where it was received) and trailer."""
    yield wire.wrap(ENTRY, pb.ReplicaEntry(seq=entry.seq, kind=KINDS[entry.kind],
                                           worker_id=entry.worker,
                                           registration=entry.registration))
    if entry.kind != "push":
        return
    m = pb.TensorMeta()
    m.CopyFrom(meta)
    m.version = entry.version_read
    header = pb.PushHeader(worker_id=entry.worker, step=entry.step, shard=layout_shard, meta=m)
    if entry.ranges is not None:
        header.ranges.CopyFrom(ranges_lib.encode(entry.ranges))
    yield wire.header_message(header)
    grad = entry.grad
    pieces = zip(grad.starts, grad.pieces, strict=True) if isinstance(grad, ChunkedArray) \
        else [(0, grad)]
    checksum, count = wire.ADLER_START, 0
    for start, piece in pieces:
        piece = wire.little_endian(piece)
        raw, isz = memoryview(piece).cast("B"), piece.itemsize
        for lo, hi in wire.chunk_bounds(piece.size, isz, chunk_bytes):
            message, checksum = wire.HAND.chunk_message(start + lo, raw[lo * isz : hi * isz],
                                                        checksum)
            count += 1
            yield message
    yield wire.trailer_message(checksum, count)


# -- roles ----------------------------------------------------------------------------------


class Replication:
    """One daemon's part in its shard's chain: the Replication service, the gate on
    workers' calls, and (on a backup) the Follower of the primary.

    `fail(why)`: the daemon cannot go on (a backup dropped by a live primary, or
    one that could not join); it shuts down and exits non-zero."""

    def __init__(self, cfg: ServerConfig, store: ShardStore, config: dict):
        self.cfg, self.store, self.config = cfg, store, config
        self.journal = Journal(cfg.replica_timeout_s, self._lost_backup)
        store.journal = self.journal
        self.role = "joining" if cfg.replica_of else "primary"
        self.primary = cfg.replica_of
        self.awaiting_backup = not cfg.replica_of  # a new primary serves once backed up
        self.failovers = 0
        self.address = ""
        self.health: object | None = None
        self._health_lock = threading.Lock()
        self.fail: Callable[[str], None] = lambda why: None
        self.follower: Follower | None = None
        self.gate = Gate(self)
        self._metadata = auth.call_metadata(auth.read_token(cfg.token_file, cfg.token_env))
        lay, params = store.layout, store.params
        self.meta = pb.TensorMeta(dtype=wire.dtype_code(params.dtype), shape=[lay.length],
                                  offset=lay.offset)

    def start(self, address: str, health, fail: Callable[[str], None]) -> None:
        """Begin (a backup: join the primary), setting `health` from now on."""
        self.address, self.fail = address, fail
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
        ok = self.role == "primary" and not self.awaiting_backup
        return (health_pb2.HealthCheckResponse.SERVING if ok
                else health_pb2.HealthCheckResponse.NOT_SERVING)

    def _set_health(self) -> None:
        """The health service says what the role says now (none before start)."""
        with self._health_lock:
            if self.health is not None:
                for name in ("", wire.SERVICE):
                    self.health.set(name, self.serving())

    def refusal(self) -> str:
        """Why this daemon answers no worker now ("" if it does)."""
        shard = self.store.layout.shard
        if self.role != "primary":
            return (f"shard {shard} at {self.address} is a backup (of {self.primary}): "
                    "send to the primary")
        if self.awaiting_backup:
            return (f"shard {shard} at {self.address} waits for its backup to join "
                    f"(--replicas {self.cfg.replicas})")
        return ""

    def promote(self, why: str) -> None:
        self.role, self.failovers = "primary", self.failovers + 1
        log.warning("shard %d: primary %s is gone (%s): this backup takes over at version %d",
                    self.store.layout.shard, self.primary, why, self.store.version)
        self.primary = ""
        self._set_health()

    def stop(self) -> None:
        """The daemon stops: no more workers, and no reply the backup lacks goes out
        (a backup takes over from a primary that stops)."""
        if self.role == "primary":
            self.role = "stopping"
        self.journal.refuse()
        if self.follower is not None:
            self.follower.stop()

    def _lost_backup(self, link: int, why: str) -> None:
        threading.Thread(target=self._decide, args=(link, why), daemon=True,
                         name="ps-lost-backup").start()

    def _decide(self, link: int, why: str) -> None:
        """The backup's stream broke or stalled: if it took over, this primary was
        replaced (it stops); if it is gone, this primary goes on alone."""
        backup = self.journal.backup
        role = ""
        if self.role == "primary":
            with grpc.insecure_channel(backup) as ch:
                status = ch.unary_unary(f"/{REPLICATION}/ReplicaStatus",
                                        response_deserializer=pb.ReplicaStatusReply.FromString)
                with contextlib.suppress(grpc.RpcError):
                    role = status(b"", timeout=min(1.0, self.cfg.replica_timeout_s),
                                  metadata=self._metadata).role
        if self.role == "primary" and role != "primary":
            log.warning("shard %d: backup %s dropped (%s%s): this primary goes on alone",
                        self.store.layout.shard, backup, why,
                        f"; it answers as {role}" if role else "; it does not answer")
            self.journal.drop(link, alone=True)
            return
        self.journal.drop(link, alone=False)
        if role == "primary":
            self.role = "replaced"
            self._set_health()
            self.fail(f"shard {self.store.layout.shard}: the backup {backup} took over as "
                      "primary; this daemon stops (restart it with --replica-of "
                      f"{backup} to rejoin)")

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
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          f"shard {store.layout.shard} at {self.address} already has a backup "
                          f"({journal.backup})")
        context.add_callback(lambda: journal.lose(link, "its stream ended"))
        threading.Thread(target=self._read_acks, args=(requests, link),
                         name="ps-replica-acks", daemon=True).start()
        data = pack({**state, "registrations": held})
        log.info("shard %d: backup %s joins at version %d (entry %d, %d bytes of state)",
                 store.layout.shard, join.address, state["version"], cut, len(data))
        yield wire.wrap(STATE, pb.ReplicaState(seq=cut, nbytes=len(data),
                                               adler32=wire.adler32(data)))
        step = self.cfg.chunk_bytes
        for lo in range(0, len(data), step):
            yield wire.wrap(STATE_PART, pb.Chunk(start=lo, data=data[lo : lo + step]))
        if self.awaiting_backup:
            self.awaiting_backup = False
            self._set_health()
            log.info("shard %d: backup %s joined: serving workers", store.layout.shard,
                     join.address)
        sent, beat = cut, self.cfg.replica_timeout_s / 4
        while context.is_active() and journal.attached(link):
            entries = journal.after(link, sent, beat)
            if not entries:
                yield wire.wrap(HEARTBEAT, pb.ReplicaHeartbeat(seq=journal.seq))
            for e in entries:
                yield from entry_messages(e, store.layout.shard, self.meta, self.cfg.chunk_bytes)
                sent = e.seq

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
        try:
            for raw in requests:
                up = pb.ReplicaUp.FromString(raw)
                if up.WhichOneof("kind") == "applied":
                    self.journal.applied(link, up.applied.seq)
            why = "its stream ended"
        except (grpc.RpcError, DecodeError) as e:
            why = f"its stream broke: {e}"
        self.journal.lose(link, why)

    def ReplicaStatus(self, raw: bytes, context) -> pb.ReplicaStatusReply:
        j = self.journal
        applied = self.follower.applied if self.follower is not None and self.role != "primary" \
            else j.seq
        return pb.ReplicaStatusReply(role=self.role, primary=self.primary, backup=j.backup,
                                     seq=applied, acked=j.acked, version=self.store.version,
                                     shard=self.store.layout.shard, failovers=self.failovers)

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(REPLICATION, {
            "Replicate": grpc.stream_stream_rpc_method_handler(self.Replicate),
            "ReplicaStatus": grpc.unary_unary_rpc_method_handler(
                self.ReplicaStatus, response_serializer=pb.ReplicaStatusReply.SerializeToString),
        })


# -- the gate on workers' calls -------------------------------------------------------------


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
        why = self.r.refusal()
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
        """Wait until the backup holds every change made so far; UNAVAILABLE if it never
        will (this primary stops or was replaced: the worker retries at the backup)."""
        if not self.r.journal.wait_all():
            context.abort(grpc.StatusCode.UNAVAILABLE,
                          f"shard {self.r.store.layout.shard} at {self.r.address}: no longer "
                          "the primary; try its backup")


def _names_partition(raw: bytes) -> bool:
    try:
        return pb.RegisterRequest.FromString(raw).HasField("partition")
    except DecodeError:
        return False  # the servicer refuses it, naming the problem


# -- the backup -----------------------------------------------------------------------------


class Follower:
    """A backup's thread: joins the primary, loads its snapshot, applies its entries in
    order and acknowledges each; takes over when the primary is gone."""

    def __init__(self, r: Replication):
        self.r, self.store = r, r.store
        self.applied = 0  # the primary's last entry applied here
        self.caught_up = False  # holds the primary's snapshot
        self._stopped = threading.Event()
        self._call = None
        self._heard = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="ps-follower", daemon=True)
        cfg = r.cfg
        token = auth.read_token(cfg.token_file, cfg.token_env)
        self._metadata = auth.call_metadata(token)
        self._channel = grpc.insecure_channel(
            cfg.replica_of, options=[*wire.transport_options(cfg.max_message_bytes),
                                     ("grpc.initial_reconnect_backoff_ms", 100),
                                     ("grpc.min_reconnect_backoff_ms", 100),
                                     ("grpc.max_reconnect_backoff_ms", 1000)])
        self._replicate = self._channel.stream_stream(f"/{REPLICATION}/Replicate")
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        if self._call is not None:
            self._call.cancel()
        self._thread.join(timeout=5)
        self._channel.close()

    def _run(self) -> None:
        r, cfg = self.r, self.r.cfg
        deadline = time.monotonic() + max(30.0, 10 * cfg.replica_timeout_s)
        while not self._stopped.is_set():
            try:
                self._follow()
                why = "its stream ended"
            except grpc.RpcError as e:
                why = f"{e.code().name}: {e.details()}"
                if e.code() == grpc.StatusCode.FAILED_PRECONDITION and not self.caught_up:
                    r.fail(f"the primary {cfg.replica_of} refuses this backup: {e.details()}")
                    return
            except (PSError, ValueError, KeyError) as e:  # the replicas differ: no way on
                r.fail(f"shard {self.store.layout.shard}: entry {self.applied + 1} from "
                       f"{cfg.replica_of} does not apply to this backup ({e})")
                return
            if self._stopped.is_set():
                return
            if not self.caught_up:
                if time.monotonic() > deadline:
                    r.fail(f"could not join the primary {cfg.replica_of} as its backup: {why}")
                    return
                log.info("joining %s: %s; trying again", cfg.replica_of, why)
                self._stopped.wait(0.5)
                continue
            if self._primary_serves():
                r.fail(f"the primary {cfg.replica_of} dropped this backup ({why}): restart "
                       f"this daemon with --replica-of {cfg.replica_of} to rejoin")
            else:
                r.promote(why)
            return

    def _primary_serves(self) -> bool:
        try:
            reply = self._health.Check(health_pb2.HealthCheckRequest(service=wire.SERVICE),
                                       timeout=min(1.0, self.r.cfg.replica_timeout_s))
            return reply.status == health_pb2.HealthCheckResponse.SERVING
        except grpc.RpcError:
            return False

    def _follow(self) -> None:
        r, store = self.r, self.store
        lay = store.layout
        up: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        up.put(wire.wrap(JOIN, pb.ReplicaJoin(
            shard=lay.shard, num_shards=lay.num_shards, model=lay.model,
            model_size=lay.model_size, layout_crc32=lay.layout_crc, address=r.address,
            config=json.dumps(same_run(r.config)))))
        self._call = call = self._replicate(iter(up.get, None), metadata=self._metadata)
        self._heard = time.monotonic()
        watch = threading.Thread(target=self._watch, args=(call,), daemon=True,
                                 name="ps-follower-watch")
        watch.start()
        snapshot: bytearray | None = None
        expect: pb.ReplicaState | None = None
        entry, grad, header = None, None, None
        try:
            for raw in call:
                self._heard = time.monotonic()
                kind, value = wire.HAND.read(pb.ReplicaDown, raw)
                if kind == "state":
                    expect, snapshot = value, bytearray()
                elif kind == "state_part":
                    if snapshot is None or value.start != len(snapshot):
                        raise PSError(f"snapshot part at {value.start} out of order")
                    snapshot += value.data
                    if len(snapshot) == expect.nbytes:
                        self._load(bytes(snapshot), expect)
                        snapshot = None
                elif kind == "entry":
                    entry = value
                    if value.kind == pb.ReplicaEntry.REGISTER:
                        store.register(value.worker_id, lay.model, lay.model_size,
                                       lay.layout_crc, value.registration)
                        self._done(value.seq, up)
                    elif value.kind == pb.ReplicaEntry.DEREGISTER:
                        store.deregister(value.worker_id)
                        self._done(value.seq, up)
                elif kind == "heartbeat":
                    continue  # heard from: the watch is satisfied
                elif kind == "header":
                    if entry is None or entry.kind != pb.ReplicaEntry.PUSH:
                        raise PSError("a push's header without its entry")
                    header = value
                    ranges = ranges_lib.decode(value.ranges, lay.length) \
                        if value.HasField("ranges") else None
                    n = lay.length if ranges is None else ranges_lib.size(ranges)
                    grad = ChunkedArray(n, store.params.dtype, name="gradient")
                elif grad is None:
                    raise PSError(f"a {kind} outside a push")
                elif kind == "chunk":
                    grad.add(*value)
                elif kind == "trailer":
                    grad.finish(value)
                    store.push(header.worker_id, header.step, header.meta.version, grad,
                               ranges)
                    self._done(entry.seq, up)
                    grad = header = None
        finally:
            up.put(None)
            self._call = None

    def _load(self, data: bytes, expect: pb.ReplicaState) -> None:
        if wire.adler32(data) != expect.adler32:
            raise PSError(f"the primary's snapshot fails its Adler-32 ({len(data)} bytes)")
        state = unpack(data)
        store = self.store
        with store.locked():
            store.load_state(state)
            for w, registration in state["registrations"].items():
                store.clocks.workers[w].registration = registration
        self.applied, self.caught_up = expect.seq, True
        self.r.role = "backup"
        self.r.primary = self.r.cfg.replica_of
        log.info("shard %d: backup of %s from version %d (entry %d)", self.store.layout.shard,
                 self.r.cfg.replica_of, self.store.version, expect.seq)

    def _done(self, seq: int, up: queue.SimpleQueue) -> None:
        if seq != self.applied + 1:
            raise PSError(f"entry {seq} after entry {self.applied}: entries lost or reordered")
        self.applied = seq
        up.put(wire.wrap(APPLIED, pb.ReplicaApplied(seq=seq)))

    def _watch(self, call) -> None:
        """Cancels the stream once the primary has said nothing for --replica-timeout-s."""
        limit = self.r.cfg.replica_timeout_s
        while self._call is call and not self._stopped.is_set():
            if time.monotonic() - self._heard > limit:
                log.warning("no word from the primary %s for %.1f s", self.r.cfg.replica_of,
                            limit)
                call.cancel()
                return
            self._stopped.wait(limit / 8)
