"""The backup's end of chain replication: it follows the primary's journal, applies each
change with the same store code in the same order, acknowledges each (and each heartbeat,
with its beat: the primary's lease), and when the primary's stream ends, breaks or goes
silent asks the primary and takes over or, dropped, rejoins it
(pserver.server.replication.primary describes the protocol, its rule of one primary and
the rejoin). It asks over the connection it follows on (`_ask`), never a new one:
where a new connection to the primary takes longer to open than a question may wait (a
proxy between the replicas, a loaded host), a question on a new connection each time goes
unanswered every time, and the backup would learn nothing: an orphan for good, or a
dropped backup waiting for its bound before it rejoins."""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from typing import TYPE_CHECKING

import grpc

from dtlab.protos import dtlab_ps_pb2 as pb
from dtlab.pserver.common import auth
from dtlab.pserver.common import codec as wire
from dtlab.pserver.common import ranges as ranges_lib
from dtlab.pserver.common.buffers import ChunkedArray
from dtlab.pserver.common.errors import PSError
from dtlab.pserver.server.replication import peer
from dtlab.pserver.server.replication.journal import APPLIED, JOIN, REPLICATION, same_run, unpack

if TYPE_CHECKING:
    from dtlab.pserver.server.replication.primary import Replication

log = logging.getLogger(__name__)


