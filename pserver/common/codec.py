"""Tensors to and from the chunked streams of protos/dtlab_ps.proto.

A tensor stream (PullReply or PushRequest; both number their oneof alike) is

    header (field 1), chunk (field 2) ... chunk, trailer (field 3)

On a Session a tensor that fits in one chunk may also travel as one
message (WholePush, WholePull: header, trailer, then the chunk, its data last
and aligned as a chunk's), read into a `Whole` and checked alike; so does a
push that carries the next pull (WholePush.then_pull) and the answer to both
(PushPulled: the pull's WholePull with the push's reply).

Headers and trailers are small and go through the generated protobuf
classes. Chunks carry the bulk bytes and are encoded and decoded here by hand,
in the same protobuf wire format: the sender writes a few prefix bytes and
the data into the bytes object gRPC sends, checksumming the data in the same
pass (pserver/common/_kernels.c; a join and a checksum without it), padded so that
the data starts 16-byte aligned in the message; the receiver keeps the
received messages and reads the data in place (ChunkedArray), aligned,
without copying it. Any protobuf client in any language can speak the same
contract with the generated classes (GeneratedCodec does, for comparison).

What the hand codec buys is measured end to end by `dtlab.lab.bench.pserver
--mode rounds` (column "x base" of the session rows: the same tensors moved
by a worker and a server that both use the generated classes instead). The
generated classes copy each chunk twice more on the sender (bytes(), then
serialization) and once more on the receiver (parsing). It is kept because
its measured gain is well past the 10% its complexity has to earn (figures:
scripts/RESULTS.md).

The trailer's Adler-32 (RFC 1950) covers all data bytes in order and is
computed incrementally as chunks are made or arrive, by the sender of every
chunk and by its receiver. It replaced CRC-32 because that was the largest
per-byte cost on both ends (ISA-L's CRC-32 costs ~1.7x its Adler-32 per byte
on AVX2 CPUs without AVX-512: see README). What it gives up is CRC-32's
mixing on messages of a few hundred bytes; it still catches the faults the
checksum is there for (a codec bug, a torn or truncated payload), chunk
order is checked separately by `start`, and TCP and TLS guard the link.
"""

from __future__ import annotations

import dataclasses
import sys
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import ml_dtypes
import numpy as np
from google.protobuf.message import DecodeError

from dtlab.protos import dtlab_ps_pb2 as pb
from dtlab.pserver.common.errors import InvalidArgument
from dtlab.pserver.common.kernels import _kernels, adler32

if TYPE_CHECKING:
    from dtlab.pserver.common.buffers import ChunkedArray

HEADER, CHUNK, TRAILER = 1, 2, 3  # oneof field numbers of PullReply and PushRequest
CHUNK_BYTES = 1 << 20  # about 1 MiB per message: the streaming sweet spot

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = {pb.FLOAT32: np.dtype("<f4"), pb.FLOAT64: np.dtype("<f8"), pb.FLOAT16: np.dtype("<f2"),
          pb.BFLOAT16: BFLOAT16}
_CODES = {dt: code for code, dt in DTYPES.items()}
# A float32 shard's values may travel as one of these (PullRequest.dtype, a push's meta.dtype):
# half the bytes, rounded once; the server keeps float32 and converts on receipt.
HALF_CODES = (pb.FLOAT16, pb.BFLOAT16)

SERVICE = pb.DESCRIPTOR.services_by_name["ParameterServer"].full_name  # dtlab.ps.v1.ParameterServer
# a worker's call metadata: the highest replication term of the shard it has seen (an
# orphaned backup of a lower term does not take over: pserver.server.replication.backup)
TERM_KEY = "dtlab-term"

_LEN, _VARINT, _I32, _I64 = 2, 0, 5, 1  # protobuf wire types used here
ADLER_START = 1  # Adler-32 of no bytes: where every running checksum starts
ALIGN = 16  # chunk data starts this many bytes into its message times a whole number
KEEP_BYTES = 64 << 10  # received chunks this big are used in place; smaller ones are copied


