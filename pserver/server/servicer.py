"""The gRPC methods of dtlab.ps.v1.ParameterServer over one ShardStore.

Requests arrive as raw bytes (identity deserializers) and are decoded here,
so a malformed message becomes INVALID_ARGUMENT with a message instead of
gRPC's generic deserialization error, and a pushed gradient is never copied:
its chunks stay in the received messages (pserver.common.buffers.ChunkedArray) and the
optimizer reads them there. The store speaks arrays and numbers; the
protobuf replies are built here. A push is validated in full before the
store sees it (pserver.server.push_checks); pulls and pushes may also arrive
one after another on a worker's Session stream (pserver.server.session_stream),
and there through a shared-memory segment (pserver.server.shm_session).

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
session counts from its first operation to its end.
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
from dtlab.pserver.common import buffers, compressed, runconfig
from dtlab.pserver.common import codec as wire
from dtlab.pserver.common.errors import FailedPrecondition, InvalidArgument, PSError
from dtlab.pserver.server import push_checks
from dtlab.pserver.server.session_stream import SessionStream
from dtlab.pserver.server.shm_session import boot_id
from dtlab.pserver.server.stats_reply import CONSISTENCY, stats_reply
from dtlab.pserver.server.step_times import StepTimes
from dtlab.pserver.server.store import PushResult, Read, ShardStore

log = logging.getLogger(__name__)

# the version of the model's arithmetic Describe names (protos/dtlab_ps.proto, "The model's
# arithmetic"): a change of element order, layers, loss or clipping gets a new one
ARITHMETIC = "dtlab-arithmetic/1"
LAYOUT_CRC_RULE = ("CRC-32 (zlib's crc32: ISO-HDLC) of the UTF-8 bytes of layout_crc32_input: "
                   "name:d0xd1x... of every tensor in flat order (a scalar's shape is empty), "
                   "joined by ';'")


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
        self.shm, self.codec, self.boot_id = shm, codec, shm and boot_id()
        lay = store.layout
        self.meta = pb.TensorMeta(dtype=wire.dtype_code(store.params.dtype), shape=[lay.length],
                                  offset=lay.offset)
        self._busy = 0  # operations in progress, on calls and sessions
        self.step_times = StepTimes()  # the workers' reported step times (--dylu)
        self._busy_lock = threading.Lock()

    def fail(self, context, err: PSError):
        """Counts the refusal (StatsReply.rejected) and ends the call with its status."""
        self.store.reject(err.reason)
        log.debug("%s: %s", err.status, err)
        context.abort(grpc.StatusCode[err.status], str(err))

    @property
    def term(self) -> int:
        """The replication term every reply carries (the primary's, with --replicas 2: its
        journal's; 0 without replicas)."""
        journal = self.store.journal
        return 0 if journal is None else journal.term

    def push_reply(self, r: PushResult) -> pb.PushReply:
        return pb.PushReply(duplicate=r.duplicate, staleness=r.staleness, version=r.version,
                            pending=r.pending, lr=r.lr, term=self.term,
                            fastest_step_s=self.step_times.fastest())

    def _meta(self, version: int) -> pb.TensorMeta:
        meta = pb.TensorMeta()
        meta.CopyFrom(self.meta)
        meta.version = version
        return meta

    @contextlib.contextmanager
    def operation(self) -> Iterator[None]:
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

    def identify(self, worker: int, registration: int) -> None:
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
            self.fail(context, e)

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
            self.fail(context, e)
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
            self.identify(req.worker_id, req.registration)
            self.store.deregister(req.worker_id, req.registration, leaves=True)
        except PSError as e:
            self.fail(context, e)
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

    def read_pull(self, req: pb.PullRequest, context, timeout: float | None) -> Read:
        """The version `req` reads (its shard and dtype checked first), by the store's read
        rules and waits; for a half dtype, the values rounded once from the float32 shard."""
        if req.shard != self.store.layout.shard:
            raise InvalidArgument(f"shard {req.shard}: this server holds shard "
                                  f"{self.store.layout.shard}", reason="shard")
        known = req.known_version if req.HasField("known_version") else None
        code = push_checks.wire_code(req.dtype or self.meta.dtype, "dtype", self.meta,
                                     self.store.layout.shard)
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

    def pull_header(self, read: Read, code: int = 0) -> pb.PullHeader:
        meta = self._meta(read.version)
        meta.dtype = code or meta.dtype
        return pb.PullHeader(meta=meta, not_modified=read.tensor is None, term=self.term)

    def pull_stream(self, read: Read, whole_bytes: int = 0, code: int = 0) -> Iterator[bytes]:
        """Header, chunks, trailer; or the header alone (not modified); or, on a session
        that allows `whole_bytes`, a tensor of one chunk in one SessionReply.pulled_whole.
        `code`: the dtype the pull asked for (0: the shard's)."""
        try:
            tensor = read.tensor
            if tensor is None:
                yield wire.header_message(self.pull_header(read, code))
            elif tensor.one_chunk and tensor.nbytes <= whole_bytes:
                yield tensor.whole(pb.SessionReply, "pulled_whole", self.pull_header(read, code),
                                   self.codec)
            else:
                yield from tensor.stream(self.pull_header(read, code), self.codec)
        finally:
            self.store.release(read)

    def Pull(self, raw: bytes, context) -> Iterator[bytes]:
        with self.operation(), contextlib.ExitStack() as live:
            try:
                req = wire.parse(pb.PullRequest, memoryview(raw))
                self.identify(req.worker_id, req.registration)
                live.enter_context(self.store.holding(req.worker_id, req.registration))
                context.add_callback(self.store.wake)
                read = self.read_pull(req, context, context.time_remaining())
            except PSError as e:
                self.fail(context, e)
            yield from self.pull_stream(read, code=req.dtype)

    # -- push -----------------------------------------------------------------------------

    def handle_push(self, h: pb.PushHeader, receive: Callable[..., buffers.ChunkedArray],
                    skip: Callable[[], None] = lambda: None, hold: bool = False) -> PushResult:
        """A push whose header is `h`: `receive(grad)` fills the empty gradient `grad` (of
        the shard, of the header's ranges, or a compressed push's bytes) and checks it in
        full, `skip()` passes over what a duplicate still sends; `hold`: the push's own
        call holds its worker's registration (a session holds it throughout). A compressed
        push is decoded (pserver.common.compressed) into the values of the ranges its
        indices make, or a dense gradient."""
        self.identify(h.worker_id, h.registration)  # (a session's holder did already)
        with (self.store.holding(h.worker_id, h.registration) if hold
              else contextlib.nullcontext()):
            push_checks.check_header(h, self.meta, self.store.layout)
            ranges = push_checks.push_ranges(h, self.store.layout.length)
            self.step_times.report(h)
            result = self.store.admit(h.worker_id, h.step, h.meta.version)
            if result is not None:
                skip()
                return result
            with self.store.receiving():
                t0 = time.perf_counter()
                grad = receive(push_checks.empty_gradient(h, ranges, self.store.layout.length,
                                                         self.store.params))
                checked_s, nbytes = grad.check_seconds, grad.nbytes
                if h.HasField("compressed"):
                    payload = np.empty(grad.size, np.uint8)
                    grad.copy_to(payload)
                    grad, ranges = compressed.decode(h.compressed, payload,
                                                     self.store.layout.length,
                                                     self.store.params.dtype)
                elif grad.dtype != self.store.params.dtype:  # a half gradient: float32 now
                    grad = push_checks.widened(grad, self.store.params.dtype)
                t1 = time.perf_counter()
                self.store.received(t1 - t0, checked_s)
                self.traced_receive(h, t0, t1)
                return self.store.push(h.worker_id, h.step, h.meta.version, grad, ranges,
                                       nbytes=nbytes)

    def traced_receive(self, h: pb.PushHeader, start: float, end: float) -> None:
        """A received push's span in the daemon's trace (--trace), if it keeps one."""
        if self.store.trace is not None:
            self.store.trace.span("receive push", start, end, "comm", worker=h.worker_id,
                                  step=h.step)

    def Push(self, requests: Iterator[bytes], context) -> pb.PushReply:
        requests = iter(requests)
        with self.operation():
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
                result = self.handle_push(
                    h, partial(push_checks.receive, self.codec, requests, pb.PushRequest, False),
                    hold=True)
            except PSError as e:
                self.fail(context, e)
            except grpc.RpcError:  # the client went away mid-stream: nothing was applied
                self.store.reject("broken")
                context.abort(grpc.StatusCode.CANCELLED, "push stream broke off; nothing applied")
        return self.push_reply(result)

    # -- session --------------------------------------------------------------------------

    def Session(self, requests: Iterator[bytes], context) -> Iterator[bytes]:
        """Pulls and pushes one after another until the worker ends the stream
        (pserver.server.session_stream)."""
        requests = iter(requests)
        context.add_callback(self.store.wake)
        yield from SessionStream(self, requests, context).run()


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
