"""Staleness per Mixture-of-Experts expert: updates to the expert between a read and a push.

A shard's version counts every update, but a worker that pushes only the
experts its tokens reached (pserver.common.ranges) leaves the others untouched, so
for an expert the updates that matter are the ones that changed it. Each
expert with parameters on this shard (its name's prefix "h0.moe.e3", found
in the model's specs, pserver.common.ranges.expert_ranges) has its own version,
advanced by every applied update whose ranges meet its parameters; each
worker's pull remembers the expert versions it read; and every push records,
for each expert whose parameters it carries,

    expert staleness = expert version at apply - expert version the worker read

in that expert's histogram (the same quantity as the shard's staleness, Zhang
et al. 2016, restricted to the updates that touched the expert). Under BSP a
push is recorded when it joins the round: no update is applied before the
round's, so the versions are those at apply. A worker with no pull on record
(this server restarted since) counts as having read the current versions.

The shard store calls these methods under its lock; the figures start afresh
when a server starts (they are not checkpointed).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from dtlab.pserver.common import ranges as ranges_lib
from dtlab.pserver.common.ranges import Ranges
from dtlab.pserver.server.staleness import Histogram


class ExpertStaleness:
    """`experts`: each expert's ranges within this shard, relative to its first element
    (empty for a model without experts: every method is then a no-op)."""

    def __init__(self, experts: dict[str, Ranges]):
        self.experts = {name: r for name, r in experts.items() if r}
        self.versions = dict.fromkeys(self.experts, 0)
        self.read: dict[int, dict[str, int]] = {}  # worker -> expert versions at its last pull
        self.histograms = {name: Histogram() for name in self.experts}

    @classmethod
    def of(cls, specs: Sequence, offset: int, length: int) -> ExpertStaleness:
        """The experts of a model laid out as `specs`, on the shard [offset, offset + length)."""
        return cls({name: ranges_lib.within(r, offset, offset + length)
                    for name, r in ranges_lib.expert_ranges(specs).items()})

    def touched(self, ranges: Ranges | None) -> list[str]:
        """The experts whose parameters meet `ranges` (None: the whole shard: all)."""
        if ranges is None:
            return list(self.experts)
        starts = [lo for lo, _ in ranges]
        return [name for name, own in self.experts.items()
                if any(_meets(ranges, starts, lo, hi) for lo, hi in own)]

    def pulled(self, worker: int) -> None:
        """`worker` read the shard: it now holds every expert's current version."""
        if self.experts:
            self.read[worker] = dict(self.versions)

    def pushed(self, worker: int, ranges: Ranges | None) -> None:
        """Record the staleness of each expert a push of `worker` carries."""
        read = self.read.get(worker, self.versions)
        for name in self.touched(ranges):
            self.histograms[name].record(self.versions[name] - read[name])

    def applied(self, ranges: Ranges | None) -> None:
        """An update of `ranges` was applied: the experts it met advance."""
        for name in self.touched(ranges):
            self.versions[name] += 1

    def copy(self) -> dict[str, Histogram]:
        return {name: h.copy() for name, h in self.histograms.items()}


def _meets(ranges: Ranges, starts: list[int], lo: int, hi: int) -> bool:
    """Whether sorted, disjoint `ranges` (their starts `starts`) meet [lo, hi)."""
    k = bisect.bisect_left(starts, hi) - 1  # the last range starting before hi
    return k >= 0 and ranges[k][1] > lo