def transport_options(max_message_bytes: int) -> list[tuple[str, int]]:
    """gRPC channel/server options, the same on both ends and for the benchmark's ceiling."""
    return [("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes)]


def layout_crc(specs) -> int:
    """CRC-32 (zlib's) of a model's parameter layout: the UTF-8 of "name:d0xd1x...;..." over
    every tensor in flat order (RegisterRequest.layout_crc32; a server's Describe answers
    the text as layout_crc32_input, built by the same rule from its layout)."""
    text = ";".join(f"{s.name}:{'x'.join(map(str, s.shape))}" for s in specs)
    return zlib.crc32(text.encode())


def dtype_code(dtype) -> int:
    """The wire DType of a NumPy dtype (byte order aside)."""
    dt = np.dtype(dtype).newbyteorder("<")
    if dt not in _CODES:
        raise InvalidArgument(f"dtype {np.dtype(dtype)} has no wire encoding", reason="dtype")
    return _CODES[dt]


def dtype_of(code: int) -> np.dtype:
    if code not in DTYPES:
        raise InvalidArgument(f"meta.dtype: unknown DType {code}", reason="dtype")
    return DTYPES[code]


def little_endian(a: np.ndarray) -> np.ndarray:
    """`a` as a contiguous little-endian array (a no-op view on x86 and ARM); bfloat16,
    which has no buffer format, as its bits (uint16)."""
    a = bits(a)
    if sys.byteorder == "little" and a.flags.c_contiguous:
        return a
    return np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<"))


def bits(a: np.ndarray) -> np.ndarray:
    """A bfloat16 array as a uint16 view of its bits (for buffers, copies and checksums;
    its values are converted as floats, never as these integers); any other as it is."""
    return a.view(np.uint16) if a.dtype == BFLOAT16 else a


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf):
            raise InvalidArgument("malformed message: truncated varint")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise InvalidArgument("malformed message: varint longer than 10 bytes")


def _fields(buf: memoryview) -> Iterator[tuple[int, int, object]]:
    """(field number, wire type, value) for each field of a serialized message.

    LEN values are memoryviews into `buf` (zero copy); others are ints.
    """
    pos, end = 0, len(buf)
    while pos < end:
        key, pos = _read_varint(buf, pos)
        field, wtype = key >> 3, key & 7
        if field == 0:
            raise InvalidArgument("malformed message: field number 0")
        if wtype == _VARINT:
            value, pos = _read_varint(buf, pos)
        elif wtype == _LEN:
            n, pos = _read_varint(buf, pos)
            if pos + n > end:
                raise InvalidArgument(f"malformed message: field {field} runs past the end")
            value, pos = buf[pos : pos + n], pos + n
        elif wtype in (_I32, _I64):
            width = 4 if wtype == _I32 else 8
            if pos + width > end:
                raise InvalidArgument(f"malformed message: field {field} runs past the end")
            value, pos = int.from_bytes(buf[pos : pos + width], "little"), pos + width
        else:
            raise InvalidArgument(f"malformed message: field {field} has wire type {wtype}")
        yield field, wtype, value


def split(raw: bytes, fields: frozenset[int] = frozenset((HEADER, CHUNK, TRAILER))
          ) -> tuple[int, memoryview]:
    """The one set oneof field of a stream message (PullReply, PushRequest, SessionRequest,
    SessionReply; `fields`: its oneof's field numbers): (field number, its bytes)."""
    found = None
    for field, wtype, value in _fields(memoryview(raw)):
        if field in fields:
            if wtype != _LEN:
                raise InvalidArgument(f"malformed message: field {field} is not a message")
            if found is not None:
                raise InvalidArgument("malformed message: more than one field of its oneof")
            found = (field, value)
    if found is None:
        raise InvalidArgument("malformed message: none of its oneof fields is set")
    return found


def parse(cls, body: memoryview):
    """A small message (header, trailer) from its bytes, via the generated class."""
    try:
        return cls.FromString(bytes(body))
    except DecodeError as e:
        raise InvalidArgument(f"malformed {cls.__name__}: {e}") from None


def parse_chunk(body: memoryview) -> tuple[int, memoryview]:
    """(start, data) of a Chunk, with data a view into the received bytes."""
    start, data = 0, memoryview(b"")
    for field, wtype, value in _fields(body):
        if field == 1 and wtype == _VARINT:
            start = value
        elif field == 2 and wtype == _LEN:
            data = value
        elif field in (1, 2):
            raise InvalidArgument(f"malformed Chunk: field {field} has wire type {wtype}")
    return start, data


def wrap(field: int, message) -> bytes:
    """A serialized stream message whose oneof field number `field` holds `message`."""
    body = message.SerializeToString()
    return _varint(field << 3 | _LEN) + _varint(len(body)) + body


def header_message(header) -> bytes:
    """A serialized PullReply / PushRequest / Session message holding `header`."""
    return wrap(HEADER, header)


def trailer_message(checksum: int, chunks: int) -> bytes:
    return wrap(TRAILER, pb.Trailer(adler32=checksum, chunks=chunks))


_LEN_KEY = {f: _varint(f << 3 | _LEN) for f in (HEADER, CHUNK, TRAILER)}
_START_KEY, _DATA_KEY, _PAD_KEY = (_varint(f << 3 | t) for f, t in ((1, _VARINT), (2, _LEN),
                                                                       (3, _LEN)))


def _len_field(field: int, body: bytes) -> bytes:
    return _varint(field << 3 | _LEN) + _varint(len(body)) + body


def _chunk_prefix(start: int, nbytes: int, pad: int, field: int, before: bytes) -> bytes:
    """Everything before a chunk's data; `pad` is the pad field's size in bytes, key and
    length included (0: no pad field). field CHUNK: the chunk is the stream message's oneof
    field; another: the chunk is the last field of the message in oneof field `field`,
    after the fields `before`."""
    inner = _START_KEY + _varint(start)
    if pad:
        inner += _PAD_KEY + _varint(pad - 2) + bytes(pad - 2)
    inner += _DATA_KEY + _varint(nbytes)
    chunk = _LEN_KEY[CHUNK] + _varint(len(inner) + nbytes) + inner
    if field == CHUNK:
        return chunk
    return _varint(field << 3 | _LEN) + _varint(len(before) + len(chunk) + nbytes) + before + chunk


def _aligned_prefix(start: int, nbytes: int, field: int = CHUNK, before: bytes = b"") -> bytes:
    """_chunk_prefix with a Chunk.pad that makes the data start ALIGN bytes into the
    message times a whole number, so that a receiver whose message buffers are
    ALIGN-aligned (Python bytes are, at 32 bytes past a 16-byte aligned block) can
    compute on it in place at full SIMD speed."""
    pad = 0
    prefix = _chunk_prefix(start, nbytes, pad, field, before)
    while len(prefix) % ALIGN:
        # a pad field takes at least 2 bytes (key, length); growing the message can also
        # widen its length varint by a byte, hence the loop
        short = -len(prefix) % ALIGN
        pad = pad + short if pad else short if short >= 2 else short + ALIGN
        prefix = _chunk_prefix(start, nbytes, pad, field, before)
    return prefix


def chunk_message(start: int, data: memoryview, checksum: int = ADLER_START) -> tuple[bytes, int]:
    """A serialized PullReply / PushRequest holding Chunk(start, data), data aligned, and
    the running Adler-32 `checksum` continued over data: one pass over data with the C
    kernels (the copy and the checksum, without the GIL), a copy and a checksum of the copy
    without."""
    prefix = _aligned_prefix(start, len(data))
    if _kernels is not None:
        return _kernels.chunk_message(prefix, data, checksum)
    message = b"".join((prefix, data))
    return message, adler32(data_of(message, len(data)), checksum)  # still in cache


def whole_message(field: int, header, data: memoryview, checksum: int,
                  more: bytes = b"") -> bytes:
    """A serialized stream message whose oneof field `field` holds a WholePush, WholePull or
    PushPulled: `header`, the trailer (1 chunk, `checksum`: the Adler-32 of data), the
    serialized fields `more`, then the chunk of all of `data`, data last and aligned as in
    chunk_message."""
    before = (_len_field(HEADER, header.SerializeToString())
              + _len_field(TRAILER, pb.Trailer(chunks=1, adler32=checksum).SerializeToString())
              + more)
    prefix = _aligned_prefix(0, len(data), field, before)
    if _kernels is not None:  # the copy without the GIL
        return _kernels.chunk_message(prefix, data)[0]
    return b"".join((prefix, data))


@dataclass(frozen=True)
class Whole:
    """A WholePush, WholePull or PushPulled as received: data is a view into the received
    bytes; `more`: its other message fields that are set, by name (then_pull, pushed)."""

    header: object
    start: int
    data: memoryview
    trailer: pb.Trailer
    more: dict = dataclasses.field(default_factory=dict)

    def into(self, received: ChunkedArray) -> None:
        """Check the chunk and the trailer as a stream's would be (ChunkedArray.add, finish)."""
        received.add(self.start, self.data)
        received.finish(self.trailer)


def parse_whole(cls, body: memoryview) -> Whole:
    """A WholePush / WholePull / PushPulled (`cls`) with its chunk's data a view into the
    received bytes; an absent part reads as its empty default (and fails the checks)."""
    header_cls = cls.DESCRIPTOR.fields_by_name["header"].message_type._concrete_class
    header, (start, data), trailer = header_cls(), (0, memoryview(b"")), pb.Trailer()
    more, others = {}, _more_fields(cls)
    for number, wtype, value in _fields(body):
        if (number in (HEADER, CHUNK, TRAILER) or number in others) and wtype != _LEN:
            raise InvalidArgument(f"malformed {cls.__name__}: field {number} has wire type "
                                  f"{wtype}")
        if number == HEADER:
            header = parse(header_cls, value)
        elif number == CHUNK:
            start, data = parse_chunk(value)
        elif number == TRAILER:
            trailer = parse(pb.Trailer, value)
        elif number in others:
            name, sub = others[number]
            more[name] = parse(sub, value)
    return Whole(header, start, data, trailer, more)


def _more_fields(cls) -> dict[int, tuple[str, type]]:
    """A whole message class's message fields beyond header, chunk and trailer:
    number -> (name, class)."""
    return {f.number: (f.name, f.message_type._concrete_class) for f in cls.DESCRIPTOR.fields
            if f.number not in (HEADER, CHUNK, TRAILER) and f.message_type is not None}


def _serialized_more(cls, more: dict) -> bytes:
    """The fields `more` (name -> message) of whole message class `cls`, serialized."""
    numbers = cls.DESCRIPTOR.fields_by_name
    return b"".join(_len_field(numbers[name].number, m.SerializeToString())
                    for name, m in more.items())


def chunk_bounds(n: int, itemsize: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """Element ranges [lo, hi) of about `chunk_bytes` bytes covering [0, n)."""
    step = max(1, chunk_bytes // itemsize)
    return [(lo, min(n, lo + step)) for lo in range(0, n, step)] or [(0, 0)]


class HandCodec:
    """Chunks encoded and decoded here (one pass, aligned, read in place); the small
    messages of a stream through the generated classes."""

    name = "hand"

    def chunk_message(self, start: int, data: memoryview, checksum: int) -> tuple[bytes, int]:
        return chunk_message(start, data, checksum)

    def whole_message(self, cls, name: str, header, data: memoryview, checksum: int,
                      **more) -> bytes:
        """A `cls` message whose oneof field `name` (a WholePush / WholePull / PushPulled)
        holds `header`, all of `data` (Adler-32 `checksum`) and the message fields `more`."""
        number = _oneof(cls).numbers_by_name[name]
        whole_cls = _oneof(cls).fields[number][1]
        return whole_message(number, header, data, checksum, _serialized_more(whole_cls, more))

    def read(self, cls, raw: bytes) -> tuple[str, object]:
        """The set oneof field of a `cls` stream message: (its name, the sub-message;
        (start, data) for a chunk, a Whole for a WholePush / WholePull / PushPulled, data a
        view into `raw`)."""
        oneof = _oneof(cls)
        number, body = split(raw, oneof.numbers)
        name, sub = oneof.fields[number]
        if number == CHUNK:
            return name, parse_chunk(body)
        return name, parse_whole(sub, body) if sub in _WHOLE else parse(sub, body)


class GeneratedCodec:
    """Every message through the generated classes: the baseline the hand codec is
    measured against (dtlab.lab.bench.pserver --mode rounds), and what any gRPC client
    of the .proto does."""

    name = "generated"

    def chunk_message(self, start: int, data: memoryview, checksum: int) -> tuple[bytes, int]:
        message = pb.PullReply(chunk=pb.Chunk(start=start, data=bytes(data)))
        return message.SerializeToString(), adler32(data, checksum)

    def whole_message(self, cls, name: str, header, data: memoryview, checksum: int,
                      **more) -> bytes:
        whole_cls = _oneof(cls).fields[_oneof(cls).numbers_by_name[name]][1]
        whole = whole_cls(header=header, chunk=pb.Chunk(start=0, data=bytes(data)),
                          trailer=pb.Trailer(chunks=1, adler32=checksum), **more)
        return cls(**{name: whole}).SerializeToString()

    def read(self, cls, raw: bytes) -> tuple[str, object]:
        try:
            message = cls.FromString(raw)
        except DecodeError as e:
            raise InvalidArgument(f"malformed {cls.__name__}: {e}") from None
        name = message.WhichOneof("kind")
        if name is None:
            raise InvalidArgument("malformed message: none of its oneof fields is set")
        value = getattr(message, name)
        if name == "chunk":
            return name, (value.start, memoryview(value.data))
        if type(value) in _WHOLE:
            more = {f: getattr(value, f) for f, _ in _more_fields(type(value)).values()
                    if value.HasField(f)}
            return name, Whole(value.header, value.chunk.start, memoryview(value.chunk.data),
                               value.trailer, more)
        return name, value


CODECS = {c.name: c for c in (HandCodec(), GeneratedCodec())}
HAND = CODECS["hand"]


_WHOLE = (pb.WholePush, pb.WholePull, pb.PushPulled)


@dataclass(frozen=True)
class _Oneof:
    numbers: frozenset[int]
    fields: dict[int, tuple[str, type]]  # number -> (name, message class)
    numbers_by_name: dict[str, int]


_ONEOFS: dict[type, _Oneof] = {}


def _oneof(cls) -> _Oneof:
    """The `kind` oneof of a stream message class, read from its descriptor once."""
    if cls not in _ONEOFS:
        fields = {f.number: (f.name, f.message_type._concrete_class)
                  for f in cls.DESCRIPTOR.oneofs_by_name["kind"].fields}
        _ONEOFS[cls] = _Oneof(frozenset(fields), fields,
                              {name: number for number, (name, _) in fields.items()})
    return _ONEOFS[cls]


def stream(header, values: np.ndarray, chunk_bytes: int = CHUNK_BYTES,
           codec: HandCodec | GeneratedCodec = HAND) -> Iterator[bytes]:
    """Header, chunks and trailer of one flat tensor, checksummed as chunks are made."""
    values = little_endian(values)
    raw = memoryview(values).cast("B")
    isz = values.itemsize
    yield header_message(header)
    checksum, count = ADLER_START, 0
    for lo, hi in chunk_bounds(values.size, isz, chunk_bytes):
        message, checksum = codec.chunk_message(lo, raw[lo * isz : hi * isz], checksum)
        count += 1
        yield message
    yield trailer_message(checksum, count)


def whole(cls, name: str, header, values: np.ndarray,
          codec: HandCodec | GeneratedCodec = HAND, **more) -> bytes:
    """A flat tensor's whole stream in one `cls` message (oneof field `name`: a WholePush or
    WholePull): the header, all of the values as one chunk, their Adler-32, and the message
    fields `more` (WholePush.then_pull)."""
    raw = memoryview(little_endian(values)).cast("B")
    return codec.whole_message(cls, name, header, raw, adler32(raw), **more)


def data_of(message: bytes, nbytes: int) -> memoryview:
    """The data bytes at the end of a chunk message."""
    return memoryview(message)[len(message) - nbytes :]
