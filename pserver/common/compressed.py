"""Compressed pushes on the wire (PushCompressed): a worker's compressed gradient cut into
its shards' payloads, and a shard's payload checked and decoded into what the store applies.

The worker compresses its whole flat gradient with error feedback (models/compress.py:
Stich et al. 2018, top-k and random-k; Karimireddy et al. 2019, the scaled sign); each
shard then gets the part of the payload that falls in its slice [lo, hi):

    INDEXED  top-k, random-k   the k_s indices in [lo, hi), minus lo, as little-endian
                               uint32 (strictly ascending), then their k_s values:
                               k_s (4 + b) bytes, so k (4 + b) over the shards (random-k
                               sends its indices too: a server does not draw them)
    SIGN     sign               the bits of [lo, hi) packed again from bit 0
                               (numpy.packbits: element i in bit 7 - i % 8 of byte i / 8,
                               1 for +scale), then the scale |p|_1 / n of the whole
                               gradient (one value, b bytes): ceil((hi - lo) / 8) + b bytes

(b: the bytes of one value, the shard's dtype). The server turns an INDEXED part into a
push of the ranges its indices make (runs of consecutive indices; the values are packed in
that order already), applied by the store's ranged push to those elements only, and a SIGN
part into the dense gradient +-scale in the shard's dtype, computed as models/compress.py
decompresses it (zeros plus +-scale), so that the two agree bit for bit. Anything else is
refused (InvalidArgument, reason "compressed") naming the first fault, before the store
sees it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dtlab.models.compress import RandKPayload, SignPayload, TopKPayload
from dtlab.protos import dtlab_ps_pb2 as pb
from dtlab.pserver.common.errors import InvalidArgument
from dtlab.pserver.common.ranges import Ranges

INDEX = np.dtype("<u4")  # a shard's element index on the wire


@dataclass(frozen=True)
class Part:
    """One shard's share of a compressed push: its PushCompressed and its bytes."""

    message: pb.PushCompressed
    data: np.ndarray  # (nbytes,) uint8, as it travels
    dtype: np.dtype  # of the values (the push's meta.dtype)


def _bytes(a: np.ndarray) -> np.ndarray:
    """`a` little-endian, as its bytes (uint8)."""
    return np.ascontiguousarray(a, a.dtype.newbyteorder("<")).view(np.uint8)


def split(payload, bounds: Sequence[tuple[int, int]], indices=None) -> list[Part]:
    """The parts of `payload` (models/compress.py's TopKPayload, RandKPayload with its
    `indices`, or SignPayload of the whole flat gradient) for shards [lo, hi) `bounds`."""
    if isinstance(payload, SignPayload):
        n = bounds[-1][1]
        plus = np.unpackbits(payload.bits, count=n)  # (n,) 1 for p_i >= 0
        scale = _bytes(np.asarray([payload.scale]))
        return [Part(pb.PushCompressed(kind=pb.PushCompressed.SIGN),
                     np.concatenate([np.packbits(plus[lo:hi]), scale]), payload.scale.dtype)
                for lo, hi in bounds]
    if isinstance(payload, RandKPayload):
        idx = indices
    elif isinstance(payload, TopKPayload):
        idx = payload.indices
    else:
        raise TypeError(f"{type(payload).__name__}: the servers take top-k, random-k or sign")
    idx, values = np.asarray(idx), np.asarray(payload.values)  # (k,) ascending, (k,)
    cuts = np.searchsorted(idx, [lo for lo, _ in bounds] + [bounds[-1][1]])
    parts = []
    for (lo, _), a, b in zip(bounds, cuts[:-1], cuts[1:], strict=True):
        mine = (idx[a:b] - lo).astype(INDEX)  # (k_s,) relative to the shard
        parts.append(Part(pb.PushCompressed(kind=pb.PushCompressed.INDEXED, count=b - a),
                          np.concatenate([_bytes(mine), _bytes(values[a:b])]), values.dtype))
    return parts


