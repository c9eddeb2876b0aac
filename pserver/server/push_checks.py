"""A push validated in full before the store sees it.

First its header (shard, dtype, shape, offset, worker, version, and the
ranges it carries if it carries only some: pserver.common.ranges.decode),
then every chunk (order, size, finite values) as it arrives, then the
trailer (count, Adler-32). Any failure, or a stream that breaks off, drops
the chunks: nothing is applied. A pushed gradient is never copied: its
chunks stay in the received messages (pserver.common.buffers.ChunkedArray)
and the optimizer reads them there; only a half gradient is converted to
the shard's float32 on receipt (`widened`). A tensor that fits in one
message (a session's WholePush) is checked by the same ChunkedArray add and
finish.

Which of these refusals wins against the others (identity first, then the
message's fields, then its data) is the order pserver.server.servicer calls
them in.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from dtlab.protos import dtlab_ps_pb2 as pb
from dtlab.pserver.common import buffers, compressed
from dtlab.pserver.common import codec as wire
from dtlab.pserver.common import ranges as ranges_lib
from dtlab.pserver.common.errors import DataLoss, InvalidArgument
from dtlab.pserver.server.store import ShardLayout


def wire_code(code: int, field: str, meta: pb.TensorMeta, shard: int) -> int:
    """`code` if a pull's or push's values may travel as it: the shard's dtype
    (`meta.dtype`), or a half dtype for a float32 shard (half the bytes; the server keeps
    float32)."""
    if code == meta.dtype or (code in wire.HALF_CODES and meta.dtype == pb.FLOAT32):
        return code
    raise InvalidArgument(f"{field} {dtype_name(code)}: shard {shard} "
                          f"holds {dtype_name(meta.dtype)}, which travels as itself"
                          + (" or FLOAT16 / BFLOAT16" if meta.dtype == pb.FLOAT32
                             else ""), reason="dtype")


def check_header(h: pb.PushHeader, want: pb.TensorMeta, lay: ShardLayout,
                 shm: bool = False) -> None:
    """A push's header against the shard's `want` meta; `shm`: the gradient is in the
    session's segment, which holds the shard's dtype (elsewhere a float32 shard takes a
    half gradient too)."""
    if h.shard != lay.shard:
        raise InvalidArgument(f"header.shard {h.shard}: this server holds shard {lay.shard}",
                              reason="shard")
    if h.HasField("compressed"):
        compressed.check_header(h.compressed, lay.length)
        if h.meta.dtype != want.dtype:
            raise InvalidArgument(f"meta.dtype {dtype_name(h.meta.dtype)}: a compressed "
                                  f"push to shard {lay.shard} carries its "
                                  f"{dtype_name(want.dtype)} values", reason="dtype")
    elif not shm:
        wire_code(h.meta.dtype, "meta.dtype", want, lay.shard)
    elif h.meta.dtype != want.dtype:
        raise InvalidArgument(f"meta.dtype {dtype_name(h.meta.dtype)}: shard {lay.shard} "
                              f"holds {dtype_name(want.dtype)}", reason="dtype")
    if list(h.meta.shape) != list(want.shape):
        raise InvalidArgument(f"meta.shape {list(h.meta.shape)}: shard {lay.shard} holds "
                              f"{list(want.shape)}", reason="length")
    if h.meta.offset != want.offset:
        raise InvalidArgument(f"meta.offset {h.meta.offset}: shard {lay.shard} starts at "
                              f"{want.offset}", reason="offset")


def push_ranges(h: pb.PushHeader, length: int) -> ranges_lib.Ranges | None:
    """The ranges of a shard of `length` elements a push carries (PushRanges, checked),
    None: all of the shard."""
    if not h.HasField("ranges"):
        return None
    if h.HasField("compressed"):
        raise InvalidArgument("a push carries ranges or is compressed, not both",
                              reason="compressed")
    return ranges_lib.decode(h.ranges, length)


def empty_gradient(h: pb.PushHeader, ranges: ranges_lib.Ranges | None, length: int,
                   params: np.ndarray) -> buffers.ChunkedArray:
    """An empty received gradient for header `h` (checked) to a shard of `length` elements
    held in `params`: of the pushed dtype, the shard's size or the ranges' (packed); or a
    compressed push's bytes."""
    if h.HasField("compressed"):
        n = compressed.expected_bytes(h.compressed, length, params.itemsize)
        return buffers.ChunkedArray(n, np.uint8, name="compressed push")
    n = params.size if ranges is None else ranges_lib.size(ranges)
    return buffers.ChunkedArray(n, wire.dtype_of(h.meta.dtype), finite=True,
                                name="gradient")


def receive(codec: wire.HandCodec | wire.GeneratedCodec, requests: Iterator[bytes], cls,
            session: bool, grad: buffers.ChunkedArray) -> buffers.ChunkedArray:
    """The pushed gradient into the empty `grad`, checked in full; raises on any fault.
    On a call the trailer must be the last message; on a session the next operation
    follows it."""
    for raw in requests:
        kind, value = codec.read(cls, raw)
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


def skip(codec: wire.HandCodec | wire.GeneratedCodec, requests: Iterator[bytes], cls) -> None:
    """A session's duplicate push: its chunks up to the trailer are not needed."""
    for raw in requests:
        kind, _ = codec.read(cls, raw)
        if kind == "trailer":
            return
        if kind != "chunk":
            raise InvalidArgument(f"{kind} inside a push stream", reason="order")
    raise DataLoss("push stream ended without a trailer", reason="incomplete")


def whole_gradient(whole: wire.Whole, length: int,
                   grad: buffers.ChunkedArray) -> buffers.ChunkedArray:
    """A push in one message (WholePush) to a shard of `length` elements, into the empty
    `grad`, checked as its chunk and trailer would be."""
    h = whole.header
    if h.HasField("compressed") and len(whole.data) != grad.nbytes:
        kind = pb.PushCompressed.Kind.Name(h.compressed.kind)
        raise InvalidArgument(f"a compressed push ({kind}, count {h.compressed.count}) "
                              f"to a shard of {length} elements carries "
                              f"{len(whole.data)} bytes, not {grad.nbytes}",
                              reason="compressed")
    if h.HasField("ranges") and len(whole.data) != grad.nbytes:
        raise InvalidArgument(f"a push of ranges holding {grad.size} elements carries "
                              f"{len(whole.data)} bytes, not {grad.nbytes}", reason="ranges")
    whole.into(grad)
    return grad


def widened(grad: buffers.ChunkedArray, dtype) -> np.ndarray:
    """A received half gradient converted to the shard's dtype, in one pass."""
    out = np.empty(grad.size, dtype)
    grad.copy_to(out)
    return out


def dtype_name(code: int) -> str:
    return pb.DType.Name(code) if code in pb.DType.values() else str(code)
