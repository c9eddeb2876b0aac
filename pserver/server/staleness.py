"""Histograms of gradient staleness, per shard and per worker.

The staleness of an applied gradient is the number of updates the shard took
between the worker's read and this apply:

    staleness = version at apply - version the gradient was computed from

(Zhang et al. 2016, "Staleness-aware Async-SGD for Distributed Deep
Learning"; Dean et al. 2012 report the same quantity for DistBelief's
Downpour SGD). The shard store records it under the lock that guards the
update, so the histograms hold exactly one entry per applied gradient.
Counts are exact (one bin per value); the Prometheus export (pserver.server.metrics)
folds them into cumulative power-of-two buckets.
"""

from __future__ import annotations

from collections import Counter


class Histogram:
    """Exact counts of gradients by staleness."""

    def __init__(self):
        self.counts: Counter[int] = Counter()
        self.total = self.sum = self.max = 0

    def record(self, staleness: int) -> None:
        self.counts[staleness] += 1
        self.total += 1
        self.sum += staleness
        self.max = max(self.max, staleness)

    def copy(self) -> Histogram:
        return Histogram.from_dict(self.to_dict())

    def __eq__(self, other) -> bool:
        return isinstance(other, Histogram) and self.counts == other.counts

    __hash__ = None

    def to_dict(self) -> dict:
        """A JSON-able copy (checkpoints keep it): {"staleness": count}."""
        return {str(s): c for s, c in sorted(self.counts.items())}

    @classmethod
    def from_dict(cls, counts: dict) -> Histogram:
        """The histogram `to_dict` wrote; ValueError for anything else."""
        h = cls()
        for s, c in counts.items():
            s, c = int(s), int(c)
            if s < 0 or c <= 0:
                raise ValueError(f"staleness {s}: count {c}")
            h.counts[s] = c
            h.total += c
            h.sum += s * c
            h.max = max(h.max, s)
        return h


class StalenessLog:
    """The shard's histogram and one per worker, updated together."""

    def __init__(self):
        self.shard = Histogram()
        self.workers: dict[int, Histogram] = {}

    def record(self, worker: int, staleness: int) -> None:
        self.shard.record(staleness)
        self.workers.setdefault(worker, Histogram()).record(staleness)

    def worker(self, worker: int) -> Histogram:
        return self.workers.get(worker) or Histogram()

    def to_dict(self) -> dict:
        return {"shard": self.shard.to_dict(),
                "workers": {str(w): h.to_dict() for w, h in sorted(self.workers.items())}}

    @classmethod
    def from_dict(cls, state: dict) -> StalenessLog:
        log = cls()
        log.shard = Histogram.from_dict(state["shard"])
        log.workers = {int(w): Histogram.from_dict(h) for w, h in state["workers"].items()}
        if sum(h.total for h in log.workers.values()) != log.shard.total:
            raise ValueError("the workers' staleness counts do not add up to the shard's")
        return log
