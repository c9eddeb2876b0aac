"""What travels from a shard's primary to its backup (pserver.server.replication.primary):
the journal of the store's changes in apply order, their messages, the state snapshot a
joining backup starts from, and the Replication stream's field numbers."""

from __future__ import annotations

import collections
import io
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from dtlab.protos import dtlab_ps_pb2 as pb
from dtlab.pserver.common import codec as wire
from dtlab.pserver.common import ranges as ranges_lib
from dtlab.pserver.common.buffers import ChunkedArray
from dtlab.pserver.common.ranges import Ranges

log = logging.getLogger(__name__)

REPLICATION = pb.DESCRIPTOR.services_by_name["Replication"].full_name


# ReplicaDown's and ReplicaUp's oneof field numbers
ENTRY, STATE, STATE_PART, HEARTBEAT = 4, 5, 6, 7


JOIN, APPLIED = 1, 2


KINDS = {"register": pb.ReplicaEntry.REGISTER, "deregister": pb.ReplicaEntry.DEREGISTER,
         "push": pb.ReplicaEntry.PUSH}


def same_run(config: dict) -> dict:
    """What a primary and its backup must run alike, from the daemon's config record."""
    server = config.get("server", {})
    keep = ("shard", "num_shards", "dtype", "seed", "consistency", "staleness", "staleness_lr",
            "num_workers", "backup_workers", "schedule_steps", "replicas", "outer_optimizer",
            "outer_lr", "outer_momentum", "outer_period")
    return {"model_name": config.get("model_name"), "model": config.get("model"),
            "optim": config.get("optim"), "server": {k: server.get(k) for k in keep}}


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


@dataclass
class Entry:
    seq: int
    kind: str
    worker: int
    registration: int = 0
    step: int = 0
    version_read: int = 0
    grad: np.ndarray | ChunkedArray | None = None
    ranges: Ranges | None = None  # a ranged push's shard ranges (pserver.common.ranges)