class Follower:
    """A backup's thread: joins the primary, loads its snapshot, applies its entries in
    order and acknowledges each; then takes over, or rejoins once dropped."""

    def __init__(self, r: Replication):
        self.r, self.store = r, r.store
        self.applied = 0  # the primary's last entry applied here
        self.caught_up = False  # holds the primary's snapshot
        self._stopped = threading.Event()
        self._call = None
        self._heard = time.monotonic()  # when the primary's last message came
        self._silence = ""  # why the watch cancelled the stream
        self.orphaned = False  # the primary gives no answer: a worker's call may promote
        self._asking = threading.Lock()  # one question to the primary, and its decision
        self._asked: tuple[float, pb.ReplicaStatusReply | str] = (0.0, peer.SILENT)
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
        self._status = peer.status_call(self._channel)

    def start(self) -> None:
        self._thread.start()

    def fence(self) -> None:
        """This backup was dropped (Replication.dropped): stop following at once."""
        call = self._call
        if call is not None:
            call.cancel()

    def stop(self) -> None:
        self._stopped.set()
        self.fence()
        self._thread.join(timeout=5)
        self._channel.close()

    def _run(self) -> None:
        r, cfg = self.r, self.r.cfg
        deadline = time.monotonic() + max(30.0, 10 * cfg.replica_timeout_s)
        while not self._stopped.is_set():
            if r.role == "dropped":
                self._leave("its primary dropped it")
                return
            try:
                self._follow()
                why = "its stream ended"
            except grpc.RpcError as e:
                why = self._silence or f"{e.code().name}: {e.details()}"
                if e.code() == grpc.StatusCode.FAILED_PRECONDITION and not self.caught_up:
                    r.fail(f"the primary {cfg.replica_of} refuses this backup: {e.details()}")
                    return
            except (PSError, ValueError, KeyError) as e:  # the replicas differ: no way on
                r.fail(f"shard {self.store.layout.shard}: entry {self.applied + 1} from "
                       f"{cfg.replica_of} does not apply to this backup ({e})")
                return
            if self._stopped.is_set():
                return
            if r.role == "dropped":
                self._leave(why)
                return
            if not self.caught_up:
                if time.monotonic() > deadline:
                    r.fail(f"could not join the primary {cfg.replica_of} as its backup: {why}")
                    return
                log.info("joining %s: %s; trying again", cfg.replica_of, why)
                self._stopped.wait(0.5)
                continue
            self._decide(why)
            return

    def _decide(self, why: str) -> None:
        """The primary's stream is over: a primary that answers keeps its role (this backup
        was dropped: it leaves); one that stops or was replaced is taken over from at once,
        and so is one with nothing on its port if this backup ran all along since a lease
        before it last heard from it (else that primary may have gone on alone while this
        backup was paused: what it heard after a pause was sent before it); otherwise this
        backup is an orphan (`_orphan`)."""
        r, primary, shard = self.r, self.r.cfg.replica_of, self.store.layout.shard
        log.warning("shard %d: lost the primary %s (%s): asking it", shard, primary, why)
        answer = self._ask()
        unpaused = r.pauses.ran_since(self._heard - r.cfg.replica_timeout_s)
        if not self._act(answer, why, takes_gone=unpaused):
            self._orphan(why)
        if r.role == "dropped":
            self._leave(why)

    def _ask(self) -> pb.ReplicaStatusReply | str:
        """The primary's ReplicaStatus (or peer.SILENT, peer.GONE), asked on this follower's
        channel (its connection, open since the join or opened again at its reconnect
        pace) and kept with its time for `take_over`."""
        r = self.r
        answer = peer.ask(r.cfg.replica_of, self._metadata, r.ask_timeout, status=self._status)
        self._asked = (time.monotonic(), answer)
        return answer

    def _act(self, answer: pb.ReplicaStatusReply | str, why: str, takes_gone: bool) -> bool:
        """On the primary's answer: one that is primary (or isolated) drops this backup; one
        that stops or was replaced is taken over from; nothing on its port is, if
        `takes_gone`. False: no decision (silence, or gone and not `takes_gone`)."""
        r = self.r
        if isinstance(answer, pb.ReplicaStatusReply):
            if answer.role in ("primary", "isolated"):
                r.dropped(f"{why}; the primary answers as {answer.role} (term {answer.term})")
            else:
                r.promote(f"{why}; it answers as {answer.role}")
            return True
        if answer == peer.GONE and takes_gone:
            r.promote(f"{why}; nothing listens on its port")
            return True
        return False

    def _orphan(self, why: str) -> None:
        """The primary gives no answer (paused, or cut off from this backup), or is gone
        after this backup was paused: this backup takes over only when a worker asks it
        (`take_over`: the worker found the primary silent too), and is dropped once the
        primary answers (it goes on alone, or will). Until then it asks the primary every
        quarter of the timeout. Nothing listening on the primary's port changes nothing
        here: a primary that went on alone before it died holds pushes this backup lacks,
        which a worker's term tells (`take_over`)."""
        r, shard = self.r, self.store.layout.shard
        self.orphaned = True
        r.orphaned()
        found = "gives no answer" if self._asked[1] == peer.SILENT else \
            "is gone, and this backup was paused since it last heard from it"
        log.warning("shard %d: the primary %s %s (%s): this backup takes over when a "
                    "worker asks it", shard, r.cfg.replica_of, found, why)
        while not self._stopped.wait(r.cfg.replica_timeout_s / 4) and r.role == "backup":
            with self._asking:
                if r.role == "backup":
                    self._act(self._ask(), why, takes_gone=False)
        self.orphaned = False

    def take_over(self, worker_term: int) -> str:
        """A worker asks this orphaned backup to take over: "" once it did (or the
        question is moot: it was dropped meanwhile); else why not now. It does where the
        worker has seen no term of this shard above this backup's (a higher one: its
        primary went on without it, so acknowledged pushes are missing here) and the
        primary, asked again, is gone (nothing on its port) or still gives no answer after
        --replica-timeout-s of silence (the primary's lease)."""
        r = self.r
        term = r.journal.term
        if worker_term > term:
            return (f"the worker saw term {worker_term} of this shard, this backup holds "
                    f"term {term}: its primary went on without it, so acknowledged pushes "
                    "are missing here; it does not take over")
        if not self._asking.acquire(timeout=4 * r.ask_timeout):
            return "it is asking its primary"
        try:
            if r.role != "backup" or not self.orphaned:
                return ""
            when, answer = self._asked
            if time.monotonic() - when > r.cfg.replica_timeout_s / 4:
                answer = self._ask()
            quiet = time.monotonic() - self._heard
            if answer == peer.SILENT and quiet < r.cfg.replica_timeout_s:
                return f"it heard its primary {quiet:.2f} s ago, within the primary's lease"
            if not self._act(answer, "a worker asks this backup to take over", takes_gone=True):
                r.promote(f"no word from it for {quiet:.1f} s, it gives no answer, and a "
                          "worker asks this backup to take over")
            return ""
        finally:
            self._asking.release()

    def _leave(self, why: str) -> None:
        """Dropped: stay (answering "dropped" to the primary) until the primary goes on in a
        higher term, is gone or is no primary (bounded), then rejoin it: the daemon starts
        again as its backup, from its snapshot. `why`: how this follower ended; the line
        says why it was dropped (Replication.dropped's reason) where that is known.

        It waits so that the primary, deciding about it, hears "dropped" in its term here,
        not a fresh daemon on this port (which it could not tell from a backup that took
        over and restarted: it would stop). The primary answers on the follower's channel
        (`_ask`) within milliseconds, so the bound is reached only if it gives no
        answer all along (paused or cut off, a second fault)."""
        r, primary = self.r, self.r.cfg.replica_of
        limit = time.monotonic() + max(10.0, 10 * r.cfg.replica_timeout_s)
        while not self._stopped.is_set() and time.monotonic() < limit:
            answer = self._ask()
            if answer == peer.GONE or (isinstance(answer, pb.ReplicaStatusReply) and (
                    answer.term > r.journal.term or answer.role not in ("primary",
                                                                        "isolated"))):
                break
            self._stopped.wait(r.cfg.replica_timeout_s / 4)
        if not self._stopped.is_set():
            r.rejoin(primary, f"shard {self.store.layout.shard}: dropped as the backup of "
                              f"{primary}: {r.drop_reason or why}")

    def _follow(self) -> None:
        r, store = self.r, self.store
        lay = store.layout
        up: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        up.put(wire.wrap(JOIN, pb.ReplicaJoin(
            shard=lay.shard, num_shards=lay.num_shards, model=lay.model,
            model_size=lay.model_size, layout_crc32=lay.layout_crc, address=r.address,
            config=json.dumps(same_run(r.config)))))
        self._call = call = self._replicate(iter(up.get, None), metadata=self._metadata)
        self._heard, self._silence = time.monotonic(), ""
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
                        if not self._load(bytes(snapshot), expect):
                            return  # dropped while it joined
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
                elif kind == "heartbeat":  # answered with its beat: the primary's lease
                    if value.term != r.journal.term:
                        raise PSError(f"a heartbeat of term {value.term}; this backup "
                                      f"follows term {r.journal.term}")
                    up.put(wire.wrap(APPLIED, pb.ReplicaApplied(
                        seq=self.applied, term=value.term, beat=value.beat)))
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

    def _load(self, data: bytes, expect: pb.ReplicaState) -> bool:
        """The primary's snapshot into the store; False if this backup was dropped first."""
        if wire.adler32(data) != expect.adler32:
            raise PSError(f"the primary's snapshot fails its Adler-32 ({len(data)} bytes)")
        state = unpack(data)
        store = self.store
        with store.locked():
            store.load_state(state)
            for w, registration in state["registrations"].items():
                store.clocks.workers[w].registration = registration
        self.applied, self.caught_up = expect.seq, True
        if not self.r.joined(expect.term):
            return False
        log.info("shard %d: backup of %s from version %d (entry %d, term %d)",
                 self.store.layout.shard, self.r.cfg.replica_of, self.store.version,
                 expect.seq, expect.term)
        return True

    def _done(self, seq: int, up: queue.SimpleQueue) -> None:
        if seq != self.applied + 1:
            raise PSError(f"entry {seq} after entry {self.applied}: entries lost or reordered")
        self.applied = seq
        up.put(wire.wrap(APPLIED, pb.ReplicaApplied(seq=seq, term=self.r.journal.term)))

    def _watch(self, call) -> None:
        """Cancels the stream once the primary has said nothing for --replica-timeout-s."""
        limit = self.r.cfg.replica_timeout_s
        while self._call is call and not self._stopped.is_set():
            if time.monotonic() - self._heard > limit:
                self._silence = f"no word from the primary for {limit:.1f} s"
                log.warning("no word from the primary %s for %.1f s", self.r.cfg.replica_of,
                            limit)
                call.cancel()
                return
            self._stopped.wait(limit / 8)
