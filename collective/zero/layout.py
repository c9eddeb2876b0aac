"""The flat parameter buffer cut into units, each unit into one segment per rank (ZeRO's
partitioning, FSDP's per-unit flat-parameter sharding), and the bytes our ring sends.

    layout = Layout(units_of(model.body.modules, params.offsets, params.size), rank, n)
    lo, hi = layout.mine[u]      # this rank's segment of unit u in the flat buffer
    at, end = layout.packed[u]   # the same segment in this rank's packed shard

A unit is one top-level module of the body that holds parameters (an MLP layer, the
embedding, a transformer block, the final norm, the head): parameters are laid out in
forward order, so each unit is one contiguous range [lo, hi) of the flat buffer, and
backward finishes the units from the last to the first. Unit u is cut like our
reduce-scatter cuts a buffer (ring.segment_bounds: the first (hi - lo) % n ranks get one
element more), so the reduce-scatter of a unit's gradient leaves rank r exactly its
segment, and the all-gather of the segments rebuilds the unit. Rank r's shard is its
segments of every unit, back to back (Rajbhandari et al. 2020, "ZeRO: Memory
Optimizations Toward Training Trillion Parameter Models"; Zhao et al. 2023, "PyTorch
FSDP"): every collective is balanced (segments differ by at most one element), whatever
the sizes of the units.

Bytes on the wire (RingTraffic): in collective/algorithms/ring.py the rank at ring position p sends,
at step t, the segment of the rank at position ring.sent_segment(p, t, n); summing those
over the reduce-scatter's steps [0, n - 1) gives every segment but its own, over the
all-gather's steps [n - 1, 2n - 2) every segment but its right neighbour's: (L - L/n)
elements each, about L (n - 1)/n, the ring's bandwidth-optimal count.
"""

from __future__ import annotations

from dataclasses import dataclass

from dtlab.collective.algorithms.ring import segment_bounds, sent_segment
from dtlab.collective.transport.order import ring_order
from dtlab.models.optim import complement


@dataclass(frozen=True)
class Unit:
    """One module's contiguous range of the flat buffer."""

    name: str
    module: int  # its index in the body's modules
    names: tuple[str, ...]  # its parameters, in layout order
    lo: int
    hi: int

    @property
    def size(self) -> int:
        return self.hi - self.lo


def units_of(modules, offsets: dict[str, tuple[int, int]], size: int) -> list[Unit]:
    """The units of a body's `modules` (those holding parameters), checked to tile the
    flat buffer [0, size) in order; ValueError when they do not (e.g. a layout that
    moves experts after the dense parameters)."""
    units, end = [], 0
    for i, m in enumerate(modules):
        names = tuple(s.name for s in m.specs())
        if not names:
            continue
        lo, hi = offsets[names[0]][0], offsets[names[-1]][1]
        if lo != end or sum(offsets[n][1] - offsets[n][0] for n in names) != hi - lo:
            raise ValueError(f"module {i} ({names[0].split('.')[0]}) is not the next "
                             f"contiguous range of the flat buffer (at {lo}, expected {end})")
        units.append(Unit(names[0].split(".")[0], i, names, lo, hi))
        end = hi
    if end != size:
        raise ValueError(f"the body's modules hold {end} of the buffer's {size} elements")
    return units


class Layout:
    """Every unit's per-rank segments and this rank's place in its packed shard."""

    def __init__(self, units: list[Unit], rank: int, n: int):
        self.units, self.rank, self.n = units, rank, n
        self.size = units[-1].hi if units else 0
        self.bounds = [segment_bounds(u.size, n) for u in units]  # per unit, n + 1 offsets
        self.mine, self.packed = [], []
        at = 0
        for u, b in zip(units, self.bounds, strict=True):
            lo, hi = u.lo + b[rank], u.lo + b[rank + 1]
            self.mine.append((lo, hi))
            self.packed.append((at, at + hi - lo))
            at += hi - lo
        self.shard_size = at
        self.largest = max((u.size for u in units), default=0)  # elements of the largest unit
        self.largest_segment = max((hi - lo for lo, hi in self.mine), default=0)

    def counts(self, u: int) -> list[int]:
        """Elements of unit u per rank (the all-gather's counts)."""
        b = self.bounds[u]
        return [b[r + 1] - b[r] for r in range(self.n)]

    def relative(self, u: int) -> tuple[int, int]:
        """This rank's segment of unit u, relative to the unit's start."""
        b = self.bounds[u]
        return b[self.rank], b[self.rank + 1]


def split_in_shard(mine: list[tuple[int, int]], placed: list[tuple[int, int]],
                   split: list[tuple[int, int]]) -> tuple[list, list]:
    """(inside, outside): the ranges of a shard whose segment u covers the flat range
    mine[u] and lies at placed[u] (its buffer's own coordinates) that hold elements of the
    flat ranges `split` (a tensor-split model's shards, models/tensor_parallel.py), and
    the ranges that do not (its replicated tensors), both in the shard's coordinates."""
    inside, outside = [], []
    for (lo, hi), (at, _) in zip(mine, placed, strict=True):
        cut = sorted((max(a, lo) - lo, min(b, hi) - lo) for a, b in split
                     if max(a, lo) < min(b, hi))  # relative to the segment's start
        inside += [(at + a, at + b) for a, b in cut]
        outside += [(at + a, at + b) for a, b in complement(cut, hi - lo)]
    return inside, outside


def ring_sent(bounds: list[int], order: list[int], position: int, first: int,
              last: int) -> int:
    """Elements the rank at ring `position` sends in steps [first, last) of
    collective/algorithms/ring.py over segments `bounds` (n + 1 offsets, segment r is rank r's)."""
    n = len(order)
    return sum(bounds[s + 1] - bounds[s]
               for s in (order[sent_segment(position, t, n)] for t in range(first, last)))


class RingTraffic:
    """Bytes this rank sends in our ring's reduce-scatter, all-gather and all-reduce over
    `comm` (collective on construction: the ring order is agreed as Link.ring agrees it)."""

    def __init__(self, comm):
        self.n = comm.size
        self.order, self.position = ring_order(comm.mpi)

    def reduce_scatter(self, bounds: list[int], itemsize: int) -> int:
        return itemsize * ring_sent(bounds, self.order, self.position, 0, self.n - 1)

    def allgather(self, bounds: list[int], itemsize: int) -> int:
        return itemsize * ring_sent(bounds, self.order, self.position, self.n - 1,
                                    2 * self.n - 2)

    def allreduce(self, length: int, itemsize: int) -> int:
        bounds = segment_bounds(length, self.n)
        return self.reduce_scatter(bounds, itemsize) + self.allgather(bounds, itemsize)
