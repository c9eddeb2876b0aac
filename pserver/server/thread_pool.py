"""Split a sequence into contiguous groups and run one function per group on a thread pool.

The shard's optimizer runs its blocks this way: NumPy releases the GIL in
its loops, so groups run on separate cores, and each group walks its own
contiguous run of memory. With one thread everything runs inline in the
caller.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")


class Parallel:
    def __init__(self, threads: int = 1, name: str = "parallel"):
        self.threads = max(1, threads)
        self._pool = (ThreadPoolExecutor(self.threads - 1, thread_name_prefix=name)
                      if self.threads > 1 else None)

    def groups(self, items: Sequence[T]) -> list[Sequence[T]]:
        """`items` cut into at most `threads` contiguous, balanced, non-empty runs."""
        m = len(items)
        t = max(1, min(self.threads, m))
        return [items[k * m // t : (k + 1) * m // t] for k in range(t)]

    def run(self, fn: Callable[[Sequence[T]], R], groups: list[Sequence[T]]) -> list[R]:
        """fn(group) for each of `groups` (at most `threads`), in parallel, in order.

        The caller's own thread runs the first group while the pool runs the
        others: one thread fewer to wake, and a wake-up costs most where
        cores are few and busy.
        """
        if len(groups) > self.threads:
            raise ValueError(f"{len(groups)} groups for {self.threads} threads")
        if self._pool is None or len(groups) == 1:
            return [fn(g) for g in groups]
        rest = [self._pool.submit(fn, g) for g in groups[1:]]
        first = fn(groups[0])
        return [first, *(f.result() for f in rest)]

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
