"""Client for S parameter-server shards: parallel pull and push, deadlines, retries.

    client = PSClient(ClientConfig(servers="127.0.0.1:50051,127.0.0.1:50052"))
    client.connect(0, "mlp", params.size, wire.layout_crc(params.specs))  # health wait + Register
    client.connect(None, ...)            # shard 0 assigns the id (client.worker)
    client.pull(params.data)             # every shard in parallel, into the flat buffer
    replies = client.push(params.grad, step)

Shards may be listed in any order; Register tells each one's index and
element range, and `connect` checks that they tile [0, n) exactly. Without
a worker id, `connect` registers with shard 0 first, which assigns one (a
fresh id: see pserver.store), then registers that id with the other shards,
so the worker has one id everywhere. Every call carries the process's
registration number, drawn at random once per process (the clients of one
process are one worker to the servers): a second process registering the
same id is refused while this one is live, and this one's calls are refused
once another has taken the id over. A connect that fails part-way
deregisters from the shards it registered with. Pulls
land straight in the caller's flat parameter buffer (no intermediate copy);
a shard whose version has not moved answers "not modified" and sends
nothing. Every call has a deadline; only UNAVAILABLE is retried, with
exponential backoff (a push is safe to retry: the server applies each
(worker, step) once; Li et al. 2014 make the same choice in ps-lite).

Pulls and pushes travel on one long-lived Session stream per shard
(pserver.session; `transport="calls"`: a Pull or Push call each, as before
sessions). `push_pull` pushes and then pulls in one session operation (the
pull rides on the push: one round trip per shard for both; on calls, a Push
and then a Pull); a retry repeats both, the push being applied once. With
one shard the calls run on the caller's thread, not the pool's. A shard on
this host agrees on a shared-memory segment for the tensor bytes unless
`shm=False` (pserver.shm): the pushed gradient is copied into the segment
and the pulled values out of it, each with its Adler-32 in the same pass,
and gRPC carries the rest. With `wire_dtype` "fp16" or "bf16" (--wire) a
float32 model's gradients are pushed rounded to that dtype and its
parameters pulled as it (the server rounds them; it keeps float32 and
converts pushed gradients on receipt): half the bytes, over gRPC only (no
shared memory); `pushed_bytes` and `pulled_bytes` count the values' bytes.
and gRPC carries the rest.

A shard kept by a primary and a backup (`--replicas 2`) is listed as
PRIMARY|BACKUP: pserver.failover sends its calls to the primary and, when
that one is gone, to the backup that took over.
"""

from __future__ import annotations

import itertools
import json
import logging
import random
import time
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dtlab.protos import dtlab_ps_pb2 as pb
from dtlab.pserver import auth, wire
from dtlab.pserver import ranges as ranges_lib
from dtlab.pserver.config import ClientConfig
from dtlab.pserver.errors import DataLoss, InvalidArgument
from dtlab.pserver.failover import SEPARATOR, ReplicatedShard
from dtlab.pserver.ranges import Ranges
from dtlab.pserver.session import PULL, SHM_PULL, SHM_PUSH, Session, StatusError, Watchdog
from dtlab.pserver.wire import SERVICE

log = logging.getLogger(__name__)

_MAX_BACKOFF_S = 2.0
_WAIT_REPORT_S = 5.0  # a worker waiting for its servers says so this often
PROCESS_REGISTRATION = random.SystemRandom().getrandbits(64) or 1
TRANSPORTS = ("session", "calls")
# --wire: the dtype a float32 model's tensors travel as (None: their own)
WIRE_DTYPES = {"fp32": None, "fp16": np.dtype(np.float16), "bf16": wire.BFLOAT16}


def why_unreachable(e: grpc.RpcError) -> str:
    """A failed health check in a few words: "connection refused", "no answer", ..."""
    details = e.details() or ""
    for words in ("connection refused", "no route to host", "name or service not known",
                  "certificate verify failed", "handshake failed"):
        if words in details.lower():
            return words
    if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
        return "no answer"
    return f"{e.code().name}: {details}"


