"""The gRPC methods of dtlab.ps.v1.ParameterServer over one ShardStore.

Requests arrive as raw bytes (identity deserializers) and are decoded here,
so a malformed message becomes INVALID_ARGUMENT with a message instead of
gRPC's generic deserialization error, and a pushed gradient is never copied:
its chunks stay in the received messages (pserver.common.buffers.ChunkedArray) and the
optimizer reads them there. The store speaks arrays and numbers; the
protobuf replies are built here.

A push is validated in full before the store sees it: header (shard, dtype,
shape, offset, worker, version, and the ranges it carries if it carries
only some: pserver.common.ranges.decode), then every chunk (order, size, finite
values) as it arrives, then the trailer (count, Adler-32). Any failure, or a
stream that breaks off, drops the chunks: nothing is applied.

Pulls and pushes arrive on their own calls (Pull, Push) or, one after
another, on a worker's long-lived Session stream, which saves each operation
the set-up of a call: its thread hand-offs and HTTP/2 stream; there a
tensor that fits in one message may come and go as one (WholePush,
WholePull), checked by the same ChunkedArray add and finish, and a push may
carry the worker's next pull (WholePush.then_pull): the pull is read after
the push is applied, by the same store.read (read rules, waits, checks) as a
pull of its own, and both are answered in one PushPulled (through shared
memory: ShmPush.then_pull, answered by one ShmPulled). An operation
that fails on a session ends the stream with the status its own call would
have ended with. A session whose worker is on this host may agree on a
shared-memory segment (pserver.common.shm): then a push's gradient and a pull's
values move through the segment, with the same header, checks, Adler-32 and
(worker, step) deduplication as on the wire.

Describe answers, before any registration, what Register needs (model,
size, the parameter layout and the exact text its CRC-32 is taken of, dtype,
consistency, optimizer, the fields this server requires): the contract a
client written from protos/dtlab_ps.proto alone follows. Register checks the
worker's run config against the server's (pserver.common.runconfig) and
answers with what the server runs (optimizer, schedule, consistency), for the
worker's records, the clock it starts at among them. Taking over an idle id
needs the registration it replaces unless the server runs with
--allow-takeover; a worker that deregistered is refused every call until it
registers again (the store's to refuse). Every call naming a worker carries
its registration: 0 is refused unless the server runs with
--unchecked-registration (a registration other than the worker's is the
store's to refuse). The order in which a call's faults are refused (the
.proto's "Which refusal wins") is the order of the checks here: identity
first (registration, then the store's worker, superseded, deregistered),
then the message's fields, then its data. Every pull and push runs
while its worker's registration counts as live (ShardStore.holding); a
session counts from its first operation to its end. A session the worker
ends between operations (closing it, or cancelling the call, as PSClient
does) ends quietly; one that breaks off inside a push counts as "broken".
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from functools import partial

import grpc
import numpy as np

from dtlab.models.config import build
from dtlab.models.zoo import build_model, config_class
from dtlab.protos import dtlab_ps_pb2 as pb
from dtlab.pserver.common import buffers, compressed, runconfig, shm
from dtlab.pserver.common import codec as wire
from dtlab.pserver.common import ranges as ranges_lib
from dtlab.pserver.common.errors import (
    DataLoss,
    FailedPrecondition,
    InvalidArgument,
    PSError,
    Unavailable,
)
from dtlab.pserver.server.staleness import Histogram
from dtlab.pserver.server.store import PushResult, Read, ShardStats, ShardStore

log = logging.getLogger(__name__)

CONSISTENCY = {"asp": pb.ASP, "ssp": pb.SSP, "bsp": pb.BSP}
# the version of the model's arithmetic Describe names (protos/dtlab_ps.proto, "The model's
# arithmetic"): a change of element order, layers, loss or clipping gets a new one
ARITHMETIC = "dtlab-arithmetic/1"
LAYOUT_CRC_RULE = ("CRC-32 (zlib's crc32: ISO-HDLC) of the UTF-8 bytes of layout_crc32_input: "
                   "name:d0xd1x... of every tensor in flat order (a scalar's shape is empty), "
                   "joined by ';'")
# SessionReply's oneof field numbers beyond the stream's header, chunk, trailer
PUSHED, SHM_OFFER, SHM_READY, SHM_PULLED, PUSH_PULLED = 4, 5, 6, 7, 9


class ParameterServerServicer:
    """`config`: the daemon's config record (pserver.server.daemon.config_record: the run config
    workers are checked against, the optimizer and server flags Register reports);
    `shm`: offer co-located workers a shared-memory segment; `codec`: how chunks are
    encoded and decoded (wire.HAND, or wire.CODECS["generated"] for the benchmark)."""

    def __init__(self, store: ShardStore, max_message_bytes: int,
                 checkpoint: Callable[[], tuple[str, int]] | None = None, shm: bool = True,
                 codec: wire.HandCodec | wire.GeneratedCodec = wire.HAND,
                 config: dict | None = None):
        self.store, self.max_message_bytes, self._checkpoint = store, max_message_bytes, checkpoint
        config = config or {}
        self.run_config = runconfig.of_record(config)
        server = config.get("server", {})
        self.num_workers = server.get("num_workers", 0)
        self.optim_config = json.dumps(config.get("optim", {}), sort_keys=True)
        outer = {k: v for k, v in server.items() if k.startswith("outer_")}
        self.outer_config = json.dumps(outer, sort_keys=True) \
            if outer.get("outer_optimizer", "none") != "none" else ""
        self.check_registration = not server.get("unchecked_registration", False)
        self.allow_takeover = server.get("allow_takeover", False)
        self._record, self._description = config, None  # Describe's, made on first use
        self.shm, self.codec, self.boot_id = shm, codec, shm and _boot_id()
        lay = store.layout
        self.meta = pb.TensorMeta(dtype=wire.dtype_code(store.params.dtype), shape=[lay.length],
                                  offset=lay.offset)
        self._busy = 0  # operations in progress, on calls and sessions
        self._busy_lock = threading.Lock()

    def _fail(self, context, err: PSError):
        self.store.reject(err.reason)
        log.debug("%s: %s", err.status, err)
        context.abort(grpc.StatusCode[err.status], str(err))

    @property
    def term(self) -> int:
        """The replication term every reply carries (the primary's, with --replicas 2: its
        journal's; 0 without replicas)."""
        journal = self.store.journal
        return 0 if journal is None else journal.term

    def _reply(self, r: PushResult) -> pb.PushReply:
        return pb.PushReply(duplicate=r.duplicate, staleness=r.staleness, version=r.version,
                            pending=r.pending, lr=r.lr, term=self.term)

    def _meta(self, version: int) -> pb.TensorMeta:
        meta = pb.TensorMeta()
        meta.CopyFrom(self.meta)
        meta.version = version
        return meta

    @contextlib.contextmanager
    def _operation(self) -> Iterator[None]:
        """Counts one pull or push in progress (the daemon's shutdown waits for none)."""
        with self._busy_lock:
            self._busy += 1
        try:
            yield
        finally:
            with self._busy_lock:
                self._busy -= 1

    @property
    def busy(self) -> int:
        return self._busy

    def _identify(self, worker: int, registration: int) -> None:
        """A call naming `worker` must carry a registration (0 only where unchecked); one
        other than the worker's is refused by the store (superseded)."""
        if registration == 0 and self.check_registration:
            raise InvalidArgument(
                f"worker {worker}: registration 0: every call of a worker carries the "
                "non-zero registration it registered with (RegisterRequest.registration; "
                "a server started with --unchecked-registration accepts 0)",
                reason="registration")

    # -- unary ----------------------------------------------------------------------------

    def Describe(self, raw: bytes, context) -> pb.DescribeReply:
        try:
            return self.description()
        except PSError as e:
            self._fail(context, e)

    def description(self) -> pb.DescribeReply:
        """What a client needs to register (protos/dtlab_ps.proto, DescribeReply)."""
        if self._description is None:
            self._description = self._describe()
        reply = pb.DescribeReply()
        reply.CopyFrom(self._description)
        reply.meta.version = self.store.version
        return reply

    def _describe(self) -> pb.DescribeReply:
        rec, lay, store = self._record, self.store.layout, self.store
        if "model_name" not in rec or "model" not in rec:
            raise FailedPrecondition("this server has no model record to describe",
                                     reason="model")
        name = rec["model_name"]
        specs = build_model(name, build(config_class(name), dict(rec["model"]))).specs()
        layout, offset = [], 0
        for spec in specs:
            size = int(np.prod(spec.shape, dtype=np.int64))
            layout.append(pb.TensorLayout(name=spec.name, shape=spec.shape, offset=offset,
                                          size=size))
            offset += size
        text = ";".join(f"{t.name}:{'x'.join(map(str, t.shape))}" for t in layout)
        required = ["model", "model_size", "layout_crc32"]
        if self.check_registration:
            required.append("registration")
        if lay.shard != 0:  # shard 0 assigns an id to a worker without one
            required.append("worker_id")
        return pb.DescribeReply(
            model=lay.model, model_size=lay.model_size, layout_crc32=zlib.crc32(text.encode()),
            layout_crc32_input=text, layout_crc32_rule=LAYOUT_CRC_RULE, layout=layout,
            dtype=self.meta.dtype, consistency=CONSISTENCY[store.policy.mode],
            staleness_bound=store.policy.bound or 0,
            optimizer=rec.get("optim", {}).get("optimizer", ""), optim_config=self.optim_config,
            shard=lay.shard, num_shards=lay.num_shards, meta=self._meta(0),
            num_workers=self.num_workers, max_message_bytes=self.max_message_bytes,
            run_config=json.dumps(self.run_config, sort_keys=True),
            register_required=required, registration_checked=self.check_registration,
            arithmetic=ARITHMETIC, takeover_allowed=self.allow_takeover)

    def Register(self, raw: bytes, context) -> pb.RegisterReply:
        try:
            req = wire.parse(pb.RegisterRequest, memoryview(raw))
            given = req.worker_id if req.HasField("worker_id") else None
            if req.registration == 0 and self.check_registration:
                raise InvalidArgument(
                    "registration 0: draw a random non-zero 64-bit number once per client "
                    "process and send it on Register and on every later call (a server "
                    "started with --unchecked-registration accepts 0)", reason="registration")
            self._check_run_config(given, req.run_config)
            worker, state, version = self.store.register(
                given, req.model, req.model_size, req.layout_crc32, req.registration,
                previous=None if self.allow_takeover else req.previous_registration)
            clock, next_step = state.clock, state.next_step
        except PSError as e:
            self._fail(context, e)
        lay, store = self.store.layout, self.store
        return pb.RegisterReply(
            shard=lay.shard, num_shards=lay.num_shards, model_size=lay.model_size,
            meta=self._meta(version), consistency=CONSISTENCY[store.policy.mode],
            staleness_bound=store.policy.bound or 0, next_step=next_step,
            max_message_bytes=self.max_message_bytes, worker_id=worker,
            num_workers=self.num_workers, optim_config=self.optim_config,
            schedule_steps=store.schedule.total, staleness_lr=store.staleness_lr,
            then_pull=True, term=self.term, outer_config=self.outer_config, clock=clock)

    def _check_run_config(self, worker: int | None, text: str) -> None:
        if not text:
            return
        who = "the worker" if worker is None else f"worker {worker}"
        try:
            theirs = runconfig.parse(text)
        except ValueError as e:
            raise InvalidArgument(f"run_config of {who}: {e}", reason="config") from None
        differ = runconfig.differences(self.run_config, theirs)
        if differ:
            raise FailedPrecondition(
                f"the run config of {who} differs from shard {self.store.layout.shard}'s: "
                f"{'; '.join(differ)}. Give every process the same --config (or the same "
                "model and data flags and --seed)", reason="config")

    def Deregister(self, raw: bytes, context) -> pb.DeregisterReply:
        try:
            req = wire.parse(pb.DeregisterRequest, memoryview(raw))
            self._identify(req.worker_id, req.registration)
            self.store.deregister(req.worker_id, req.registration, leaves=True)
        except PSError as e:
            self._fail(context, e)
        return pb.DeregisterReply()

    def Stats(self, raw: bytes, context) -> pb.StatsReply:
        return self.stats()

    def stats(self) -> pb.StatsReply:
        return stats_reply(self.store.stats(), self.store)

    def SaveCheckpoint(self, raw: bytes, context) -> pb.CheckpointReply:
        if self._checkpoint is None:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                          "this server has no --checkpoint-dir")
        try:
            path, version = self._checkpoint()
        except OSError as e:
            context.abort(grpc.StatusCode.INTERNAL, f"cannot write the checkpoint: {e}")
        return pb.CheckpointReply(path=path, version=version)

    # -- pull -----------------------------------------------------------------------------

    def _read(self, req: pb.PullRequest, context, timeout: float | None) -> Read:
        if req.shard != self.store.layout.shard:
            raise InvalidArgument(f"shard {req.shard}: this server holds shard "
                                  f"{self.store.layout.shard}", reason="shard")
        known = req.known_version if req.HasField("known_version") else None
        code = self._wire_code(req.dtype or self.meta.dtype, "dtype")
        t0 = time.perf_counter()
        read = self.store.read(req.worker_id, known, timeout, alive=context.is_active)
        if self.store.trace is not None:  # the time a pull waited for its SSP / BSP turn
            self.store.trace.span("pull", t0, time.perf_counter(), "wait",
                                  worker=req.worker_id, version=read.version)
        if code == self.meta.dtype or read.tensor is None:
            return read
        try:  # a half pull: the values rounded once, into a snapshot of the pull's own
            rounded = read.tensor.rounded(wire.dtype_of(code))
        finally:
            self.store.release(read)
        rounded.readers = 1  # released like any when the pull is done
        return Read(read.version, rounded)

    def _wire_code(self, code: int, field: str) -> int:
        """`code` if values may travel as it: the shard's dtype, or a half dtype for a
        float32 shard (half the bytes; the server keeps float32)."""
        if code == self.meta.dtype or (code in wire.HALF_CODES and self.meta.dtype == pb.FLOAT32):
            return code
        raise InvalidArgument(f"{field} {_dtype_name(code)}: shard {self.store.layout.shard} "
                              f"holds {_dtype_name(self.meta.dtype)}, which travels as itself"
                              + (" or FLOAT16 / BFLOAT16" if self.meta.dtype == pb.FLOAT32
                                 else ""), reason="dtype")

    def _header(self, read: Read, code: int = 0) -> pb.PullHeader:
        meta = self._meta(read.version)
        meta.dtype = code or meta.dtype
        return pb.PullHeader(meta=meta, not_modified=read.tensor is None, term=self.term)

    def _pull_stream(self, read: Read, whole_bytes: int = 0, code: int = 0) -> Iterator[bytes]:
        """Header, chunks, trailer; or the header alone (not modified); or, on a session
        that allows `whole_bytes`, a tensor of one chunk in one SessionReply.pulled_whole.
        `code`: the dtype the pull asked for (0: the shard's)."""
        try:
            tensor = read.tensor
            if tensor is None:
                yield wire.header_message(self._header(read, code))
            elif tensor.one_chunk and tensor.nbytes <= whole_bytes:
                yield tensor.whole(pb.SessionReply, "pulled_whole", self._header(read, code),
                                   self.codec)
            else:
                yield from tensor.stream(self._header(read, code), self.codec)
        finally:
            self.store.release(read)

    def _push_pulled(self, result: PushResult, read: Read, whole_bytes: int,
                     code: int = 0) -> Iterator[bytes]:
        """A push's reply and the pull after it in one SessionReply.push_pulled; or, for a
        tensor that does not fit one message, pushed and then the pull's stream."""
        try:
            tensor, pushed = read.tensor, self._reply(result)
            if tensor is None:
                yield wire.wrap(PUSH_PULLED, pb.PushPulled(header=self._header(read, code),
                                                           pushed=pushed))
            elif tensor.one_chunk and tensor.nbytes <= whole_bytes:
                yield tensor.whole(pb.SessionReply, "push_pulled", self._header(read, code),
                                   self.codec, pushed=pushed)
            else:
                yield wire.wrap(PUSHED, pushed)
                yield from tensor.stream(self._header(read, code), self.codec)
        finally:
            self.store.release(read)

    def Pull(self, raw: bytes, context) -> Iterator[bytes]:
        with self._operation(), contextlib.ExitStack() as live:
            try:
                req = wire.parse(pb.PullRequest, memoryview(raw))
                self._identify(req.worker_id, req.registration)
                live.enter_context(self.store.holding(req.worker_id, req.registration))
                context.add_callback(self.store.wake)
                read = self._read(req, context, context.time_remaining())
            except PSError as e:
                self._fail(context, e)
            yield from self._pull_stream(read, code=req.dtype)

    # -- push -----------------------------------------------------------------------------

    def _check_header(self, h: pb.PushHeader, shm: bool = False) -> None:
        """A push's header; `shm`: the gradient is in the session's segment, which holds
        the shard's dtype (elsewhere a float32 shard takes a half gradient too)."""
        lay, want = self.store.layout, self.meta
        if h.shard != lay.shard:
            raise InvalidArgument(f"header.shard {h.shard}: this server holds shard {lay.shard}",
                                  reason="shard")
        if h.HasField("compressed"):
            compressed.check_header(h.compressed, lay.length)
            if h.meta.dtype != want.dtype:
                raise InvalidArgument(f"meta.dtype {_dtype_name(h.meta.dtype)}: a compressed "
                                      f"push to shard {lay.shard} carries its "
                                      f"{_dtype_name(want.dtype)} values", reason="dtype")
        elif not shm:
            self._wire_code(h.meta.dtype, "meta.dtype")
        elif h.meta.dtype != want.dtype:
            raise InvalidArgument(f"meta.dtype {_dtype_name(h.meta.dtype)}: shard {lay.shard} "
                                  f"holds {_dtype_name(want.dtype)}", reason="dtype")
        if list(h.meta.shape) != list(want.shape):
            raise InvalidArgument(f"meta.shape {list(h.meta.shape)}: shard {lay.shard} holds "
                                  f"{list(want.shape)}", reason="length")
        if h.meta.offset != want.offset:
            raise InvalidArgument(f"meta.offset {h.meta.offset}: shard {lay.shard} starts at "
                                  f"{want.offset}", reason="offset")

    def _ranges(self, h: pb.PushHeader) -> ranges_lib.Ranges | None:
        """The shard ranges a push carries (PushRanges, checked), None: all of the shard."""
        if not h.HasField("ranges"):
            return None
        if h.HasField("compressed"):
            raise InvalidArgument("a push carries ranges or is compressed, not both",
                                  reason="compressed")
        return ranges_lib.decode(h.ranges, self.store.layout.length)

    def _gradient(self, h: pb.PushHeader,
                  ranges: ranges_lib.Ranges | None = None) -> buffers.ChunkedArray:
        """An empty received gradient for header `h` (checked): of the pushed dtype, the
        shard's size or the ranges' (packed); or a compressed push's bytes."""
        if h.HasField("compressed"):
            n = compressed.expected_bytes(h.compressed, self.store.layout.length,
                                          self.store.params.itemsize)
            return buffers.ChunkedArray(n, np.uint8, name="compressed push")
        n = self.store.params.size if ranges is None else ranges_lib.size(ranges)
        return buffers.ChunkedArray(n, wire.dtype_of(h.meta.dtype), finite=True,
                                    name="gradient")

    def _receive(self, requests: Iterator[bytes], cls, session: bool,
                 grad: buffers.ChunkedArray) -> buffers.ChunkedArray:
        """The pushed gradient into the empty `grad`, checked in full; raises on any fault.
        On a call the trailer must be the last message; on a session the next operation
        follows it."""
        for raw in requests:
            kind, value = self.codec.read(cls, raw)
            if kind == "chunk":
                grad.add(*value)
            elif kind == "trailer":
                if not session and next(requests, None) is not None:
                    raise InvalidArgument("message after the trailer", reason="order")
                grad.finish(value)
                return grad
            else:
                raise InvalidArgument(f"{kind} inside a push stream", reason="order")
        raise DataLoss(f"push stream ended without a trailer after {grad.chunks} chunks",
                       reason="incomplete")

    def _skip(self, requests: Iterator[bytes], cls) -> None:
        """A session's duplicate push: its chunks up to the trailer are not needed."""
        for raw in requests:
            kind, _ = self.codec.read(cls, raw)
            if kind == "trailer":
                return
            if kind != "chunk":
                raise InvalidArgument(f"{kind} inside a push stream", reason="order")
        raise DataLoss("push stream ended without a trailer", reason="incomplete")

    def _whole_gradient(self, whole: wire.Whole,
                        grad: buffers.ChunkedArray) -> buffers.ChunkedArray:
        h = whole.header
        if h.HasField("compressed") and len(whole.data) != grad.nbytes:
            kind = pb.PushCompressed.Kind.Name(h.compressed.kind)
            raise InvalidArgument(f"a compressed push ({kind}, count {h.compressed.count}) "
                                  f"to a shard of {self.store.layout.length} elements carries "
                                  f"{len(whole.data)} bytes, not {grad.nbytes}",
                                  reason="compressed")
        if h.HasField("ranges") and len(whole.data) != grad.nbytes:
            raise InvalidArgument(f"a push of ranges holding {grad.size} elements carries "
                                  f"{len(whole.data)} bytes, not {grad.nbytes}", reason="ranges")
        whole.into(grad)
        return grad

    def _push(self, h: pb.PushHeader, receive: Callable[..., buffers.ChunkedArray],
              skip: Callable[[], None] = lambda: None, hold: bool = False) -> PushResult:
        """A push whose header is `h`: `receive(grad)` fills the empty gradient `grad` (of
        the shard, of the header's ranges, or a compressed push's bytes) and checks it in
        full, `skip()` passes over what a duplicate still sends; `hold`: the push's own
        call holds its worker's registration (a session holds it throughout). A compressed
        push is decoded (pserver.common.compressed) into the values of the ranges its
        indices make, or a dense gradient."""
        self._identify(h.worker_id, h.registration)  # (a session's holder did already)
        with (self.store.holding(h.worker_id, h.registration) if hold
              else contextlib.nullcontext()):
            self._check_header(h)
            ranges = self._ranges(h)
            result = self.store.admit(h.worker_id, h.step, h.meta.version)
            if result is not None:
                skip()
                return result
            with self.store.receiving():
                t0 = time.perf_counter()
                grad = receive(self._gradient(h, ranges))
                checked_s, nbytes = grad.check_seconds, grad.nbytes
                if h.HasField("compressed"):
                    payload = np.empty(grad.size, np.uint8)
                    grad.copy_to(payload)
                    grad, ranges = compressed.decode(h.compressed, payload,
                                                     self.store.layout.length,
                                                     self.store.params.dtype)
                elif grad.dtype != self.store.params.dtype:  # a half gradient: float32 now
                    grad = _widened(grad, self.store.params.dtype)
                t1 = time.perf_counter()
                self.store.received(t1 - t0, checked_s)
                self._traced_receive(h, t0, t1)
                return self.store.push(h.worker_id, h.step, h.meta.version, grad, ranges,
                                       nbytes=nbytes)

    def _traced_receive(self, h: pb.PushHeader, start: float, end: float) -> None:
        """A received push's span in the daemon's trace (--trace), if it keeps one."""
        if self.store.trace is not None:
            self.store.trace.span("receive push", start, end, "comm", worker=h.worker_id,
                                  step=h.step)

    def Push(self, requests: Iterator[bytes], context) -> pb.PushReply:
        requests = iter(requests)
        with self._operation():
            try:
                first = next(requests, None)
            except grpc.RpcError:  # cancelled before its header: no push began
                context.abort(grpc.StatusCode.CANCELLED, "push cancelled before its header")
            try:
                if first is None:
                    raise InvalidArgument("empty push stream: expected a header first",
                                          reason="order")
                kind, h = self.codec.read(pb.PushRequest, first)
                if kind != "header":
                    raise InvalidArgument("push stream must start with a header", reason="order")
                result = self._push(
                    h, partial(self._receive, requests, pb.PushRequest, False), hold=True)
            except PSError as e:
                self._fail(context, e)
            except grpc.RpcError:  # the client went away mid-stream: nothing was applied
                self.store.reject("broken")
                context.abort(grpc.StatusCode.CANCELLED, "push stream broke off; nothing applied")
        return self._reply(result)

    # -- session --------------------------------------------------------------------------

    def Session(self, requests: Iterator[bytes], context) -> Iterator[bytes]:
        """Pulls and pushes one after another until the worker ends the stream."""
        requests = iter(requests)
        context.add_callback(self.store.wake)
        segment: Segment | None = None
        held = SessionHolder(self.store, self._identify)
        try:
            for raw in _until_closed(requests):  # ended by the worker: no break
                with self._operation():
                    kind, value = self.codec.read(pb.SessionRequest, raw)
                    if self.store.closed:
                        raise Unavailable("server is shutting down", reason="shutdown")
                    held.check(kind, value)
                    if kind == "pull":
                        read = self._read(value, context, value.wait_timeout_s or None)
                        yield from self._pull_stream(read, value.whole_bytes, value.dtype)
                    elif kind == "push_whole":
                        result = self._push(value.header, partial(self._whole_gradient, value))
                        then = value.more.get("then_pull")
                        if then is None:
                            yield wire.wrap(PUSHED, self._reply(result))
                        else:
                            held.check("pull", then)
                            read = self._read(then, context, then.wait_timeout_s or None)
                            yield from self._push_pulled(result, read, then.whole_bytes,
                                                         then.dtype)
                    elif kind == "header":
                        result = self._push(
                            value, partial(self._receive, requests, pb.SessionRequest, True),
                            lambda: self._skip(requests, pb.SessionRequest))
                        yield wire.wrap(PUSHED, self._reply(result))
                    elif kind == "shm_request":
                        segment = self._offer(value, segment)
                        yield wire.wrap(SHM_OFFER, segment.offer() if segment else
                                        pb.ShmOffer(refused=self._refusal(value)))
                    elif kind == "shm_attach":
                        yield wire.wrap(SHM_READY, self._attach(value, segment))
                    elif kind == "shm_push" and value.HasField("then_pull"):
                        result = self._shm_push(value, segment, then_pull=True)
                        held.check("shm_pull", value.then_pull)
                        pulled = self._shm_pull(value.then_pull, segment, context, result)
                        pulled.pushed.CopyFrom(self._reply(result))
                        yield wire.wrap(SHM_PULLED, pulled)
                    elif kind == "shm_push":
                        yield wire.wrap(PUSHED, self._reply(self._shm_push(value, segment)))
                    elif kind == "shm_pull":
                        yield wire.wrap(SHM_PULLED, self._shm_pull(value, segment, context))
                    else:
                        raise InvalidArgument(f"session: a {kind} outside a push",
                                              reason="order")
        except PSError as e:
            self._fail(context, e)
        except grpc.RpcError:  # the worker went away inside a push: nothing was applied
            self.store.reject("broken")
            context.abort(grpc.StatusCode.CANCELLED, "session broke off; nothing applied")
        finally:
            held.close()
            if segment is not None:
                segment.close()

    # -- shared memory --------------------------------------------------------------------

    def _refusal(self, req: pb.ShmRequest) -> str:
        if not self.shm:
            return "the server runs with --no-shm"
        if not self.boot_id or req.boot_id != self.boot_id:
            return "the worker is on another host (boot ids differ)"
        return "the server could not create a segment"

    def _offer(self, req: pb.ShmRequest, current: Segment | None) -> Segment | None:
        """A new segment for a worker on this host, None where shared memory is out."""
        if current is not None:
            raise InvalidArgument("session: a second shm_request", reason="order")
        if not self.shm or not self.boot_id or req.boot_id != self.boot_id:
            return None
        try:
            return Segment(shm.Segment.create(self.store.params.nbytes))
        except OSError as e:
            log.warning("no shared-memory segment for a co-located worker: %s", e)
            return None

    def _attach(self, req: pb.ShmAttach, segment: Segment | None) -> pb.ShmReady:
        if segment is None or segment.ready:
            raise InvalidArgument("session: shm_attach without an offer", reason="order")
        segment.mapping.unlink()  # both ends hold it now, or the worker never will
        if not segment.mapping.holds(req.token):
            return pb.ShmReady(refused="wrong token: the worker mapped another segment")
        segment.ready = True
        return pb.ShmReady()

    def _shm_push(self, m: pb.ShmPush, segment: Segment | None,
                  then_pull: bool = False) -> PushResult:
        """A push from the session's segment; `then_pull`: a pull of the same segment follows,
        so the update it makes (of the whole shard) copies the new values into the segment
        as it goes (ShardStore.push's copy_to), which that pull then need not copy again."""
        if segment is None or not segment.ready:
            raise FailedPrecondition("session: shm_push before shm_attach", reason="order")
        t0 = time.perf_counter()
        h = m.header
        self._check_header(h, shm=True)
        if h.HasField("compressed"):
            raise InvalidArgument("a compressed push travels over gRPC, not through shared "
                                  "memory", reason="compressed")
        ranges = self._ranges(h)
        result = self.store.admit(h.worker_id, h.step, h.meta.version)
        if result is not None:
            return result
        with self.store.receiving():
            grad = segment.values(self.store.params)  # a ranged push: packed from its start
            grad = grad if ranges is None else grad[: ranges_lib.size(ranges)]
            t1 = time.perf_counter()
            # backward: the worker wrote the segment forward, and the optimizer reads it
            # forward next: each finds in the cache what this pass read last
            checksum, bad = buffers.checksum_and_first_nonfinite_backward(grad,
                                                                          wire.ADLER_START)
            t2 = time.perf_counter()
            if bad >= 0:
                raise InvalidArgument(f"gradient element {bad} is {grad[bad]}: non-finite "
                                      "values are rejected", reason="nonfinite")
            if checksum != m.adler32:
                raise DataLoss(f"shm_push.adler32 {m.adler32:#010x} != {checksum:#010x} "
                               "computed over the segment", reason="checksum")
            self.store.received(t2 - t0, t2 - t1)
            self._traced_receive(h, t0, t2)
            return self.store.push(h.worker_id, h.step, h.meta.version, grad, ranges,
                                   copy_to=grad if then_pull and ranges is None else None)

    def _shm_pull(self, req: pb.PullRequest, segment: Segment | None, context,
                  pushed: PushResult | None = None) -> pb.ShmPulled:
        """A pull into the session's segment; `pushed`: the push right before it on this
        session, whose update may have left this very version there already."""
        if segment is None or not segment.ready:
            raise FailedPrecondition("session: shm_pull before shm_attach", reason="order")
        if req.dtype not in (0, self.meta.dtype):
            raise InvalidArgument(f"shm_pull.dtype {_dtype_name(req.dtype)}: the segment holds "
                                  f"{_dtype_name(self.meta.dtype)}", reason="dtype")
        read = self._read(req, context, req.wait_timeout_s or None)
        try:
            if read.tensor is None:
                return pb.ShmPulled(header=self._header(read))
            if pushed is not None and pushed.copied is not None \
                    and pushed.version == read.version:  # no change since it copied them
                return pb.ShmPulled(header=self._header(read), adler32=pushed.copied)
            checksum = read.tensor.copy_into(segment.values(self.store.params))
            return pb.ShmPulled(header=self._header(read), adler32=checksum)
        finally:
            self.store.release(read)


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


