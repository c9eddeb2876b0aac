"""The two ends of a tensor stream in memory: `Snapshot`, one version of a shard's
tensor streamed to any number of readers, copied only when an update overtakes a
running pull; `ChunkedArray`, a received stream kept in the messages it arrived
in and checked as they arrive (order, size, Adler-32, finiteness). The messages
themselves are pserver.common.codec's."""

from __future__ import annotations

import bisect
import threading
import time
from collections.abc import Iterator

import numpy as np

from dtlab.protos import dtlab_ps_pb2 as pb
from dtlab.pserver.common.codec import (
    ADLER_START,
    BFLOAT16,
    CHUNK_BYTES,
    HAND,
    KEEP_BYTES,
    GeneratedCodec,
    HandCodec,
    bits,
    chunk_bounds,
    header_message,
    little_endian,
    trailer_message,
)
from dtlab.pserver.common.errors import DataLoss, InvalidArgument
from dtlab.pserver.common.kernels import _kernels, adler32


class Snapshot:
    """One version of a tensor, streamed to any number of readers.

    A snapshot starts out live: `values` is the tensor itself (the shard's
    parameters), not a copy. Before the store changes the tensor while a
    reader is still streaming, it calls `freeze`, which copies the values
    once into a spare array for the readers to go on from; a version that no
    pull is streaming when the next update comes is never copied at all. That
    saves a 64 MB pull the copy every version used to get when first read
    (memory to memory, under the store's lock), and costs an
    update that overtakes a running pull the same copy, made then instead.

    Each reader makes its chunk messages as it streams them (one copy each,
    into a 1 MiB bytes object that the allocator recycles as soon as gRPC has
    sent it); building all messages up front would allocate the whole tensor
    anew per version, and on 64 MB its page faults cost 8x the copy. Each
    reader continues the running checksum as it makes a message (one pass
    with the C kernels); the first to reach a chunk records it.
    Whatever reads `values` holds `_lock`, and so does `freeze`. `readers`
    counts the streams using the snapshot (kept by the shard store, under its
    lock, so that it knows whether to freeze and when a frozen array is free).
    """

    def __init__(self, values: np.ndarray, chunk_bytes: int = CHUNK_BYTES):
        self.values = little_endian(values)
        self.chunk_bytes = chunk_bytes
        self.bounds = chunk_bounds(values.size, values.itemsize, chunk_bytes)
        self.nbytes = self.values.nbytes
        self.readers = 0
        self.frozen = False
        self._sums: list[int] = []  # running Adler-32 through each chunk
        self._lock = threading.Lock()

    def freeze(self, spare: np.ndarray) -> None:
        """Copy the values into `spare` and serve them from there: the tensor will change."""
        with self._lock:
            np.copyto(spare, self.values)
            self.values, self.frozen = little_endian(spare), True

    def _piece(self, i: int) -> memoryview:
        isz, (lo, hi) = self.values.itemsize, self.bounds[i]
        return memoryview(self.values).cast("B")[lo * isz : hi * isz]

    def _message(self, i: int, codec: HandCodec | GeneratedCodec) -> bytes:
        """Chunk i's message; the first reader to get here extends the running checksum
        (every reader has been through chunks 0..i-1, so the sums reach at least i)."""
        with self._lock:
            previous = self._sums[i - 1] if i else ADLER_START
            message, checksum = codec.chunk_message(self.bounds[i][0], self._piece(i), previous)
            self._record(i, checksum)
            return message

    def _record(self, i: int, checksum: int) -> None:
        if len(self._sums) == i:
            self._sums.append(checksum)

    @property
    def one_chunk(self) -> bool:
        return len(self.bounds) == 1

    def whole(self, cls, name: str, header, codec: HandCodec | GeneratedCodec = HAND,
              **more) -> bytes:
        """The tensor (one_chunk) in one `cls` message, its oneof field `name` a WholePull or
        a PushPulled (`more`: its pushed)."""
        with self._lock:
            if not self._sums:
                self._record(0, adler32(self._piece(0)))
            return codec.whole_message(cls, name, header, self._piece(0), self._sums[0], **more)

    def stream(self, header, codec: HandCodec | GeneratedCodec = HAND) -> Iterator[bytes]:
        yield header_message(header)
        for i in range(len(self.bounds)):
            yield self._message(i, codec)
        yield trailer_message(self._sums[-1], len(self.bounds))

    def rounded(self, dtype) -> Snapshot:
        """A snapshot of these values rounded to `dtype` (a pull's wire dtype), of its own."""
        with self._lock:
            return Snapshot(self.values.astype(dtype), self.chunk_bytes)

    def copy_into(self, out: np.ndarray) -> int:
        """out[:] = the values, chunk by chunk (an update may freeze them in between);
        returns the Adler-32 of all their bytes."""
        checksum = ADLER_START
        for i, (lo, hi) in enumerate(self.bounds):
            with self._lock:
                piece = self.values[lo:hi]
                checksum = copy_and_checksum(out[lo:hi], piece, checksum)
                self._record(i, checksum)
        return checksum


