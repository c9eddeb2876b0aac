"""Which of our all-reduce algorithms runs, by buffer size, world size and node.

    doubling       recursive doubling: log2 N waits, the whole buffer each  (doubling.py)
    shm-one-shot   shared memory: 1 barrier, every rank adds all N copies  (shm.py)
    shm-two-shot   shared memory: 2 barriers, rank r adds segment r        (shm.py)
    halving        halving-doubling: 2 log2 N waits, 2(N-1)/N L moved     (halving.py)
    ring           2(N - 1) waits, 2(N-1)/N L moved, neighbours only       (ring.py)

The cost model behind the order (Thakur, Rabenseifner & Gropp 2005), with
alpha the cost of one wait, beta of one byte moved and gamma of one byte
added:

    doubling       log2 N alpha + L log2 N (beta + gamma)
    one-shot       1 barrier + L beta + (N - 1) L gamma
    two-shot       2 barriers + 2 L beta + (N - 1)/N L gamma
    halving, ring  2 log2 N (or 2(N - 1)) alpha + 2(N-1)/N L beta + (N-1)/N L gamma

Recursive doubling for the smallest buffers, where one message's latency is
all there is; within one node shared memory for mid sizes, where a Python
wait per step (and, with more ranks than cores, a hand-over of the core per
wait) costs more than the bytes: one-shot while its extra additions are
small, then two-shot; above that the bandwidth-optimal point-to-point
algorithms, whose copies go straight from buffer to buffer (shared memory
copies in and out), halving-doubling when N is a power of two (fewer waits),
else the ring (no fold). The thresholds below were measured with
dtlab.lab.bench.allreduce at 2, 3 and 4 ranks (figures: scripts/RESULTS.md);
`Communicator(ours=...)` forces one algorithm for every size.
"""

from __future__ import annotations

from collections.abc import Callable

OURS = ("doubling", "shm-one-shot", "shm-two-shot", "halving", "ring")

SMALL_BYTES = 4 << 10  # recursive doubling up to here
SHM_SEGMENT_BYTES = 512 << 10  # shared memory while L / N is at most this
ONE_SHOT_ADDED_BYTES = 384 << 10  # one-shot while (N - 1) L is at most this


def allreduce_algorithm(nbytes: int, n: int, shared: Callable[[], bool]) -> str:
    """The algorithm for `nbytes` over `n` ranks; shared(): all ranks on one node
    (asked only where it matters; collective on its first call)."""
    if nbytes <= SMALL_BYTES:
        return "doubling"
    if nbytes <= SHM_SEGMENT_BYTES * n and shared():
        return "shm-one-shot" if (n - 1) * nbytes <= ONE_SHOT_ADDED_BYTES else "shm-two-shot"
    return "halving" if n & (n - 1) == 0 else "ring"
