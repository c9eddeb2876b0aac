"""A worker's Session stream: its pulls and pushes one after another on one call.

Pulls and pushes arrive on their own calls (Pull, Push) or, one after
another, on a worker's long-lived Session stream, which saves each operation
the set-up of a call: its thread hand-offs and HTTP/2 stream; there a
tensor that fits in one message may come and go as one (WholePush,
WholePull), checked by the same ChunkedArray add and finish, and a push may
carry the worker's next pull (WholePush.then_pull): the pull is read after
the push is applied, by the same store.read (read rules, waits, checks) as a
pull of its own, and both are answered in one PushPulled (through shared
memory: ShmPush.then_pull, answered by one ShmPulled; pserver.server.shm_session).
An operation that fails on a session ends the stream with the status its own
call would have ended with.

The first pull or push names the session's worker, identified as on a call of
its own, whose registration then counts as live (ShardStore.holding) from that
operation to the session's end; every later operation must name the same
worker, identified again before its fields are checked. A session the worker
ends between operations (closing it, or cancelling the call, as PSClient
does) ends quietly; one that breaks off inside a push counts as "broken".
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from functools import partial
from typing import TYPE_CHECKING

import grpc

from dtlab.protos import dtlab_ps_pb2 as pb
from dtlab.pserver.common import codec as wire
from dtlab.pserver.common.errors import InvalidArgument, PSError, Unavailable
from dtlab.pserver.server import push_checks, shm_session
from dtlab.pserver.server.shm_session import Segment
from dtlab.pserver.server.store import PushResult, Read, ShardStore

if TYPE_CHECKING:
    from dtlab.pserver.server.servicer import ParameterServerServicer

# SessionReply's oneof field numbers beyond the stream's header, chunk, trailer
PUSHED, SHM_OFFER, SHM_READY, SHM_PULLED, PUSH_PULLED = 4, 5, 6, 7, 9


class SessionStream:
    """One Session call: its requests, its worker (SessionHolder), its shared-memory
    segment, and a handler for each kind of SessionRequest that starts an operation
    (`HANDLERS`); a chunk or trailer outside a push is refused."""

    def __init__(self, servicer: ParameterServerServicer, requests: Iterator[bytes], context):
        self.servicer, self.requests, self.context = servicer, requests, context
        self.segment: Segment | None = None
        self.held = SessionHolder(servicer.store, servicer.identify)

    def run(self) -> Iterator[bytes]:
        """Every operation's replies, until the worker ends the stream."""
        servicer = self.servicer
        try:
            for raw in _until_closed(self.requests):  # ended by the worker: no break
                with servicer.operation():
                    kind, value = servicer.codec.read(pb.SessionRequest, raw)
                    if servicer.store.closed:
                        raise Unavailable("server is shutting down", reason="shutdown")
                    self.held.check(kind, value)
                    handle = self.HANDLERS.get(kind)
                    if handle is None:
                        raise InvalidArgument(f"session: a {kind} outside a push",
                                              reason="order")
                    yield from handle(self, value)
        except PSError as e:
            servicer.fail(self.context, e)
        except grpc.RpcError:  # the worker went away inside a push: nothing was applied
            servicer.store.reject("broken")
            self.context.abort(grpc.StatusCode.CANCELLED, "session broke off; nothing applied")
        finally:
            self.held.close()
            if self.segment is not None:
                self.segment.close()

    def pull(self, req: pb.PullRequest) -> Iterator[bytes]:
        read = self.servicer.read_pull(req, self.context, req.wait_timeout_s or None)
        yield from self.servicer.pull_stream(read, req.whole_bytes, req.dtype)

    def push_whole(self, whole: wire.Whole) -> Iterator[bytes]:
        """A push in one message; with `then_pull`, the pull after it in the same reply."""
        servicer = self.servicer
        result = servicer.handle_push(
            whole.header,
            partial(push_checks.whole_gradient, whole, servicer.store.layout.length))
        then = whole.more.get("then_pull")
        if then is None:
            yield wire.wrap(PUSHED, servicer.push_reply(result))
        else:
            self.held.check("pull", then)
            read = servicer.read_pull(then, self.context, then.wait_timeout_s or None)
            yield from self._push_pulled(result, read, then.whole_bytes, then.dtype)

    def header(self, h: pb.PushHeader) -> Iterator[bytes]:
        """A push as header, chunks, trailer; the session's next operation follows."""
        servicer, codec = self.servicer, self.servicer.codec
        result = servicer.handle_push(
            h, partial(push_checks.receive, codec, self.requests, pb.SessionRequest, True),
            lambda: push_checks.skip(codec, self.requests, pb.SessionRequest))
        yield wire.wrap(PUSHED, servicer.push_reply(result))

    def shm_request(self, req: pb.ShmRequest) -> Iterator[bytes]:
        self.segment = shm_session.offer(self.servicer, req, self.segment)
        yield wire.wrap(SHM_OFFER, self.segment.offer() if self.segment else
                        pb.ShmOffer(refused=shm_session.refusal(self.servicer, req)))

    def shm_attach(self, req: pb.ShmAttach) -> Iterator[bytes]:
        yield wire.wrap(SHM_READY, shm_session.attach(req, self.segment))

    def shm_push(self, m: pb.ShmPush) -> Iterator[bytes]:
        """A push through the segment; with `then_pull`, the pull after it in one ShmPulled."""
        servicer = self.servicer
        if not m.HasField("then_pull"):
            result = shm_session.push(servicer, m, self.segment)
            yield wire.wrap(PUSHED, servicer.push_reply(result))
            return
        result = shm_session.push(servicer, m, self.segment, then_pull=True)
        self.held.check("shm_pull", m.then_pull)
        pulled = shm_session.pull(servicer, m.then_pull, self.segment, self.context, result)
        pulled.pushed.CopyFrom(servicer.push_reply(result))
        yield wire.wrap(SHM_PULLED, pulled)

    def shm_pull(self, req: pb.PullRequest) -> Iterator[bytes]:
        yield wire.wrap(SHM_PULLED,
                        shm_session.pull(self.servicer, req, self.segment, self.context))

    HANDLERS: dict[str, Callable[[SessionStream, object], Iterator[bytes]]] = {
        "pull": pull, "push_whole": push_whole, "header": header,
        "shm_request": shm_request, "shm_attach": shm_attach, "shm_push": shm_push,
        "shm_pull": shm_pull}

    def _push_pulled(self, result: PushResult, read: Read, whole_bytes: int,
                     code: int = 0) -> Iterator[bytes]:
        """A push's reply and the pull after it in one SessionReply.push_pulled; or, for a
        tensor that does not fit one message, pushed and then the pull's stream."""
        servicer = self.servicer
        try:
            tensor, pushed = read.tensor, servicer.push_reply(result)
            if tensor is None:
                yield wire.wrap(PUSH_PULLED, pb.PushPulled(
                    header=servicer.pull_header(read, code), pushed=pushed))
            elif tensor.one_chunk and tensor.nbytes <= whole_bytes:
                yield tensor.whole(pb.SessionReply, "push_pulled",
                                   servicer.pull_header(read, code), servicer.codec,
                                   pushed=pushed)
            else:
                yield wire.wrap(PUSHED, pushed)
                yield from tensor.stream(servicer.pull_header(read, code), servicer.codec)
        finally:
            servicer.store.release(read)