ADLER_BASE = 65521  # RFC 1950's modulus


def adler32_combine(first: int, second: int, second_bytes: int) -> int:
    """The Adler-32 of A + B from that of A (`first`) and of B alone (`second`, started at
    1), B being `second_bytes` long: zlib's adler32_combine (B's s1 terms each add A's s1
    once per byte of B to s2)."""
    rem = second_bytes % ADLER_BASE
    s1 = first & 0xFFFF
    s2 = rem * s1 % ADLER_BASE
    s1 += (second & 0xFFFF) + ADLER_BASE - 1
    s2 += (first >> 16) + (second >> 16) + ADLER_BASE - rem
    return (s1 % ADLER_BASE) | (s2 % ADLER_BASE) << 16


def copy_and_checksum(out: np.ndarray, values: np.ndarray, checksum: int) -> int:
    """out[:] = values, and the running Adler-32 continued over them."""
    out, values = bits(out), bits(values)
    if _kernels is not None:
        return _kernels.copy_into(out, values, checksum)
    out[...] = values
    return adler32(out, checksum)


def checksum_and_first_nonfinite(values: np.ndarray, checksum: int) -> tuple[int, int]:
    """The running Adler-32 continued over `values`, and the index of their first
    non-finite element (-1 if none)."""
    if _kernels is not None and values.dtype != BFLOAT16:  # its 2-byte test is IEEE half's
        return _kernels.check_chunk(values, values.itemsize, checksum)
    finite = np.isfinite(values)
    first = -1 if finite.all() else int(np.flatnonzero(~finite)[0])
    return adler32(bits(values), checksum), first


BACKWARD_BLOCK_BYTES = 1 << 20  # the pieces a backward pass takes, each read forward


