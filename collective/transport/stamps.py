"""Timestamps of the calls one collective makes, for a per-step cost table.

The ring (collective/algorithms/ring.py) makes four kinds of call per message:
the Wait for what its left neighbour sent, the add into the buffer, the
Start of its send onward, and the post of the next receive (a gather
receive first checks that our send of the same memory is done). With `Link.stamps` set to
a `Stamps`, ring() runs those calls through `wrap`, which records
(kind, start, end) in nanoseconds of `time.perf_counter_ns`; whatever lies
between two recorded calls is the loop's own Python. With `Link.stamps` None
(the default) ring() reads the attribute once a call and runs its loop
unchanged: nothing is recorded and nothing is wrapped.

Each record costs two clock reads and a list append (about 0.1-0.2 us,
measured by `overhead_ns`), which falls between the recorded calls: the
bench (dtlab-bench ring_steps) times the ring with and without stamps in the
same run and prints both.
"""

from __future__ import annotations

import time
from collections.abc import Callable

WAIT, ADD, START, POST = "wait", "add", "start", "post"


class Stamps:
    """(kind, start_ns, end_ns) of every wrapped call, in the order they ran."""

    def __init__(self):
        self.events: list[tuple[str, int, int]] = []

    def wrap(self, fn: Callable, kind: str) -> Callable:
        """`fn` with every call recorded as `kind`; its result passed through."""
        events, clock = self.events, time.perf_counter_ns

        def recorded(*args, **kwargs):
            t0 = clock()
            out = fn(*args, **kwargs)
            events.append((kind, t0, clock()))
            return out

        return recorded

    def take(self) -> list[tuple[str, int, int]]:
        """The events so far; the list is emptied for the next ones."""
        events = self.events[:]
        self.events.clear()
        return events


def overhead_ns(calls: int = 2000) -> float:
    """Median nanoseconds one recorded call adds to the call itself (a no-op wrapped,
    less the no-op alone), over `calls // 100` blocks of 100."""
    stamps = Stamps()
    bare = lambda: None  # noqa: E731
    wrapped = stamps.wrap(bare, "none")
    clock, blocks = time.perf_counter_ns, []
    for _ in range(max(1, calls // 100)):
        t0 = clock()
        for _ in range(100):
            wrapped()
        t1 = clock()
        for _ in range(100):
            bare()
        t2 = clock()
        blocks.append(((t1 - t0) - (t2 - t1)) / 100)
        stamps.take()
    blocks.sort()
    return blocks[len(blocks) // 2]