class Journal:
    """The changes of a store in the order it made them, kept while a backup is attached
    until it applied them, and when this primary may answer workers. The store calls
    register/deregister/push under its lock.

    The lease: a backup takes over only after it heard nothing from its primary for
    `timeout` s, and it answers each heartbeat with the heartbeat's beat (when it was
    sent, on this clock). So until beat + `timeout` of the last heartbeat answered the
    backup has not taken over, and this primary answers (a push acknowledged, a pull
    served) only within that lease (`answering`). Before the backup can hold the whole
    snapshot it cannot take over at all (`whole`).

    A backup that is lost (its stream broke, or its lease ran out) is handed to
    `on_lost(link, why)`, which decides: `drop` (it never takes over: this primary goes
    on alone, in a new term) or `refuse` (it took over, or this primary stops: no reply
    that waits goes out, ever). Until then nothing goes out either: the replies wait
    (`wait_all`), for a second or so."""

    def __init__(self, timeout: float, on_lost: Callable[[int, str], None]):
        self.timeout, self.on_lost = timeout, on_lost
        self._cond = threading.Condition()  # reentrant
        self.seq = 0  # the last change made
        self.acked = 0  # the last change the backup applied (all of them, with no backup)
        self._entries: collections.deque[Entry] = collections.deque()
        self.term = 0  # the configuration: 1 for a new primary; a backup takes its primary's
        self.backup = ""  # the attached backup's address, "" for none
        self.link = 0  # which attachment the entries and acks belong to
        self.lost = 0  # a link whose backup is lost, being decided on
        self.whole = False  # the link's backup may hold the whole snapshot
        self.refusing = False  # no reply waiting for the backup goes out any more
        self._lease = 0.0  # until when (monotonic) the backup has surely not taken over

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
                if not self.refusing:  # alone: held by this store only, as it is
                    self.acked = self.seq
                return
            self._entries.append(Entry(self.seq, kind, worker, registration, step,
                                       version_read, grad, ranges))
            self._cond.notify_all()

    # -- the backup's link ------------------------------------------------------------------

    def attach(self, backup: str) -> int:
        """Keep entries from now on for `backup`; the link's number (0: there is a backup
        already). Call it with the store's lock held, and take the snapshot under the
        same hold."""
        with self._cond:
            if self.backup or self.refusing:
                return 0
            self.link += 1
            self.backup, self.whole = backup, False
            self._lease = time.monotonic() + self.timeout
            return self.link

    def attached(self, link: int) -> bool:
        return self.link == link and bool(self.backup) and self.lost != link

    def deciding(self, link: int) -> bool:
        """The backup of `link` is lost and not yet dropped, nor this primary refusing."""
        return self.link == link and bool(self.backup) and self.lost == link \
            and not self.refusing

    def snapshot_part(self, link: int, last: bool) -> bool:
        """Before the snapshot's next part goes to the backup of `link`: False if the link
        is lost (send nothing more). The backup cannot take over before it holds the last
        part, and then not before `timeout` s after it was sent."""
        with self._cond:
            if not self.attached(link):
                return False
            self._lease = max(self._lease, time.monotonic() + self.timeout)
            self.whole = self.whole or last
            return True

    def lose(self, link: int, why: str) -> None:
        """The backup of `link` is gone or silent: stop sending, let on_lost decide."""
        with self._cond:
            if not self.attached(link):
                return
            self.lost = link
            self._cond.notify_all()
        log.warning("backup %s lost: %s", self.backup, why)
        self.on_lost(link, why)

    def expire(self, link: int) -> None:
        """Lose the backup of `link` if its lease ran out."""
        with self._cond:
            late = time.monotonic() - self._lease
            if not self.attached(link) or late < 0:
                return
        self.lose(link, f"no answer for {late + self.timeout:.1f} s")

    def leased(self) -> bool:
        """Whether the lease still runs: the backup has not taken over."""
        return time.monotonic() < self._lease

    def drop(self, link: int) -> None:
        """The backup of `link` never takes over: this primary goes on alone, in a new term,
        and every change so far is held (by this store only)."""
        with self._cond:
            if not self.deciding(link):
                return
            self.backup = ""
            self._entries.clear()
            self.acked = self.seq
            self.term += 1
            self._cond.notify_all()

    def refuse(self) -> None:
        """No reply that waits goes out, ever (the daemon stops, or its backup took over)."""
        with self._cond:
            self.refusing = True
            self.lost = self.link
            self._cond.notify_all()

    def applied(self, link: int, seq: int, beat: int = 0) -> None:
        """The backup of `link` applied every change up to `seq`; `beat`: answering the
        heartbeat of that beat (ns), which renews the lease."""
        with self._cond:
            if not self.attached(link):
                return
            while self._entries and self._entries[0].seq <= seq:
                self._entries.popleft()
            self.acked = max(self.acked, min(seq, self.seq))
            if beat:
                self._lease = max(self._lease, beat / 1e9 + self.timeout)
            self._cond.notify_all()

    def after(self, link: int, sent: int, wait: float) -> list[Entry]:
        """The entries after `sent`, waiting up to `wait` s for one; [] on timeout or
        once the link is lost."""
        with self._cond:
            self._cond.wait_for(lambda: not self.attached(link) or self.seq > sent, wait)
            if not self.attached(link):
                return []
            return [e for e in self._entries if e.seq > sent]

    def answering(self) -> bool:
        """Whether a reply may go out now: alone, or within the backup's lease."""
        with self._cond:
            if self.refusing:
                return False
            return not self.backup or (self.attached(self.link) and self.leased())

    def wait_all(self) -> bool:
        """Until the backup has applied every change made so far and this primary may
        answer: True. While the backup's lease has run out, until on_lost decided (the
        reply waits: it goes out once this primary goes on alone). False where the reply
        must never go out: this primary stops or was replaced (refusing); the worker is
        refused (UNAVAILABLE) and tries the other replica, and a push it sends again is
        applied once, by its (worker, step)."""
        with self._cond:
            target = self.seq
            while not self.refusing:
                if self.acked >= target and self.answering():
                    return True
                link = self.link
                if self.backup and not self.leased() and self.attached(link):
                    self._cond.release()  # on_lost may take time; let others record
                    try:
                        self.expire(link)
                    finally:
                        self._cond.acquire()
                    continue
                left = self._lease - time.monotonic()  # > 0 while attached (else expired)
                self._cond.wait(min(self.timeout / 4, left + 1e-3) if self.attached(link)
                                else self.timeout / 4)  # deciding: until drop or refuse
            return False

    @property
    def lease_end(self) -> float:
        """Until when (monotonic) the backup has surely not taken over: `timeout` after
        the heartbeat it answered last was sent."""
        return self._lease


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
