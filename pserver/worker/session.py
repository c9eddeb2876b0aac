"""The worker's end of a Session stream (`ServerStream`): one long-lived call per shard, one
operation at a time.

A pull or push on its own call pays for the call: an HTTP/2 stream, and in
grpcio a thread for a streamed request and several thread hand-offs. A
session pays that once; each operation then costs its messages, and each
message in grpcio's stream_stream costs thread hand-offs on both ends (the
client's request-iterator thread, the channel's and the server's polling
threads, the server's handler). So a tensor that fits in one message
travels as one: a push as a WholePush (header, chunk, trailer fused), and a
pull asks (PullRequest.whole_bytes) for a WholePull answer: two messages
per operation instead of four. Bigger tensors stream as on a call. A push
may carry the worker's next pull (ShardClient.push_pull): in the WholePush
or ShmPush itself (then_pull), answered by one push_pulled or shm_pulled, so
that a round of the worker's loop is one message each way, one round trip;
or, for a streamed push, as the pull's own request sent right behind the
push's messages, so the server serves it with no round trip in between.
Requests are handed to gRPC through a queue of message iterators: an
operation puts its messages (a streamed push's chunks are made as gRPC asks
for them, as on a call), then reads its replies from the call.

A stream has no deadline of its own, so every operation gets one: the
Watchdog cancels the call of an operation that outlives it, and the
operation fails with DEADLINE_EXCEEDED. Any failure ends the session (its
stream may hold the rest of the failed operation's messages); the shard
client opens a new one for the next operation.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Iterable, Iterator

import grpc

from dtlab.protos import dtlab_ps_pb2 as pb
from dtlab.pserver.common import codec as wire
from dtlab.pserver.common import shm

log = logging.getLogger(__name__)

# SessionRequest's oneof field numbers beyond the stream's header, chunk, trailer
PULL, SHM_REQUEST, SHM_ATTACH, SHM_PUSH, SHM_PULL = 4, 5, 6, 7, 8


class StatusError(grpc.RpcError):
    """A failed call or session operation as its status code and message, which is
    also its str() (gRPC's own call errors print as a repr of the call)."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def __str__(self) -> str:
        return f"{self._code.name}: {self._details}"


class Watchdog:
    """One thread for all sessions of a client: cancels an operation past its deadline.

    Arming is an attribute store (no lock, no wake-up); the thread looks every
    `period` seconds, so an operation is cancelled within `period` of its deadline.
    """

    def __init__(self, period: float):
        self.period = period
        self.sessions: set[ServerStream] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ps-watchdog", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            now = time.monotonic()
            for s in list(self.sessions):
                deadline = s.deadline
                if deadline is not None and now > deadline:
                    s.expire()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


class ServerStream:
    """The worker's end of one shard's Session stream (the RPC of protos/dtlab_ps.proto):
    requests fed through a queue, replies read in order, one operation at a time under a
    deadline, and the shared-memory segment agreed on it. Not models/run/session.py's
    Session (a run's model, data and optimizer)."""

    def __init__(self, method, metadata, codec, watchdog: Watchdog, address: str):
        self.codec, self.address, self._watchdog = codec, address, watchdog
        self._requests: queue.SimpleQueue[Iterable[bytes] | None] = queue.SimpleQueue()
        self.call = method(self._feed(), metadata=metadata)
        self.deadline: float | None = None  # of the operation in flight (monotonic)
        self.segment: shm.Segment | None = None
        self._expired = False
        self._aborted = ""  # why another thread ended the operation (abort)
        watchdog.sessions.add(self)

    def _feed(self) -> Iterator[bytes]:
        while (messages := self._requests.get()) is not None:
            yield from messages

    def send(self, messages: Iterable[bytes]) -> None:
        self._requests.put(messages)

    def receive(self) -> Iterator[bytes]:
        """The replies, as they come (the operation reads what belongs to it)."""
        return self.call

    def next_reply(self) -> bytes:
        """The next reply message, as it came."""
        try:
            return next(self.call)
        except StopIteration:
            raise StatusError(grpc.StatusCode.UNAVAILABLE,
                               f"{self.address}: the server ended the session") from None

    def expect(self, kind: str):
        """The next reply, which must be a `kind`."""
        got, value = self.codec.read(pb.SessionReply, self.next_reply())
        if got != kind:
            raise StatusError(grpc.StatusCode.INTERNAL,
                               f"{self.address}: session answered {got}, expected {kind}")
        return value

    @contextlib.contextmanager
    def operation(self, timeout: float) -> Iterator[None]:
        """One operation under a deadline; errors come out as status errors."""
        self.deadline = time.monotonic() + timeout
        try:
            yield
        except StopIteration:
            raise StatusError(grpc.StatusCode.UNAVAILABLE,
                               f"{self.address}: the server ended the session") from None
        except grpc.RpcError as e:
            if self._aborted:
                raise StatusError(grpc.StatusCode.UNAVAILABLE,
                                   f"{self.address}: {self._aborted}") from None
            if self._expired:
                raise StatusError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                   f"{self.address}: no answer within {timeout} s") from None
            if e.code() == grpc.StatusCode.CANCELLED and not isinstance(e, StatusError):
                # cancelled by the server's side (it stopped): the operation may be retried
                raise StatusError(grpc.StatusCode.UNAVAILABLE,
                                   f"{self.address}: session cancelled ({e.details()})") from None
            raise
        finally:
            self.deadline = None

    def expire(self) -> None:
        self._expired = True
        self.call.cancel()

    def abort(self, why: str) -> None:
        """End the operation in flight from another thread: it fails with UNAVAILABLE and
        `why` (a replicated shard's client gives up on a replica that stopped answering,
        pserver.worker.failover)."""
        self._aborted = why
        self.call.cancel()

    def close(self) -> None:
        self._watchdog.sessions.discard(self)
        self._requests.put(None)
        self.call.cancel()
        if self.segment is not None:
            self.segment.close()
            self.segment = None

    # -- shared memory --------------------------------------------------------------------

    def share_memory(self, nbytes: int, partition: int | None = None) -> str:
        """Agree on a segment of `nbytes` with the server; "" if agreed, else why not.
        `partition`: a worker group's rank names its partition (the session's)."""
        boot = shm.boot_id()
        if not boot or not shm.SHM_DIR.is_dir():
            return "this host has no boot id or no /dev/shm"
        request = pb.ShmRequest(boot_id=boot)
        if partition is not None:
            request.partition = partition
        self.send((wire.wrap(SHM_REQUEST, request),))
        offer = self.expect("shm_offer")
        if not offer.path:
            return offer.refused
        segment, why = None, ""
        try:
            segment = shm.Segment.attach(offer.path, offer.size, offer.data_offset, nbytes)
            segment.unlink()  # the server unlinks it too; whoever is first
        except (OSError, ValueError) as e:
            why = f"cannot map {offer.path}: {e}"
        token = segment.token if segment is not None else b""
        self.send((wire.wrap(SHM_ATTACH, pb.ShmAttach(token=token)),))
        ready = self.expect("shm_ready")
        if ready.refused or why:
            if segment is not None:
                segment.close()
            return why or ready.refused
        self.segment = segment
        return ""