class SessionHolder:
    """A session's worker: the first pull or push names it (worker, registration), checked
    by `identify`, which then counts as live until the session ends; later operations must
    name the same."""

    def __init__(self, store: ShardStore, identify: Callable[[int, int], None]):
        self.store, self.who, self._hold = store, None, contextlib.ExitStack()
        self._identify = identify

    def check(self, kind: str, value) -> None:
        if kind in ("pull", "shm_pull"):
            who = (value.worker_id, value.registration)
        elif kind in ("header", "shm_push", "push_whole"):
            h = value if kind == "header" else value.header
            who = (h.worker_id, h.registration)
        else:
            return
        if self.who is None:
            self._identify(*who)
            self._hold.enter_context(self.store.holding(*who))
            self.who = who
        elif who != self.who:
            raise InvalidArgument(f"session of worker {self.who[0]}: an operation of worker "
                                  f"{who[0]} (registration {who[1]:#x})", reason="order")
        else:  # identity before the operation's fields, as on a call of its own
            self.store.known(*who)

    def close(self) -> None:
        self._hold.close()


def _until_closed(requests: Iterator[bytes]) -> Iterator[bytes]:
    """The messages of a stream until the client ends it, by closing its side or by
    cancelling the call (how PSClient closes a session): between operations neither is a
    break. A stream that breaks off inside a push is seen by whatever reads that push."""
    while True:
        try:
            yield next(requests)
        except (StopIteration, grpc.RpcError):
            return
