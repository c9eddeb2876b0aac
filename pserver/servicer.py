"""The gRPC methods of dtlab.ps.v1.ParameterServer over one ShardStore.

Requests arrive as raw bytes (identity deserializers) and are decoded here,
so a malformed message becomes INVALID_ARGUMENT with a message instead of
gRPC's generic deserialization error, and a pushed gradient is never copied:
its chunks stay in the received messages (pserver.wire.ChunkedArray) and the
optimizer reads them there.

A push is validated in full before the store sees it: header (shard, dtype,
shape, offset, worker, version), then every chunk (order, size, finite
values) as it arrives, then the trailer (count, Adler-32). Any failure, or a
stream that breaks off, drops the chunks: nothing is applied.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator

import grpc

from protos import dtlab_ps_pb2 as pb
from pserver import wire
from pserver.errors import DataLoss, InvalidArgument, PSError
from pserver.store import PushResult, ShardStore

log = logging.getLogger(__name__)

class ParameterServerServicer:
    def __init__(self, store: ShardStore, max_message_bytes: int,
                 checkpoint: Callable[[], tuple[str, int]] | None = None):
        self.store, self.max_message_bytes, self._checkpoint = store, max_message_bytes, checkpoint
        lay = store.layout
        self.meta = pb.TensorMeta(dtype=wire.dtype_code(store.params.dtype), shape=[lay.length],
                                  offset=lay.offset)

    def _fail(self, context, err: PSError):
        self.store.reject(err.reason)
        log.debug("%s: %s", err.status, err)
        context.abort(grpc.StatusCode[err.status], str(err))

    def _meta(self, version: int) -> pb.TensorMeta:
        meta = pb.TensorMeta()
        meta.CopyFrom(self.meta)
        meta.version = version
        return meta

    # -- unary ----------------------------------------------------------------------------

    def Register(self, raw: bytes, context) -> pb.RegisterReply:
        try:
            req = wire.parse(pb.RegisterRequest, memoryview(raw))
            state, version = self.store.register(req.worker_id, req.model, req.model_size,
                                                 req.layout_crc32)
        except PSError as e:
            self._fail(context, e)
        lay, policy = self.store.layout, self.store.policy
        return pb.RegisterReply(
            shard=lay.shard, num_shards=lay.num_shards, model_size=lay.model_size,
            meta=self._meta(version), consistency=policy.code,
            staleness_bound=policy.bound or 0, next_step=state.next_step,
            max_message_bytes=self.max_message_bytes)

    def Deregister(self, raw: bytes, context) -> pb.DeregisterReply:
        try:
            self.store.deregister(wire.parse(pb.DeregisterRequest, memoryview(raw)).worker_id)
        except PSError as e:
            self._fail(context, e)
        return pb.DeregisterReply()

    def Stats(self, raw: bytes, context) -> pb.StatsReply:
        return self.store.stats()

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

    def Pull(self, raw: bytes, context) -> Iterator[bytes]:
        try:
            req = wire.parse(pb.PullRequest, memoryview(raw))
            if req.shard != self.store.layout.shard:
                raise InvalidArgument(f"shard {req.shard}: this server holds shard "
                                      f"{self.store.layout.shard}", reason="shard")
            context.add_callback(self.store.wake)
            known = req.known_version if req.HasField("known_version") else None
            read = self.store.read(req.worker_id, known, context.time_remaining(),
                                   alive=context.is_active)
        except PSError as e:
            self._fail(context, e)
        header = pb.PullHeader(meta=self._meta(read.version), not_modified=read.tensor is None)
        try:
            if read.tensor is None:
                yield wire.header_message(header)
            else:
                yield from read.tensor.stream(header)
        finally:
            self.store.release(read)

    # -- push -----------------------------------------------------------------------------

    def _check_header(self, h: pb.PushHeader) -> None:
        lay, want = self.store.layout, self.meta
        if h.shard != lay.shard:
            raise InvalidArgument(f"header.shard {h.shard}: this server holds shard {lay.shard}",
                                  reason="shard")
        if h.meta.dtype != want.dtype:
            raise InvalidArgument(f"meta.dtype {_dtype_name(h.meta.dtype)}: shard {lay.shard} "
                                  f"holds {_dtype_name(want.dtype)}", reason="dtype")
        if list(h.meta.shape) != list(want.shape):
            raise InvalidArgument(f"meta.shape {list(h.meta.shape)}: shard {lay.shard} holds "
                                  f"{list(want.shape)}", reason="length")
        if h.meta.offset != want.offset:
            raise InvalidArgument(f"meta.offset {h.meta.offset}: shard {lay.shard} starts at "
                                  f"{want.offset}", reason="offset")

    def _receive(self, requests: Iterator[bytes]) -> wire.ChunkedArray:
        """The pushed gradient, checked in full; raises on any fault."""
        params = self.store.params
        grad = wire.ChunkedArray(params.size, params.dtype, finite=True, name="gradient")
        for raw in requests:
            field, body = wire.split(raw)
            if field == wire.CHUNK:
                grad.add(*wire.parse_chunk(body))
            elif field == wire.TRAILER:
                trailer = wire.parse(pb.Trailer, body)
                if next(requests, None) is not None:
                    raise InvalidArgument("message after the trailer", reason="order")
                grad.finish(trailer)
                return grad
            else:
                raise InvalidArgument("second header in one push stream", reason="order")
        raise DataLoss(f"push stream ended without a trailer after {grad.chunks} chunks",
                       reason="incomplete")

    def Push(self, requests: Iterator[bytes], context) -> pb.PushReply:
        requests = iter(requests)
        try:
            first = next(requests, None)
            if first is None:
                raise InvalidArgument("empty push stream: expected a header first", reason="order")
            field, body = wire.split(first)
            if field != wire.HEADER:
                raise InvalidArgument("push stream must start with a header", reason="order")
            h = wire.parse(pb.PushHeader, body)
            self._check_header(h)
            result = self.store.admit(h.worker_id, h.step, h.meta.version)
            if result is None:
                with self.store.receiving():
                    t0 = time.perf_counter()
                    grad = self._receive(requests)
                    self.store.received(time.perf_counter() - t0, grad.check_seconds)
                    result = self.store.push(h.worker_id, h.step, h.meta.version, grad)
        except PSError as e:
            self._fail(context, e)
        except grpc.RpcError:  # the client went away mid-stream: nothing was applied
            self.store.reject("broken")
            context.abort(grpc.StatusCode.CANCELLED, "push stream broke off; nothing applied")
        return _reply(result)


def _dtype_name(code: int) -> str:
    return pb.DType.Name(code) if code in pb.DType.values() else str(code)


def _reply(r: PushResult) -> pb.PushReply:
    return pb.PushReply(duplicate=r.duplicate, staleness=r.staleness, version=r.version,
                        pending=r.pending, lr=r.lr)


def handler(servicer: ParameterServerServicer) -> grpc.GenericRpcHandler:
    """The service's method handlers: raw bytes in, serialized protobuf out."""
    unary = {name: grpc.unary_unary_rpc_method_handler(
        getattr(servicer, name), response_serializer=lambda m: m.SerializeToString())
        for name in ("Register", "Deregister", "Stats", "SaveCheckpoint")}
    return grpc.method_handlers_generic_handler(wire.SERVICE, {
        **unary,
        "Pull": grpc.unary_stream_rpc_method_handler(servicer.Pull),
        "Push": grpc.stream_unary_rpc_method_handler(
            servicer.Push, response_serializer=pb.PushReply.SerializeToString),
    })