def backward_blocks(size: int, itemsize: int) -> list[tuple[int, int]]:
    """[lo, hi) element blocks of about BACKWARD_BLOCK_BYTES covering [0, size), last first.

    A pass over a tensor larger than the last-level cache leaves its end in the cache; the
    next pass, in this or another process on the host (shared memory), finds there what
    it reads first only if it runs the other way. So consecutive passes of a round through
    shared memory alternate direction, the Adler-32 kept exact by taking each block's from
    the start value and combining them in order (adler32_combine)."""
    step = max(1, BACKWARD_BLOCK_BYTES // itemsize)
    return [(lo, min(size, lo + step)) for lo in reversed(range(0, size, step))]


def combined(blocks: list[tuple[int, int]], sums: list[int], itemsize: int,
             checksum: int) -> int:
    """`checksum` continued over the blocks in element order, from each block's own
    Adler-32 (started at ADLER_START), blocks and sums in the same (any) order."""
    for (lo, hi), block in sorted(zip(blocks, sums, strict=True)):
        checksum = adler32_combine(checksum, block, (hi - lo) * itemsize)
    return checksum


def copy_and_checksum_backward(out: np.ndarray, values: np.ndarray, checksum: int) -> int:
    """copy_and_checksum, the blocks taken last to first (backward_blocks)."""
    blocks = backward_blocks(values.size, values.itemsize)
    sums = [copy_and_checksum(out[lo:hi], values[lo:hi], ADLER_START) for lo, hi in blocks]
    return combined(blocks, sums, values.itemsize, checksum)


def checksum_and_first_nonfinite_backward(values: np.ndarray,
                                          checksum: int) -> tuple[int, int]:
    """checksum_and_first_nonfinite, the blocks taken last to first (backward_blocks)."""
    blocks = backward_blocks(values.size, values.itemsize)
    sums, first = [], -1
    for lo, hi in blocks:
        block, bad = checksum_and_first_nonfinite(values[lo:hi], ADLER_START)
        sums.append(block)
        if bad >= 0:
            first = lo + bad  # a block nearer the start comes later
    return combined(blocks, sums, values.itemsize, checksum), first


class ChunkedArray:
    """A flat tensor received as a chunk stream, kept in the messages it arrived in.

    Each chunk's data becomes a read-only NumPy view into its received bytes
    (aligned, thanks to the sender's pad): nothing is copied into a separate
    buffer. `add` checks each chunk's place (order, whole elements, within
    the length) and folds it into the running Adler-32, with `finite` also
    rejecting non-finite values (one pass with the C kernels); `finish`
    checks the trailer. Nothing is trusted before `finish` returns. Given
    `into` (a pull: the model's buffer), each chunk is instead copied there
    in the same pass as its checksum, and no message is kept.

    That per-chunk work runs on the receiving side while the stream is on.
    It costs little there: the sender makes every message as gRPC asks for
    it (a copy and a checksum), so it is the sender's core, not the
    receiver's, that sets the pace. Done after the trailer instead, the
    chunks would have to come back from memory.

    Chunks under KEEP_BYTES are copied instead, consecutive ones into one
    piece of a tensor-sized buffer, so that what a stream holds stays within
    about twice the tensor's size however small a sender cuts its chunks.
    Slicing gives a view when the slice lies inside one piece (an optimizer
    block of the chunk size always does) and a copy otherwise.
    """

    def __init__(self, size: int, dtype, finite: bool = False, name: str = "tensor",
                 into: np.ndarray | None = None):
        self.dtype = np.dtype(dtype).newbyteorder("<")
        self.size, self.shape = size, (size,)
        self.nbytes = size * self.dtype.itemsize
        if into is not None and finite:
            raise ValueError("a ChunkedArray checks finite values or copies `into`, not both")
        if into is not None and (into.shape != self.shape or into.dtype != self.dtype
                                 or not into.flags.c_contiguous):
            raise ValueError(f"into: {into.dtype} {into.shape}, expected a contiguous "
                             f"{self.dtype} {self.shape}")
        self.finite, self.name, self.into = finite, name, into
        self.starts: list[int] = []
        self.pieces: list[np.ndarray] = []
        self.filled = self.chunks = 0
        self.checksum = ADLER_START
        self.check_seconds = 0.0  # in the checksum, the finiteness check, the copy `into`
        self._copies: np.ndarray | None = None  # small chunks, copied
        self._run: int | None = None  # where the current run of copied chunks starts

    def add(self, start: int, data: memoryview) -> None:
        isz = self.dtype.itemsize
        if start != self.filled:
            raise InvalidArgument(
                f"chunk.start {start}: expected {self.filled} (chunks must cover the tensor "
                "in order, without gaps or overlaps)", reason="chunk")
        if len(data) % isz:
            raise InvalidArgument(
                f"chunk at {start}: {len(data)} bytes is not a whole number of "
                f"{isz}-byte elements", reason="chunk")
        hi = start + len(data) // isz
        if hi > self.size:
            raise InvalidArgument(
                f"chunk [{start}, {hi}) runs past the tensor length {self.size}", reason="length")
        values = np.frombuffer(data, self.dtype)
        t0 = time.perf_counter()
        if self.finite:
            self.checksum, bad = checksum_and_first_nonfinite(values, self.checksum)
            if bad >= 0:
                raise InvalidArgument(f"{self.name} element {start + bad} is {values[bad]}: "
                                      "non-finite values are rejected", reason="nonfinite")
        elif self.into is not None:
            self.checksum = copy_and_checksum(self.into[start:hi], values, self.checksum)
        else:
            self.checksum = adler32(bits(values), self.checksum)
        self.check_seconds += time.perf_counter() - t0
        if self.into is None:
            self._keep(start, values)
        self.filled, self.chunks = hi, self.chunks + 1

    def _keep(self, start: int, values: np.ndarray) -> None:
        """A big chunk is kept as it arrived; small ones are copied into one run."""
        if values.nbytes >= KEEP_BYTES:
            self._end_run()
            self.starts.append(start)
            self.pieces.append(values)
            return
        if self._copies is None:
            self._copies = np.empty(self.size, self.dtype)
        self._copies[start : start + values.size] = values
        self._run = start if self._run is None else self._run

    def _end_run(self) -> None:
        """The copied chunks since the last kept one become one piece."""
        if self._run is not None:
            self.starts.append(self._run)
            self.pieces.append(self._copies[self._run : self.filled])
            self._run = None

    def finish(self, trailer: pb.Trailer) -> None:
        self._end_run()
        if self.filled != self.size:
            raise DataLoss(f"stream ended at element {self.filled} of {self.size}",
                           reason="incomplete")
        if trailer.chunks != self.chunks:
            raise DataLoss(f"trailer.chunks {trailer.chunks} != {self.chunks} chunks received",
                           reason="incomplete")
        if trailer.adler32 != self.checksum:
            raise DataLoss(f"trailer.adler32 {trailer.adler32:#010x} != {self.checksum:#010x} "
                           "computed over the received bytes", reason="checksum")

    def __getitem__(self, index: slice) -> np.ndarray:
        if self.into is not None:
            raise ValueError("this ChunkedArray copied its chunks `into` an array; slice that")
        lo, hi, step = index.indices(self.size)
        if step != 1:
            raise IndexError("ChunkedArray supports contiguous slices only")
        if hi <= lo:
            return np.empty(0, self.dtype)
        k = max(0, bisect.bisect_right(self.starts, lo) - 1)
        first = self.pieces[k]
        if hi - self.starts[k] <= first.size:
            return first[lo - self.starts[k] : hi - self.starts[k]]
        out = np.empty(hi - lo, self.dtype)
        self.copy_to(out, lo)
        return out

    def copy_to(self, out: np.ndarray, lo: int = 0) -> None:
        """out[:] = self[lo : lo + out.size]."""
        hi = lo + out.size
        for start, piece in zip(self.starts, self.pieces, strict=True):
            a, b = max(lo, start), min(hi, start + piece.size)
            if a < b:
                out[a - lo : b - lo] = piece[a - start : b - start]