class ShardClient:
    """One shard's channel, calls and session."""

    def __init__(self, address: str, cfg: ClientConfig, max_message_bytes: int = 64 << 20,
                 transport: str = "session", shm: bool = True,
                 codec: wire.HandCodec | wire.GeneratedCodec = wire.HAND,
                 watchdog: Watchdog | None = None):
        if transport not in TRANSPORTS:
            raise ValueError(f"transport {transport!r}: one of {', '.join(TRANSPORTS)}")
        self.address, self.cfg = address, cfg
        self.transport, self.codec = transport, codec
        self._session: Session | None = None
        self._watchdog = watchdog
        self.shm_refused = "" if shm else "the worker runs with shm off"
        self.wire_dtype: np.dtype | None = None  # PSClient's --wire dtype, None: the shard's
        self.pushed_bytes = self.pulled_bytes = 0  # tensor bytes this shard's values took
        # a pulled tensor up to this size may come in one message (room for its header)
        self.whole_bytes = max_message_bytes - 1024
        self._metadata = auth.call_metadata(auth.read_token(cfg.token_file, cfg.token_env))
        # reconnect within ~0.1-2 s (gRPC's default backoff starts at 1 s, grows to 120 s),
        # so that retries find a restarted shard
        options = [*wire.transport_options(max_message_bytes),
                   ("grpc.initial_reconnect_backoff_ms", 100),
                   ("grpc.min_reconnect_backoff_ms", 100),
                   ("grpc.max_reconnect_backoff_ms", int(_MAX_BACKOFF_S * 1000))]
        if cfg.tls_server_name:
            options.append(("grpc.ssl_target_name_override", cfg.tls_server_name))
        if cfg.use_tls():
            creds = auth.channel_credentials(cfg.tls_ca, cfg.tls_cert, cfg.tls_key)
            self.channel = grpc.secure_channel(address, creds, options=options)
        else:
            self.channel = grpc.insecure_channel(address, options=options)
        ch, path = self.channel, f"/{SERVICE}/"
        self._register = ch.unary_unary(path + "Register", pb.RegisterRequest.SerializeToString,
                                        pb.RegisterReply.FromString)
        self._deregister = ch.unary_unary(path + "Deregister",
                                          pb.DeregisterRequest.SerializeToString,
                                          pb.DeregisterReply.FromString)
        self._stats = ch.unary_unary(path + "Stats", pb.StatsRequest.SerializeToString,
                                     pb.StatsReply.FromString)
        self._checkpoint = ch.unary_unary(path + "SaveCheckpoint",
                                          pb.CheckpointRequest.SerializeToString,
                                          pb.CheckpointReply.FromString)
        self._pull = ch.unary_stream(path + "Pull", pb.PullRequest.SerializeToString)
        self._push = ch.stream_unary(path + "Push", None, pb.PushReply.FromString)
        self._open = ch.stream_stream(path + "Session")
        self._health = health_pb2_grpc.HealthStub(ch)
        self.info: pb.RegisterReply | None = None
        self.registration = 0  # PSClient's number, sent on every call
        # a worker group's rank: its partition, named at Register and on every call
        self.partition: pb.PartitionLayout | None = None

    def _named(self, message):
        """`message` with this rank's partition id set (a group's rank), else as it is."""
        if self.partition is not None:
            message.partition = self.partition.id
        return message

    def _failed(self, e: grpc.RpcError) -> StatusError:
        """`e` as its status and message, naming this shard's address."""
        details = e.details() or ""
        if not details.startswith(self.address):
            details = f"{self.address}: {details}"
        return StatusError(e.code(), details)

    def _retry(self, attempt, what: str):
        """Run `attempt()`, retrying UNAVAILABLE with exponential backoff and jitter; a
        final failure is a StatusError naming the shard."""
        for i in range(self.cfg.retries + 1):
            try:
                return attempt()
            except grpc.RpcError as e:
                if e.code() != grpc.StatusCode.UNAVAILABLE or i == self.cfg.retries:
                    raise self._failed(e) from None
                delay = min(_MAX_BACKOFF_S, self.cfg.backoff_s * 2**i) * random.uniform(0.5, 1)
                log.info("%s %s: UNAVAILABLE (%s), retry %d in %.2f s", self.address, what,
                         e.details(), i + 1, delay)
                time.sleep(delay)
        raise AssertionError("unreachable")

    def wait_ready(self) -> None:
        """Block until the health service reports the shard SERVING (bounded); say why
        not at the first failed check and every few seconds after."""
        start = time.monotonic()
        limit = self.cfg.connect_timeout_s
        request = health_pb2.HealthCheckRequest(service=SERVICE)
        delay, last, reported = self.cfg.backoff_s, "no answer", None
        while (waited := time.monotonic() - start) < limit:
            try:
                timeout = min(2.0, self.cfg.rpc_timeout_s)
                status = self._health.Check(request, timeout=timeout).status
                if status == health_pb2.HealthCheckResponse.SERVING:
                    if reported is not None:
                        log.info("%s is serving", self.address)
                    return
                last = "not serving yet"
            except grpc.RpcError as e:
                last = why_unreachable(e)
            waited = time.monotonic() - start
            if reported is None or waited - reported >= _WAIT_REPORT_S:
                log.info("waiting for %s (%s), %.0f s of %g", self.address, last, waited, limit)
                reported = waited
            time.sleep(min(delay, max(0.0, limit - waited)))
            delay = min(_MAX_BACKOFF_S, delay * 2)
        raise TimeoutError(f"{self.address}: not serving after {limit:g} s ({last}); is the "
                           "server started, and is the address right?")

    def register(self, worker: int | None, model: str, model_size: int, layout_crc: int,
                 run_config: str = "") -> pb.RegisterReply:
        """Register `worker`, or (None) ask this shard to assign an id."""
        req = pb.RegisterRequest(model=model, model_size=model_size, layout_crc32=layout_crc,
                                 registration=self.registration, run_config=run_config)
        if worker is not None:
            req.worker_id = worker
        if self.partition is not None:
            req.partition.CopyFrom(self.partition)
        self.info = self._retry(lambda: self._register(
            req, timeout=self.cfg.rpc_timeout_s, metadata=self._metadata), "Register")
        return self.info

    def deregister(self, worker: int) -> None:
        req = self._named(pb.DeregisterRequest(worker_id=worker, registration=self.registration))
        self._retry(lambda: self._deregister(req, timeout=self.cfg.rpc_timeout_s,
                                             metadata=self._metadata), "Deregister")

    def stats(self) -> pb.StatsReply:
        req = self._named(pb.StatsRequest())
        return self._retry(lambda: self._stats(req, timeout=self.cfg.rpc_timeout_s,
                                               metadata=self._metadata), "Stats")

    def save_checkpoint(self) -> pb.CheckpointReply:
        try:
            return self._checkpoint(pb.CheckpointRequest(), timeout=self.cfg.rpc_timeout_s,
                                    metadata=self._metadata)
        except grpc.RpcError as e:
            raise self._failed(e) from None

    def _check_meta(self, meta: pb.TensorMeta, values: np.ndarray) -> None:
        want = self.info.meta
        code = want.dtype if self.wire_dtype is None else wire.dtype_code(self.wire_dtype)
        if (meta.dtype, list(meta.shape), meta.offset) != (code, list(want.shape),
                                                           want.offset):
            raise InvalidArgument(f"{self.address}: pulled meta {meta} does not match the "
                                  f"registered shard {want}")
        if wire.dtype_code(values.dtype) != meta.dtype or values.shape != tuple(meta.shape):
            raise InvalidArgument(f"{self.address}: shard is {wire.dtype_of(meta.dtype)} "
                                  f"{tuple(meta.shape)}, local buffer is {values.dtype} "
                                  f"{values.shape}")

    def pull_into(self, out: np.ndarray, worker: int,
                  known_version: int | None) -> tuple[int, bool]:
        """Fill `out` with the shard's values; returns (version, whether `out` changed).

        If this raises, `out` may hold a mix of old and new values.
        """
        req = self._pull_request(worker, known_version)
        if self.transport == "session":
            return self._retry(lambda: self._in_session(lambda s: self._pull_session(s, req, out)),
                               "Pull")

        def attempt():
            call = self._pull(req, timeout=self.cfg.rpc_timeout_s, metadata=self._metadata)
            try:
                return self._receive(call, pb.PullReply, out)
            finally:
                call.cancel()

        return self._retry(attempt, "Pull")

    def _pull_request(self, worker: int, known_version: int | None) -> pb.PullRequest:
        req = self._named(pb.PullRequest(worker_id=worker, shard=self.info.shard,
                                         registration=self.registration))
        if known_version is not None:
            req.known_version = known_version
        if self.wire_dtype is not None:
            req.dtype = wire.dtype_code(self.wire_dtype)
        if self.transport == "session":
            req.wait_timeout_s = self.cfg.rpc_timeout_s
            req.whole_bytes = self.whole_bytes
        return req

    def _receive(self, messages, cls, out: np.ndarray) -> tuple[int, bool]:
        """A pull's header, chunks and trailer (or all three in one pulled_whole) from
        `messages` into `out`."""
        kind, header = self.codec.read(cls, next(messages))
        if kind == "pulled_whole":
            return self._whole_into(header, out)
        if kind != "header":
            raise InvalidArgument(f"{self.address}: pull stream did not start with a header")
        self._check_meta(header.meta, out)
        if header.not_modified:
            return header.meta.version, False
        received = wire.ChunkedArray(out.size, out.dtype, into=out)
        for raw in messages:
            kind, value = self.codec.read(cls, raw)
            if kind == "chunk":
                received.add(*value)
            elif kind == "trailer":
                received.finish(value)
                return header.meta.version, True
            else:
                raise InvalidArgument(f"{self.address}: {kind} inside a pull stream")
        raise DataLoss(f"{self.address}: pull stream ended without a trailer")

    def _whole_into(self, whole: wire.Whole, out: np.ndarray) -> tuple[int, bool]:
        """A pulled_whole or push_pulled into `out`, checked as a stream would be."""
        header = whole.header
        self._check_meta(header.meta, out)
        if header.not_modified:
            return header.meta.version, False
        whole.into(wire.ChunkedArray(out.size, out.dtype, into=out))
        return header.meta.version, True

    def _pull_session(self, s: Session, req: pb.PullRequest, out: np.ndarray):
        if s.segment is None:
            s.send((wire.wrap(PULL, req),))
            return self._receive(s.receive(), pb.SessionReply, out)
        s.send((wire.wrap(SHM_PULL, req),))
        return self._shm_values(s.expect("shm_pulled"), s, out)

    def _shm_values(self, pulled: pb.ShmPulled, s: Session, out: np.ndarray) -> tuple[int, bool]:
        """A shm_pulled's values from the session's segment into `out`."""
        header = pulled.header
        self._check_meta(header.meta, out)
        if header.not_modified:
            return header.meta.version, False
        checksum = wire.copy_and_checksum(  # no view of the segment outlives the call
            out, s.segment.array(out.dtype.newbyteorder("<"), out.size), wire.ADLER_START)
        if checksum != pulled.adler32:
            raise DataLoss(f"{self.address}: shm_pulled.adler32 {pulled.adler32:#010x} != "
                           f"{checksum:#010x} computed over the segment", reason="checksum")
        return header.meta.version, True

    def push(self, grad: np.ndarray, worker: int, step: int, version: int,
             ranges: Ranges | None = None) -> pb.PushReply:
        """Stream one gradient for this shard, computed from `version`; `ranges`: `grad`
        holds only these ranges of the shard, packed (pserver.ranges)."""
        header = self._push_header(grad, worker, step, version, ranges)
        chunk = self._chunk_bytes()
        if self.transport == "session":
            return self._retry(lambda: self._in_session(
                lambda s: self._push_session(s, header, grad, chunk)), "Push")
        return self._retry(lambda: self._push(wire.stream(header, grad, chunk, self.codec),
                                              timeout=self.cfg.rpc_timeout_s,
                                              metadata=self._metadata), "Push")

    def _push_header(self, grad: np.ndarray, worker: int, step: int, version: int,
                     ranges: Ranges | None = None) -> pb.PushHeader:
        shape = list(grad.shape) if ranges is None else list(self.info.meta.shape)
        meta = pb.TensorMeta(dtype=wire.dtype_code(grad.dtype), shape=shape,
                             offset=self.info.meta.offset, version=version)
        header = pb.PushHeader(worker_id=worker, step=step, shard=self.info.shard, meta=meta,
                               registration=self.registration)
        if ranges is not None:
            header.ranges.CopyFrom(ranges_lib.encode(ranges))
        return self._named(header)

    def _chunk_bytes(self) -> int:
        return min(self.cfg.chunk_bytes, self.info.max_message_bytes - 1024)

    def _push_session(self, s: Session, header: pb.PushHeader, grad: np.ndarray,
                      chunk: int) -> pb.PushReply:
        s.send(self._push_messages(s, header, grad, chunk))
        return s.expect("pushed")

    def _push_messages(self, s: Session, header: pb.PushHeader, grad: np.ndarray, chunk: int,
                       then_pull: pb.PullRequest | None = None) -> Iterable[bytes]:
        """A push's messages on session `s`; `then_pull`: and the pull right after it, in
        the push's one message (a push_whole, a shm_push) where the server answers
        then_pull (RegisterReply.then_pull), else as the pull's own message behind."""
        whole = s.segment is None and grad.nbytes <= chunk
        fused = then_pull is not None and self.info.then_pull and (whole or s.segment)
        more = {"then_pull": then_pull} if fused else {}
        pull = () if then_pull is None or fused else (
            wire.wrap(PULL if s.segment is None else SHM_PULL, then_pull),)
        if whole:
            return (wire.whole(pb.SessionRequest, "push_whole", header, grad, self.codec,
                               **more), *pull)
        if s.segment is None:
            return itertools.chain(wire.stream(header, grad, chunk, self.codec), pull)
        checksum = wire.copy_and_checksum(  # no view of the segment outlives the call
            s.segment.array(grad.dtype.newbyteorder("<"), grad.size),
            wire.little_endian(grad), wire.ADLER_START)
        return (wire.wrap(SHM_PUSH, pb.ShmPush(header=header, adler32=checksum, **more)),
                *pull)

    def push_pull(self, grad: np.ndarray, worker: int, step: int, version: int,
                  out: np.ndarray, ranges: Ranges | None = None) -> tuple[pb.PushReply, int, bool]:
        """Push one gradient computed from `version`, then pull into `out` (which holds
        `version`): (the push's reply, the version pulled, whether `out` changed).

        On a session both go in one operation (one message each way for a tensor that fits
        one, the pull served after the push as a pull of its own would be), under the
        deadlines of both (twice the call deadline; the pull's wait is bounded by one, as
        on its own); a retry repeats both (the push is applied once). Per-call transport:
        a Push, then a Pull.
        If this raises, `out` may hold a mix of old and new values.
        """
        if self.transport != "session":
            reply = self.push(grad, worker, step, version, ranges)
            return (reply, *self.pull_into(out, worker, version))
        header = self._push_header(grad, worker, step, version, ranges)
        req, chunk = self._pull_request(worker, version), self._chunk_bytes()
        return self._retry(lambda: self._in_session(
            lambda s: self._push_pull_session(s, header, grad, chunk, req, out),
            timeout=2 * self.cfg.rpc_timeout_s), "PushPull")

    def start_push_pull(self, grad: np.ndarray, worker: int, step: int, version: int,
                        ranges: Ranges | None = None) -> None:
        """push_pull's first half on the open session, without retries: the push (carrying
        the pull) sent; finish_push_pull reads the answer. PSClient sends to every shard
        this way before it reads any answer, from one thread. After a failure of either
        half, end_session() and push_pull (which retries; a push is applied once)."""
        s = self._session
        with s.operation(self.cfg.rpc_timeout_s):
            s.send(self._push_messages(s, self._push_header(grad, worker, step, version, ranges),
                                       grad, self._chunk_bytes(),
                                       then_pull=self._pull_request(worker, version)))

    def finish_push_pull(self, out: np.ndarray) -> tuple[pb.PushReply, int, bool]:
        """push_pull's second half: its answer, under the deadlines of a push and a pull."""
        s = self._session
        with s.operation(2 * self.cfg.rpc_timeout_s):
            return self._push_pulled(s, out)

    @property
    def in_session(self) -> bool:
        """Whether a session is open (the first call of the session transport opens it)."""
        return self.transport == "session" and self._session is not None

    def _push_pull_session(self, s: Session, header: pb.PushHeader, grad: np.ndarray,
                           chunk: int, req: pb.PullRequest,
                           out: np.ndarray) -> tuple[pb.PushReply, int, bool]:
        s.send(self._push_messages(s, header, grad, chunk, then_pull=req))
        return self._push_pulled(s, out)

    def _push_pulled(self, s: Session, out: np.ndarray) -> tuple[pb.PushReply, int, bool]:
        """The answer to a push carrying a pull: the push's reply, the values into `out`."""
        kind, answer = self.codec.read(pb.SessionReply, s.next_reply())
        if kind == "push_pulled":
            if "pushed" not in answer.more:
                raise InvalidArgument(f"{self.address}: push_pulled without its push's reply")
            return (answer.more["pushed"], *self._whole_into(answer, out))
        if kind == "shm_pulled" and s.segment is not None:
            if not answer.HasField("pushed"):
                raise InvalidArgument(f"{self.address}: shm_pulled without its push's reply")
            return (answer.pushed, *self._shm_values(answer, s, out))
        if kind != "pushed":
            raise StatusError(grpc.StatusCode.INTERNAL, f"{self.address}: session answered "
                                                        f"{kind} to a push, expected pushed")
        if s.segment is not None:  # the pull's own shm_pull came behind the push
            return (answer, *self._shm_values(s.expect("shm_pulled"), s, out))
        return (answer, *self._receive(s.receive(), pb.SessionReply, out))

    def _in_session(self, operation, timeout: float | None = None):
        """operation(session) on the open session (opened, and shared memory agreed, if
        need be), under the call deadline (or `timeout`); any failure closes the session."""
        if self._session is None:
            self._session = Session(self._open, self._metadata, self.codec, self._watchdog,
                                    self.address)
        s = self._session
        try:
            with s.operation(timeout or self.cfg.rpc_timeout_s):
                if not self.shm_refused and s.segment is None:
                    self._share_memory(s)
                return operation(s)
        except BaseException:
            self.end_session()
            raise

    def _share_memory(self, s: Session) -> None:
        nbytes = self.info.meta.shape[0] * wire.dtype_of(self.info.meta.dtype).itemsize
        self.shm_refused = s.share_memory(
            nbytes, None if self.partition is None else self.partition.id)
        if self.shm_refused:
            log.info("%s: tensors over gRPC (no shared memory: %s)", self.address,
                     self.shm_refused)
        else:
            log.info("%s: tensors through shared memory", self.address)

    def end_session(self) -> None:
        """Close the session, if one is open (a reply it still owes is dropped with it)."""
        if self._session is not None:
            self._session.close()
            self._session = None

    @property
    def shared_memory(self) -> bool:
        """Whether the open session moves the tensors through shared memory."""
        return self._session is not None and self._session.segment is not None

    def close(self) -> None:
        self.end_session()
        self.channel.close()


