"""Plain data parallelism's exchange: the gradient averaged in buckets by the all-reduce
`--allreduce` names (collective/reducers/buckets.py), overlapped with backward, the experts'
range of an expert-parallel model over their own communicator, and the bytes each rank's
data sends by the algorithm each bucket runs.
"""

from __future__ import annotations

from dtlab.collective.comm import Communicator
from dtlab.collective.reducers.buckets import BucketReducer
from dtlab.collective.reducers.exchange import Exchange
from dtlab.collective.zero.layout import RingTraffic


def comm_algorithm(allreduce: str) -> tuple[str, str | None]:
    """--allreduce as the Communicator's (algo, ours)."""
    if allreduce in ("naive", "mpi"):
        return allreduce, None
    return "ours", None if allreduce == "auto" else allreduce


class DataParallelReducer(Exchange):
    """Adapts BucketReducer to the trainer: averages gradients and logged scalars.

    With `experts` (comm, lo, divide) the buffer holds two parameter groups: [0, lo) is
    averaged over `comm` in overlapped buckets, [lo, end) (the experts) over the experts'
    comm once backward is done, then divided by `divide`."""

    def __init__(self, comm: Communicator, grad, bucket_bytes: int, allreduce: str,
                 overlap: bool, wire: str = "fp32",
                 experts: tuple[Communicator, int, int] | None = None):
        super().__init__(comm)
        self.comm, self.grad = comm, grad
        self.lo = grad.size if experts is None else experts[1]
        algo, ours = comm_algorithm(allreduce)
        self.buckets = BucketReducer(comm, grad[:self.lo], bucket_bytes=bucket_bytes,
                                     algo=algo, ours=ours, overlap=overlap, wire=wire)
        self.experts = None
        if experts is not None:
            self.experts = BucketReducer(experts[0], grad[self.lo:], bucket_bytes=bucket_bytes,
                                         algo=algo, ours=ours, overlap=False, wire=wire)
            self.divide = experts[2]
        self.ready = self.buckets.ready
        self.overlap = self.buckets.overlap
        sent = [sent_bytes(b) for b in (self.buckets, self.experts) if b is not None]
        self.sent_bytes = None if None in sent else sum(sent)

    def wait(self) -> dict:
        t = self.buckets.wait()
        comm_s, wait_s, wire = t.comm_s, t.wait_s, t.wire_bytes
        if self.experts is not None:
            e = self.experts.wait()
            self.grad[self.lo:] /= self.divide
            comm_s, wait_s, wire = comm_s + e.comm_s, wait_s + e.wait_s, wire + e.wire_bytes
        sent = {} if self.sent_bytes is None else {"sent_bytes": self.sent_bytes}
        return {"comm_s": comm_s, "wait_s": wait_s, "wire_bytes": wire, **sent}

    def plan(self) -> list[dict]:
        """What every bucket's all-reduce runs (BucketReducer.plan), the experts' last."""
        return self.buckets.plan() + (self.experts.plan() if self.experts is not None else [])

    def close(self) -> None:
        self.buckets.close()
        if self.experts is not None:
            self.experts.close()


def sent_bytes(buckets: BucketReducer) -> int | None:
    """Bytes of this rank's data that reach the other ranks per step in the buckets'
    all-reduces, by the algorithm each bucket runs (L its bytes, N ranks): our ring, its
    own schedule (collective/zero/layout.py RingTraffic; collective, built only where a
    bucket runs it, which every rank's plan agrees on); halving-doubling and shared-memory
    two-shot 2(N-1)/N L (a segment of the inputs read by its reducer, then the reduced
    segments by every rank); one-shot (N-1) L (every rank reads every input); recursive
    doubling log2 N x L (both for a power-of-two N). None where no formula holds: MPI's
    own all-reduce, the naive one (root and others differ), a fold from another N."""
    plan, n = buckets.plan(), buckets.comm.size
    itemsize = (buckets.shadow if buckets.shadow is not None else buckets.grad).itemsize
    if any(b["algorithm"] in ("mpi", "naive")
           or (b["algorithm"] in ("doubling", "halving") and n & (n - 1)) for b in plan):
        return None
    traffic = RingTraffic(buckets.comm) if any(b["algorithm"] == "ring" for b in plan) else None
    per_byte = {"halving": 2 * (n - 1) / n, "shm-two-shot": 2 * (n - 1) / n,
                "shm-one-shot": n - 1, "doubling": n.bit_length() - 1, "none": 0}
    total = 0
    for (lo, hi), b in zip(buckets.buckets, plan, strict=True):
        if b["algorithm"] == "ring":
            total += traffic.allreduce(hi - lo, itemsize)
        else:
            total += round(per_byte[b["algorithm"]] * (hi - lo)) * itemsize
    return total


def plan_words(plan: list[dict]) -> str:
    """The buckets' algorithms in words: "shm-two-shot (407 KB)", "ring (25 MB) x 3"."""
    words = [f"{b['algorithm']} ({b['bytes'] / 1e3:,.0f} KB)" for b in plan]
    return ", ".join(f"{w} x {words.count(w)}" if words.count(w) > 1 else w
                     for w in dict.fromkeys(words))