def expected_bytes(message: pb.PushCompressed, length: int, itemsize: int) -> int:
    """The bytes a part of `message` carries to a shard of `length` elements."""
    if message.kind == pb.PushCompressed.INDEXED:
        return message.count * (INDEX.itemsize + itemsize)
    if message.kind == pb.PushCompressed.SIGN:
        return math.ceil(length / 8) + itemsize
    raise InvalidArgument(f"compressed.kind {message.kind}: INDEXED or SIGN",
                          reason="compressed")


def check_header(message: pb.PushCompressed, length: int) -> None:
    """What the header alone tells: a known kind, a count that fits the shard."""
    if message.kind not in (pb.PushCompressed.INDEXED, pb.PushCompressed.SIGN):
        raise InvalidArgument(f"compressed.kind {message.kind}: INDEXED or SIGN",
                              reason="compressed")
    if message.kind == pb.PushCompressed.INDEXED and message.count > length:
        raise InvalidArgument(f"compressed.count {message.count}: the shard holds {length} "
                              "elements", reason="compressed")
    if message.kind == pb.PushCompressed.SIGN and message.count:
        raise InvalidArgument(f"compressed.count {message.count}: a SIGN push has none",
                              reason="compressed")


def decode(message: pb.PushCompressed, data: np.ndarray, length: int,
           dtype) -> tuple[np.ndarray, Ranges | None]:
    """A shard's part (its bytes `data`, uint8) as (values, ranges): the packed values of
    the ranges an INDEXED part's indices make, or (SIGN) the dense gradient and None."""
    dtype = np.dtype(dtype)
    check_header(message, length)
    want = expected_bytes(message, length, dtype.itemsize)
    if data.size != want:
        kind = pb.PushCompressed.Kind.Name(message.kind)
        raise InvalidArgument(f"a compressed push ({kind}, count {message.count}) to a shard of "
                              f"{length} elements carries {data.size} bytes, not {want}",
                              reason="compressed")
    wire_dtype = dtype.newbyteorder("<")
    if message.kind == pb.PushCompressed.SIGN:
        nbits = math.ceil(length / 8)
        scale = data[nbits:].view(wire_dtype).astype(dtype)[0]
        if not (np.isfinite(scale) and scale >= 0):
            raise InvalidArgument(f"a SIGN push's scale is {scale}: finite and >= 0",
                                  reason="compressed")
        plus = np.unpackbits(data[:nbits], count=length).astype(bool)  # (length,)
        dense = np.zeros(length, dtype)
        dense += np.where(plus, scale, -scale)  # as models.compress.Sign.accumulate
        return dense, None
    k = message.count
    idx = data[: k * INDEX.itemsize].view(INDEX).astype(np.int64)  # (k,)
    values = data[k * INDEX.itemsize:].view(wire_dtype).astype(dtype)  # (k,) a copy
    if k and idx.max() >= length:
        bad = int(np.argmax(idx >= length))
        raise InvalidArgument(f"compressed index [{bad}] = {idx[bad]} is outside the shard's "
                              f"{length} elements", reason="compressed")
    steps = np.diff(idx)
    if (steps <= 0).any():
        bad = int(np.argmax(steps <= 0)) + 1
        what = "a duplicate of" if steps[bad - 1] == 0 else "below"
        raise InvalidArgument(f"compressed index [{bad}] = {idx[bad]} is {what} index "
                              f"[{bad - 1}]: indices must be strictly ascending",
                              reason="compressed")
    if not np.isfinite(values).all():
        bad = int(np.argmax(~np.isfinite(values)))
        raise InvalidArgument(f"compressed value [{bad}] (element {idx[bad]}) is "
                              f"{values[bad]}: non-finite values are rejected",
                              reason="nonfinite")
    return values, runs(idx)


def runs(idx: np.ndarray) -> Ranges:
    """The ranges [lo, hi) of consecutive elements among ascending distinct `idx`."""
    if not idx.size:
        return []
    breaks = np.flatnonzero(np.diff(idx) != 1) + 1  # where a new run starts
    starts = idx[np.r_[0, breaks]]
    ends = idx[np.r_[breaks - 1, idx.size - 1]] + 1
    return list(zip(starts.tolist(), ends.tolist(), strict=True))