class PSClient:
    """All shards of one model: connect, pull and push to every shard in parallel.

    transport: "session" (one stream per shard) or "calls" (a call per pull and push);
    shm: use shared memory with shards on this host; codec: wire.HAND, or
    wire.CODECS["generated"] (the benchmark's baseline); registration: the number this
    client registers with (default: the process's, PROCESS_REGISTRATION); partition:
    this process is one rank of a model-parallel worker group and pulls and pushes
    only this partition of it (pserver.partitions; the model size and layout given to
    `connect` are the partition's).
    """

    def __init__(self, cfg: ClientConfig, transport: str = "session", shm: bool = True,
                 codec: wire.HandCodec | wire.GeneratedCodec = wire.HAND,
                 registration: int = PROCESS_REGISTRATION,
                 partition: pb.PartitionLayout | None = None, wire_dtype: str = "fp32"):
        if wire_dtype not in WIRE_DTYPES:
            raise ValueError(f"wire dtype {wire_dtype!r}: one of {', '.join(WIRE_DTYPES)}")
        self.cfg = cfg
        self.wire = WIRE_DTYPES[wire_dtype]
        self._wire_grad = self._wire_params = None  # (n,) the half copies --wire sends
        self._watchdog = Watchdog(min(1.0, cfg.rpc_timeout_s / 4))
        make = partial(ShardClient, transport=transport, shm=shm, codec=codec,
                       watchdog=self._watchdog)
        self.shards = [ReplicatedShard(a.split(SEPARATOR), cfg, make) if SEPARATOR in a
                       else make(a, cfg) for a in cfg.addresses()]
        self._pool = ThreadPoolExecutor(len(self.shards), thread_name_prefix="ps-client")
        self.versions: list[int | None] = [None] * len(self.shards)
        self.worker = -1
        self.registration = registration
        for s in self.shards:
            s.registration, s.partition = self.registration, partition
            s.wire_dtype = self.wire
            if self.wire is not None:
                s.shm_refused = f"--wire {wire_dtype}: tensors travel over gRPC as {wire_dtype}"

    def _each(self, fn) -> list:
        return self._map(fn, self.shards)

    def _map(self, fn, items) -> list:
        """fn over `items` on the pool in parallel; one item in this thread (no hand-off)."""
        items = list(items)
        if len(items) == 1:
            return [fn(items[0])]
        return list(self._pool.map(fn, items))

    def connect(self, worker: int | None, model: str, model_size: int, layout_crc: int = 0,
                run_config: dict | None = None) -> int:
        """Wait for every shard, register, check the layout; returns the step to start at.

        worker: this worker's id, or None: shard 0 assigns one (then in self.worker).
        layout_crc: wire.layout_crc of the model's parameter specs; run_config: the
        worker's run config (pserver.runconfig), checked by every shard.
        """
        self._each(lambda s: s.wait_ready())
        config = json.dumps(run_config, sort_keys=True) if run_config else ""
        try:
            return self._register(worker, model, model_size, layout_crc, config)
        except BaseException:
            self._forget()
            raise

    def _register(self, worker: int | None, model: str, model_size: int, layout_crc: int,
                  config: str) -> int:
        first, assigned = None, None
        if worker is None:
            first = next((s for s, st in zip(self.shards, self._each(lambda s: s.stats()),
                                             strict=True) if st.shard == 0), None)
            if first is None:
                raise InvalidArgument(f"--servers {','.join(self.cfg.addresses())}: no shard 0 "
                                      "among them, and shard 0 assigns worker ids")
            assigned = first.register(None, model, model_size, layout_crc, config)
            worker = assigned.worker_id
        self.worker = worker
        infos = self._each(lambda s: assigned if s is first else
                           s.register(worker, model, model_size, layout_crc, config))
        order = sorted(range(len(infos)), key=lambda i: infos[i].shard)
        self.shards = [self.shards[i] for i in order]
        infos = [infos[i] for i in order]
        n = len(infos)
        if [i.shard for i in infos] != list(range(n)) or any(i.num_shards != n for i in infos):
            found = ", ".join(f"{s.address}: shard {i.shard} of {i.num_shards}"
                              for s, i in zip(self.shards, infos, strict=True))
            raise InvalidArgument(f"--servers must list shards 0..{n - 1} of {n} once each "
                                  f"({found})")
        end = 0
        for s, i in zip(self.shards, infos, strict=True):
            if i.meta.offset != end:
                raise InvalidArgument(f"{s.address}: shard {i.shard} starts at {i.meta.offset}, "
                                      f"expected {end}")
            end += i.meta.shape[0]
        if end != model_size:
            raise InvalidArgument(f"shards cover {end} elements, the model has {model_size}")
        self.versions = [None] * n
        return min(i.next_step for i in infos)

    def _slice(self, shard: ShardClient, flat: np.ndarray) -> np.ndarray:
        lo = shard.info.meta.offset
        return flat[lo : lo + shard.info.meta.shape[0]]

    def _on_wire(self, flat: np.ndarray, which: str) -> np.ndarray:
        """The buffer a tensor travels in: `flat` itself, or under --wire its half copy
        ("grad" or "params", made at first use)."""
        if self.wire is None:
            return flat
        buf = getattr(self, f"_wire_{which}")
        if buf is None or buf.size != flat.size:
            buf = np.empty(flat.size, self.wire)
            setattr(self, f"_wire_{which}", buf)
        return buf

    def _landed(self, s: ShardClient, changed: bool, flat: np.ndarray, sent: np.ndarray) -> None:
        """Count a pull's bytes; a half pull's values into the float32 `flat`."""
        if changed:
            s.pulled_bytes += s.info.meta.shape[0] * sent.itemsize
            if sent is not flat:
                self._slice(s, flat)[...] = self._slice(s, sent)

    def pull(self, flat: np.ndarray) -> int:
        """Pull every shard into `flat` in parallel; returns how many shards changed."""
        sent = self._on_wire(flat, "params")

        def one(k: int) -> bool:
            s = self.shards[k]
            known, self.versions[k] = self.versions[k], None  # unknown until the pull succeeds
            self.versions[k], changed = s.pull_into(self._slice(s, sent), self.worker, known)
            self._landed(s, changed, flat, sent)
            return changed

        return sum(self._map(one, range(len(self.shards))))

    def _grad_on_wire(self, flat_grad: np.ndarray) -> np.ndarray:
        """The gradient as it travels: itself, or rounded to the --wire dtype."""
        grad = self._on_wire(flat_grad, "grad")
        if grad is not flat_grad:
            grad[...] = flat_grad
        return grad

    @property
    def pushed_bytes(self) -> int:
        """Gradient bytes pushed (values only, as they travel), over every shard."""
        return sum(s.pushed_bytes for s in self.shards)

    @property
    def pulled_bytes(self) -> int:
        """Parameter bytes pulled (values only, as they travel; not-modified pulls: 0)."""
        return sum(s.pulled_bytes for s in self.shards)

    def _part(self, shard: ShardClient, flat_grad: np.ndarray,
              ranges: Ranges | None) -> tuple[np.ndarray, Ranges | None]:
        """What `shard` gets of `flat_grad`: its slice; or, given the model's `ranges`, the
        values of those that meet its slice, packed, and them relative to the shard."""
        if ranges is None:
            return self._slice(shard, flat_grad), None
        lo = shard.info.meta.offset
        mine = ranges_lib.within(ranges, lo, lo + shard.info.meta.shape[0])
        return ranges_lib.gather(self._slice(shard, flat_grad), mine), mine

    def push(self, flat_grad: np.ndarray, step: int,
             ranges: Ranges | None = None) -> list[pb.PushReply]:
        """Push every shard's slice of `flat_grad` in parallel, each with the version it read;
        `ranges`: only these ranges of the model's flat vector (pserver.ranges: sorted,
        disjoint), each shard the ones that meet its slice."""
        if any(v is None for v in self.versions):
            raise RuntimeError("push before a successful pull of every shard")
        flat_grad = self._grad_on_wire(flat_grad)

        def one(k: int) -> pb.PushReply:
            s = self.shards[k]
            grad, mine = self._part(s, flat_grad, ranges)
            reply = s.push(grad, self.worker, step, self.versions[k], mine)
            s.pushed_bytes += grad.nbytes
            return reply

        return self._map(one, range(len(self.shards)))

    def push_pull(self, flat_grad: np.ndarray, step: int, flat: np.ndarray,
                  ranges: Ranges | None = None) -> tuple[list[pb.PushReply], int]:
        """push(flat_grad, step), then pull(flat), every shard in parallel, each shard's
        pull right behind its push (ShardClient.push_pull): the worker's loop of push,
        pull, compute, with one round trip per shard for the push and the pull (`ranges`:
        as in push). Once every shard's session is open, the pushes are sent and the
        answers read from this thread (_push_pull_here). Returns the push replies and how
        many shards changed."""
        if any(v is None for v in self.versions):
            raise RuntimeError("push before a successful pull of every shard")
        flat_grad, sent = self._grad_on_wire(flat_grad), self._on_wire(flat, "params")
        known = list(self.versions)
        self.versions = [None] * len(self.shards)  # unknown until each pull succeeds
        parts = [self._part(s, flat_grad, ranges) for s in self.shards]  # (grad, ranges)

        def land(k: int, answer: tuple[pb.PushReply, int, bool]) -> tuple[pb.PushReply, bool]:
            s, (grad, _) = self.shards[k], parts[k]
            reply, self.versions[k], changed = answer
            s.pushed_bytes += grad.nbytes
            self._landed(s, changed, flat, sent)
            return reply, changed

        def retried(k: int) -> tuple[pb.PushReply, bool]:
            s, (grad, mine) = self.shards[k], parts[k]
            return land(k, s.push_pull(grad, self.worker, step, known[k], self._slice(s, sent),
                                       mine))

        answers = self._push_pull_here(step, known, parts, sent)
        missing = [k for k in range(len(self.shards)) if k not in answers]
        again = dict(zip(missing, self._map(retried, missing), strict=True))
        done = [again[k] if k in again else land(k, answers[k]) for k in range(len(self.shards))]
        return [reply for reply, _ in done], sum(changed for _, changed in done)

    def _push_pull_here(self, step: int, known: list[int], parts: list[tuple],
                        sent: np.ndarray) -> dict[int, tuple[pb.PushReply, int, bool]]:
        """{shard: push_pull's answer} for every shard, sent and read from this thread,
        where every shard has its session open (the pushes go out together and no thread
        is woken to carry them: on a host whose cores are busy each hand-off to a pool
        thread and back waits to be scheduled); {} when not, and after a failure the
        answers read so far: the others go through ShardClient.push_pull, which retries."""
        if len(self.shards) < 2 or not all(
                isinstance(s, ShardClient) and s.in_session for s in self.shards):
            return {}
        answers: dict[int, tuple[pb.PushReply, int, bool]] = {}
        try:
            for s, (grad, mine), version in zip(self.shards, parts, known, strict=True):
                s.start_push_pull(grad, self.worker, step, version, mine)
            for k, s in enumerate(self.shards):
                answers[k] = s.finish_push_pull(self._slice(s, sent))
        except BaseException as e:
            for k, s in enumerate(self.shards):
                if k not in answers:  # it may still owe an answer: a new session for a retry
                    s.end_session()
            if not isinstance(e, Exception):
                raise
            log.info("push_pull from one thread: %s; the shards without an answer retry", e)
        return answers

    def stats(self) -> list[pb.StatsReply]:
        return self._each(lambda s: s.stats())

    @property
    def server(self) -> pb.RegisterReply:
        """Shard 0's answer to Register: what the servers run (optimizer, consistency...)."""
        return self.shards[0].info

    def leave(self) -> None:
        self._each(lambda s: s.deregister(self.worker))

    def _forget(self) -> None:
        """Deregister from every shard that registered us (a connect that failed)."""
        for s in self.shards:
            if s.info is not None:
                try:
                    s.deregister(s.info.worker_id)
                except grpc.RpcError as e:
                    log.warning("%s: could not deregister: %s", s.address, e)
                s.info = None

    def close(self) -> None:
        for s in self.shards:
            s.close()
        self._pool.shutdown(wait=True)
        self._watchdog.close()
