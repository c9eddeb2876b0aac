"""One shard's client: its channel (TLS, token, reconnect backoff), its calls
(Register, Pull, Push, Stats, SaveCheckpoint, health), its Session stream and its
shared-memory segment. PSClient (pserver.worker.client) runs one per shard."""

from __future__ import annotations

import itertools
import logging
import random
import time
from collections.abc import Iterable

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dtlab.protos import dtlab_ps_pb2 as pb
from dtlab.pserver.common import auth, buffers
from dtlab.pserver.common import codec as wire
from dtlab.pserver.common import ranges as ranges_lib
from dtlab.pserver.common.codec import SERVICE
from dtlab.pserver.common.compressed import Part
from dtlab.pserver.common.config import ClientConfig
from dtlab.pserver.common.errors import DataLoss, InvalidArgument
from dtlab.pserver.common.ranges import Ranges
from dtlab.pserver.worker.session import (
    PULL,
    SHM_PULL,
    SHM_PUSH,
    ServerStream,
    StatusError,
    Watchdog,
)

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
                 transport: str = "session", shm_refused: str = "",
                 codec: wire.HandCodec | wire.GeneratedCodec = wire.HAND,
                 watchdog: Watchdog | None = None, registration: int = 0,
                 partition: pb.PartitionLayout | None = None,
                 wire_dtype: np.dtype | None = None):
        """shm_refused: why this shard's tensors never use shared memory ("" to try it);
        registration: the number sent on every call (PSClient's); partition: a worker
        group's rank, named at Register and on every call; wire_dtype: the dtype tensors
        travel as (--wire), None for the shard's own."""
        if transport not in TRANSPORTS:
            raise ValueError(f"transport {transport!r}: one of {', '.join(TRANSPORTS)}")
        self.address, self.cfg = address, cfg
        self.transport, self.codec = transport, codec
        self._session: ServerStream | None = None
        self._watchdog = watchdog
        self.shm_refused = shm_refused
        self.wire_dtype = wire_dtype
        self.pushed_bytes = self.pulled_bytes = 0  # tensor bytes this shard's values took
        # a pulled tensor up to this size may come in one message (room for its header)
        self.whole_bytes = max_message_bytes - 1024
        self._auth = auth.call_metadata(auth.read_token(cfg.token_file, cfg.token_env))
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
        self.registration, self.partition = registration, partition
        self.step_s: float | None = None  # PushHeader.step_s of the pushes (--dylu)
        self.terms = None  # a replicated shard's highest term seen (pserver.worker.failover)

    @property
    def _metadata(self) -> tuple[tuple[str, str], ...]:
        """Every call's metadata: the token, and a replicated shard's highest term seen
        (wire.TERM_KEY: an orphaned backup of a lower term does not take over for it)."""
        if self.terms is None:
            return self._auth
        return (*self._auth, (wire.TERM_KEY, str(self.terms.highest)))

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
        self.info = self._retry(lambda: self._termed(self._register(
            req, timeout=self.cfg.rpc_timeout_s, metadata=self._metadata)), "Register")
        return self.info

    def _termed(self, reply):
        """`reply` (a RegisterReply, PushReply or PullHeader) if its replication term is
        not below the highest this shard's replies carried (`terms`, a replicated shard's:
        pserver.worker.failover.Terms); else UNAVAILABLE, so that the call goes to the other
        replica and nothing of the reply is used."""
        if self.terms is not None:
            self.terms.check(self.address, reply.term)
        return reply

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
        self._check_meta(self._termed(header).meta, out)
        if header.not_modified:
            return header.meta.version, False
        received = buffers.ChunkedArray(out.size, out.dtype, into=out)
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
        self._check_meta(self._termed(header).meta, out)
        if header.not_modified:
            return header.meta.version, False
        whole.into(buffers.ChunkedArray(out.size, out.dtype, into=out))
        return header.meta.version, True

    def _pull_session(self, s: ServerStream, req: pb.PullRequest, out: np.ndarray):
        if s.segment is None:
            s.send((wire.wrap(PULL, req),))
            return self._receive(s.receive(), pb.SessionReply, out)
        s.send((wire.wrap(SHM_PULL, req),))
        return self._shm_values(s.expect("shm_pulled"), s, out)

    def _shm_values(self, pulled: pb.ShmPulled, s: ServerStream,
                    out: np.ndarray) -> tuple[int, bool]:
        """A shm_pulled's values from the session's segment into `out`."""
        header = pulled.header
        self._check_meta(self._termed(header).meta, out)
        if header.not_modified:
            return header.meta.version, False
        # backward: the server wrote the segment forward (its end is in the host's cache)
        checksum = buffers.copy_and_checksum_backward(  # no view of the segment outlives it
            out, s.segment.array(out.dtype.newbyteorder("<"), out.size), wire.ADLER_START)
        if checksum != pulled.adler32:
            raise DataLoss(f"{self.address}: shm_pulled.adler32 {pulled.adler32:#010x} != "
                           f"{checksum:#010x} computed over the segment", reason="checksum")
        return header.meta.version, True

    def push(self, grad: np.ndarray, worker: int, step: int, version: int,
             ranges: Ranges | None = None, compressed: Part | None = None) -> pb.PushReply:
        """Stream one gradient for this shard, computed from `version`; `ranges`: `grad`
        holds only these ranges of the shard, packed (pserver.common.ranges); `compressed`:
        `grad` is this compressed part's bytes (pserver.common.compressed)."""
        header = self._push_header(grad, worker, step, version, ranges, compressed)
        chunk = self._chunk_bytes()
        if self.transport == "session":
            return self._retry(lambda: self._in_session(
                lambda s: self._push_session(s, header, grad, chunk)), "Push")
        return self._retry(lambda: self._termed(self._push(
            wire.stream(header, grad, chunk, self.codec), timeout=self.cfg.rpc_timeout_s,
            metadata=self._metadata)), "Push")

    def _push_header(self, grad: np.ndarray, worker: int, step: int, version: int,
                     ranges: Ranges | None = None,
                     compressed: Part | None = None) -> pb.PushHeader:
        whole = ranges is None and compressed is None
        shape = list(grad.shape) if whole else list(self.info.meta.shape)
        dtype = grad.dtype if compressed is None else compressed.dtype
        meta = pb.TensorMeta(dtype=wire.dtype_code(dtype), shape=shape,
                             offset=self.info.meta.offset, version=version)
        header = pb.PushHeader(worker_id=worker, step=step, shard=self.info.shard, meta=meta,
                               registration=self.registration)
        if ranges is not None:
            header.ranges.CopyFrom(ranges_lib.encode(ranges))
        if compressed is not None:
            header.compressed.CopyFrom(compressed.message)
        if self.step_s is not None:
            header.step_s = self.step_s
        return self._named(header)

    def _chunk_bytes(self) -> int:
        return min(self.cfg.chunk_bytes, self.info.max_message_bytes - 1024)

    def _push_session(self, s: ServerStream, header: pb.PushHeader, grad: np.ndarray,
                      chunk: int) -> pb.PushReply:
        s.send(self._push_messages(s, header, grad, chunk))
        return self._termed(s.expect("pushed"))

    def _push_messages(self, s: ServerStream, header: pb.PushHeader, grad: np.ndarray, chunk: int,
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
        checksum = buffers.copy_and_checksum(  # no view of the segment outlives the call
            s.segment.array(grad.dtype.newbyteorder("<"), grad.size),
            wire.little_endian(grad), wire.ADLER_START)
        return (wire.wrap(SHM_PUSH, pb.ShmPush(header=header, adler32=checksum, **more)),
                *pull)

    def push_pull(self, grad: np.ndarray, worker: int, step: int, version: int,
                  out: np.ndarray, ranges: Ranges | None = None,
                  compressed: Part | None = None) -> tuple[pb.PushReply, int, bool]:
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
            reply = self.push(grad, worker, step, version, ranges, compressed)
            return (reply, *self.pull_into(out, worker, version))
        header = self._push_header(grad, worker, step, version, ranges, compressed)
        req, chunk = self._pull_request(worker, version), self._chunk_bytes()
        return self._retry(lambda: self._in_session(
            lambda s: self._push_pull_session(s, header, grad, chunk, req, out),
            timeout=2 * self.cfg.rpc_timeout_s), "PushPull")

    def start_push_pull(self, grad: np.ndarray, worker: int, step: int, version: int,
                        ranges: Ranges | None = None, compressed: Part | None = None) -> None:
        """push_pull's first half on the open session, without retries: the push (carrying
        the pull) sent; finish_push_pull reads the answer. PSClient sends to every shard
        this way before it reads any answer, from one thread. After a failure of either
        half, end_session() and push_pull (which retries; a push is applied once)."""
        s = self._session
        with s.operation(self.cfg.rpc_timeout_s):
            s.send(self._push_messages(s, self._push_header(grad, worker, step, version, ranges,
                                                            compressed),
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

    def _push_pull_session(self, s: ServerStream, header: pb.PushHeader, grad: np.ndarray,
                           chunk: int, req: pb.PullRequest,
                           out: np.ndarray) -> tuple[pb.PushReply, int, bool]:
        s.send(self._push_messages(s, header, grad, chunk, then_pull=req))
        return self._push_pulled(s, out)

    def _push_pulled(self, s: ServerStream, out: np.ndarray) -> tuple[pb.PushReply, int, bool]:
        """The answer to a push carrying a pull: the push's reply, the values into `out`."""
        kind, answer = self.codec.read(pb.SessionReply, s.next_reply())
        if kind == "push_pulled":
            if "pushed" not in answer.more:
                raise InvalidArgument(f"{self.address}: push_pulled without its push's reply")
            return (self._termed(answer.more["pushed"]), *self._whole_into(answer, out))
        if kind == "shm_pulled" and s.segment is not None:
            if not answer.HasField("pushed"):
                raise InvalidArgument(f"{self.address}: shm_pulled without its push's reply")
            return (self._termed(answer.pushed), *self._shm_values(answer, s, out))
        if kind != "pushed":
            raise StatusError(grpc.StatusCode.INTERNAL, f"{self.address}: session answered "
                                                        f"{kind} to a push, expected pushed")
        self._termed(answer)
        if s.segment is not None:  # the pull's own shm_pull came behind the push
            return (answer, *self._shm_values(s.expect("shm_pulled"), s, out))
        return (answer, *self._receive(s.receive(), pb.SessionReply, out))

    def _in_session(self, operation, timeout: float | None = None):
        """operation(session) on the open session (opened, and shared memory agreed, if
        need be), under the call deadline (or `timeout`); any failure closes the session."""
        if self._session is None:
            self._session = ServerStream(self._open, self._metadata, self.codec, self._watchdog,
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

    def _share_memory(self, s: ServerStream) -> None:
        nbytes = self.info.meta.shape[0] * wire.dtype_of(self.info.meta.dtype).itemsize
        self.shm_refused = s.share_memory(
            nbytes, None if self.partition is None else self.partition.id)
        if self.shm_refused:
            log.info("%s: tensors over gRPC (no shared memory: %s)", self.address,
                     self.shm_refused)
        else:
            log.info("%s: tensors through shared memory", self.address)

    def abort(self, why: str) -> None:
        """Fail the session's operation in flight now with UNAVAILABLE and `why` (from any
        thread; nothing happens on the calls transport, whose calls end at their deadline)."""
        s = self._session
        if s is not None:
            s.abort(why)

    def end_session(self) -> None:
        """Close the session, if one is open (a reply it still owes is dropped with it)."""
        if self._session is not None:
            self._session.close()
            self._session = None

    def path(self) -> str:
        """How this shard's tensors travel, in words: "shared memory", or gRPC's transport
        with the messages a push of the shard's slice takes ("gRPC session, 1 message";
        "gRPC calls, 7 chunks of 1024 KiB") and the --wire dtype if any."""
        if self.shared_memory:
            return "shared memory"
        nbytes = self.info.meta.shape[0] * (self.wire_dtype or np.dtype(np.float32)).itemsize
        chunk = self._chunk_bytes()
        pieces = "1 message" if nbytes <= chunk else \
            f"{-(-nbytes // chunk)} chunks of {chunk >> 10} KiB"
        wire_words = f", {self.wire_dtype.name} on the wire" if self.wire_dtype else ""
        return f"gRPC {self.transport}, {pieces}{wire_words}"

    @property
    def shared_memory(self) -> bool:
        """Whether the open session moves the tensors through shared memory."""
        return self._session is not None and self._session.segment is not None

    def close(self) -> None:
        self.end_session()
        self.channel.close()