class Segment:
    """A session's shared-memory segment, and whether the worker proved it mapped it."""

    def __init__(self, mapping: shm.Segment):
        self.mapping, self.ready = mapping, False

    def offer(self) -> pb.ShmOffer:
        m = self.mapping
        return pb.ShmOffer(path=str(m.path), size=m.size, data_offset=shm.DATA_OFFSET)

    def values(self, like: np.ndarray) -> np.ndarray:
        return self.mapping.array(like.dtype.newbyteorder("<"), like.size)

    def close(self) -> None:
        self.mapping.close()


def _until_closed(requests: Iterator[bytes]) -> Iterator[bytes]:
    """The messages of a stream until the client ends it, by closing its side or by
    cancelling the call (how PSClient closes a session): between operations neither is a
    break. A stream that breaks off inside a push is seen by whatever reads that push."""
    while True:
        try:
            yield next(requests)
        except (StopIteration, grpc.RpcError):
            return


def _boot_id() -> str:
    return shm.boot_id() if shm.SHM_DIR.is_dir() else ""


def _widened(grad: buffers.ChunkedArray, dtype) -> np.ndarray:
    """A received half gradient converted to the shard's dtype, in one pass."""
    out = np.empty(grad.size, dtype)
    grad.copy_to(out)
    return out


