"""Element ranges of a flat vector: the parts of a gradient a push carries.

A Mixture-of-Experts layer sends each token to k of its N experts; an expert
that kept no token row in a step has an exactly-zero gradient (its matmuls saw
no rows, so nothing was accumulated into it). A worker therefore pushes only
the ranges of its flat gradient that are not such an expert's parameters
(pserver.worker.expert_push), each shard gets the ranges that meet its slice, and the
server updates exactly those (pserver.server.cache_blocked.BlockedOptimizer.step_ranges),
as a sparse/lazy optimizer does for embedding rows (TensorFlow's
LazyAdamOptimizer; PyTorch's SparseAdam: "only the moments that show up in
the gradient get updated, and only those portions of the gradient get
applied to the parameters").

A range list is [(lo, hi), ...]: half-open element ranges, sorted, disjoint and
non-empty. On the wire (PushRanges) a push's ranges are (offset, length)
pairs relative to the shard's first element, and the data is their values
back to back ("packed"): sum(hi - lo) elements.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Sequence

import numpy as np

from dtlab.protos import dtlab_ps_pb2 as pb
from dtlab.pserver.common.errors import InvalidArgument

Ranges = list[tuple[int, int]]

# an expert's parameters: "<layer>.e<j>.<tensor>" inside a MoE layer ("h0.moe.e3.fc.W")
EXPERT_PARAM = re.compile(r"^(.*\.moe\.e\d+)\.")


def merged(ranges: Iterable[tuple[int, int]]) -> Ranges:
    """The union of `ranges` as few sorted, disjoint ranges as possible (touching ones
    joined, empty ones dropped)."""
    out: Ranges = []
    for lo, hi in sorted(r for r in ranges if r[1] > r[0]):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


def without(size: int, removed: Iterable[tuple[int, int]]) -> Ranges:
    """[0, size) less the union of `removed`, merged."""
    out, at = [], 0
    for lo, hi in merged(removed):
        if lo > at:
            out.append((at, lo))
        at = max(at, hi)
    if at < size:
        out.append((at, size))
    return out


def within(ranges: Ranges, lo: int, hi: int) -> Ranges:
    """The parts of `ranges` inside [lo, hi), relative to lo (a shard's view of the
    model's ranges)."""
    return [(max(a, lo) - lo, min(b, hi) - lo) for a, b in ranges if a < hi and b > lo]


def within_packed(ranges: Ranges, lo: int, hi: int) -> tuple[Ranges, int]:
    """within(ranges, lo, hi), and where their values start in the packed data of
    `ranges` (being sorted, the parts inside [lo, hi) are one run of it)."""
    inside, start = [], None
    for a, b, at in packed(ranges):
        if a < hi and b > lo:
            start = at + max(a, lo) - a if start is None else start
            inside.append((max(a, lo) - lo, min(b, hi) - lo))
    return inside, 0 if start is None else start


def size(ranges: Ranges) -> int:
    return sum(hi - lo for lo, hi in ranges)


def packed(ranges: Ranges) -> Iterator[tuple[int, int, int]]:
    """(lo, hi, at) per range: `at` is where its values start in the packed data."""
    at = 0
    for lo, hi in ranges:
        yield lo, hi, at
        at += hi - lo


def gather(values: np.ndarray, ranges: Ranges) -> np.ndarray:
    """The values of `ranges` back to back (a new contiguous array of size(ranges))."""
    out = np.empty(size(ranges), values.dtype)
    for lo, hi, at in packed(ranges):
        out[at : at + hi - lo] = values[lo:hi]
    return out


def scatter(out: np.ndarray, data, ranges: Ranges) -> None:
    """out[ranges] = the packed `data` (an array, or buffers.ChunkedArray)."""
    for lo, hi, at in packed(ranges):
        out[lo:hi] = data[at : at + hi - lo]


def encode(ranges: Ranges) -> pb.PushRanges:
    return pb.PushRanges(offset=[lo for lo, _ in ranges], length=[hi - lo for lo, hi in ranges])


def decode(message: pb.PushRanges, length: int) -> Ranges:
    """The ranges of a push to a shard of `length` elements; InvalidArgument (reason
    "ranges") naming the first fault: counts that differ, an empty range, one out of
    order or overlapping the one before, one past the shard's end."""
    offsets, lengths = list(message.offset), list(message.length)
    if len(offsets) != len(lengths):
        raise InvalidArgument(f"ranges: {len(offsets)} offsets but {len(lengths)} lengths",
                              reason="ranges")
    out: Ranges = []
    for i, (lo, n) in enumerate(zip(offsets, lengths, strict=True)):
        if n == 0:
            raise InvalidArgument(f"ranges[{i}] at {lo} is empty", reason="ranges")
        if out and lo < out[-1][1]:
            raise InvalidArgument(
                f"ranges[{i}] starts at {lo}, inside or before ranges[{i - 1}] "
                f"[{out[-1][0]}, {out[-1][1]}): ranges must be sorted and disjoint",
                reason="ranges")
        if lo + n > length:
            raise InvalidArgument(f"ranges[{i}] [{lo}, {lo + n}) runs past the shard's "
                                  f"{length} elements", reason="ranges")
        out.append((lo, lo + n))
    return out


def expert_ranges(specs: Sequence) -> dict[str, Ranges]:
    """Each MoE expert's parameters in a flat vector laid out as `specs` (in order):
    {"h0.moe.e3": ranges}, merged (one range where its tensors are adjacent)."""
    found: dict[str, Ranges] = {}
    at = 0
    for spec in specs:
        m = EXPERT_PARAM.match(spec.name)
        if m:
            found.setdefault(m.group(1), []).append((at, at + spec.size))
        at += spec.size
    return {name: merged(r) for name, r in found.items()}