def _dtype_name(code: int) -> str:
    return pb.DType.Name(code) if code in pb.DType.values() else str(code)


def histogram(h: Histogram) -> pb.Histogram:
    return pb.Histogram(counts=dict(h.counts), total=h.total, sum=h.sum, max=h.max)


def stats_reply(s: ShardStats, store: ShardStore) -> pb.StatsReply:
    lay = store.layout
    workers = {w: pb.WorkerStats(clock=ws.clock, next_step=ws.next_step, active=ws.active,
                                 staleness=histogram(ws.staleness), expired=ws.expired,
                                 late=ws.late)
               for w, ws in s.workers.items()}
    return pb.StatsReply(
        shard=lay.shard, num_shards=lay.num_shards, consistency=CONSISTENCY[store.policy.mode],
        version=s.version, updates=s.updates, pushes=s.pushes, duplicates=s.duplicates,
        rejected=dict(s.rejected), pulls=s.pulls, pulls_not_modified=s.pulls_not_modified,
        bytes_received=s.bytes_received, bytes_sent=s.bytes_sent,
        staleness=histogram(s.staleness), workers=workers, max_clock_lead=s.max_clock_lead,
        lr=s.lr, apply_seconds=s.apply_seconds, pushes_in_flight=s.pushes_in_flight,
        receive_seconds=s.receive_seconds, check_seconds=s.check_seconds,
        workers_dropped=s.workers_dropped, late=s.late,
        expert_staleness={e: histogram(h) for e, h in s.expert_staleness.items()})


def handler(servicer: ParameterServerServicer) -> grpc.GenericRpcHandler:
    """The service's method handlers: raw bytes in, serialized protobuf out. `servicer`: a
    ParameterServerServicer, or the router over one (pserver.server.partitions.Partitions),
    whose dense servicer answers Describe (the model the server was started with)."""
    unary = {name: grpc.unary_unary_rpc_method_handler(
        getattr(servicer, name), response_serializer=lambda m: m.SerializeToString())
        for name in ("Register", "Deregister", "Stats", "SaveCheckpoint")}
    unary["Describe"] = grpc.unary_unary_rpc_method_handler(  # the dense model's, on a router
        getattr(servicer, "dense", servicer).Describe,
        response_serializer=pb.DescribeReply.SerializeToString)
    return grpc.method_handlers_generic_handler(wire.SERVICE, {
        **unary,
        "Pull": grpc.unary_stream_rpc_method_handler(servicer.Pull),
        "Push": grpc.stream_unary_rpc_method_handler(
            servicer.Push, response_serializer=pb.PushReply.SerializeToString),
        "Session": grpc.stream_stream_rpc_method_handler(servicer.Session),
    })
