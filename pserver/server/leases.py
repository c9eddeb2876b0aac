"""Worker leases: a worker that stops calling is dropped after --worker-timeout seconds.

A lease (Gray and Cheriton 1989) is a worker's claim to be waited for,
valid for `timeout` seconds after its last sign of life on this shard:

    signs of life   Register, and every pull and push (its own call or an
                    operation on the worker's session)
    held while      one of them is in progress, or a session of the worker
                    is open (a killed worker's session ends with its
                    connection, so only then does its lease run down)
    expired         no call in progress and no open session, and
                    now - (the last sign of life) > timeout

The shard store drops a worker whose lease expired (ShardStore.expire_leases):
the worker is no longer active, so SSP stops waiting for its clock and a BSP
round completes with the workers that remain, averaged over those that
contributed (consistency.Round.mean); a gradient it had added to the round
before it died stays in it (it was acknowledged). The drop wakes waiting
pulls, is logged and counted (ShardStats.workers_dropped, WorkerStats.expired).
A dropped worker comes back by registering again (a restarted worker with the
same id) or by its next call (a worker that was only slow): active again, at
the slowest active clock (consistency.Clocks.register).

`Leases` holds no lock of its own: the store calls it under its lock, as it
does Clocks. `LeaseReaper` is the thread that asks the store to drop expired
workers every `timeout / 4` seconds, so a dead worker is dropped between
`timeout` and `1.25 * timeout` seconds after its last sign of life.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable

log = logging.getLogger(__name__)


class Leases:
    """The lease of every worker of one shard; `timeout` 0: leases never expire."""

    def __init__(self, timeout: float = 0.0, clock: Callable[[], float] = time.monotonic):
        self.timeout, self._clock = timeout, clock
        self._open: Counter[int] = Counter()  # calls in progress and sessions open
        self._last: dict[int, float] = {}  # the last sign of life, by the clock
        self.expired: set[int] = set()  # dropped and not back yet
        self.dropped = 0  # drops so far

    def renew(self, worker: int) -> None:
        self._last[worker] = self._clock()

    def enter(self, worker: int) -> None:
        """A call or session of `worker` begins: its lease holds until `leave`."""
        self._open[worker] += 1
        self.renew(worker)

    def leave(self, worker: int) -> None:
        self._open[worker] -= 1
        self.renew(worker)

    def overdue(self, active: Iterable[int]) -> list[tuple[int, float]]:
        """(worker, seconds since its last sign of life) of each of the `active` workers
        whose lease expired. A worker never seen here (one a checkpoint brought back)
        is counted from this first look."""
        if not self.timeout:
            return []
        now = self._clock()
        idle = [(w, now - self._last.setdefault(w, now)) for w in active if not self._open[w]]
        return [(w, s) for w, s in idle if s > self.timeout]

    def restart(self) -> None:
        """Every lease counted from the next look (a backup that took over: the workers'
        calls went to the primary until now)."""
        self._last.clear()

    def expire(self, worker: int) -> None:
        self.expired.add(worker)
        self.dropped += 1

    def back(self, worker: int) -> bool:
        """`worker` showed a sign of life: whether it had been dropped (it is not now)."""
        if worker in self.expired:
            self.expired.discard(worker)
            return True
        return False


def keepalive_options(timeout: float) -> list[tuple[str, int]]:
    """gRPC server options (none without leases) under which an open session of a worker
    that can no longer answer (its process stopped, its host gone without a FIN or RST
    reaching us) ends within about `timeout` seconds, so that its lease runs down: an
    HTTP/2 ping every timeout / 2 seconds, however long the stream has been idle, and
    the connection closed when one is unanswered for timeout / 2 seconds (gRPC core
    times a ping's answer by ping_timeout_ms, not keepalive_timeout_ms alone)."""
    if not timeout:
        return []
    half_ms = max(1, round(timeout * 500))
    return [("grpc.keepalive_time_ms", half_ms), ("grpc.keepalive_timeout_ms", half_ms),
            ("grpc.http2.ping_timeout_ms", half_ms), ("grpc.http2.max_pings_without_data", 0)]


class LeaseReaper:
    """A thread calling `expire()` (each store's ShardStore.expire_leases) every
    `timeout / 4` seconds until `stop`."""

    def __init__(self, timeout: float, expire: Callable[[], None]):
        self.period, self._expire = timeout / 4, expire
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lease-reaper", daemon=True)

    def start(self) -> None:
        log.info("leases: a worker is dropped %g s after its last call or session ended "
                 "(--worker-timeout)", self.period * 4)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.period):
            try:
                self._expire()
            except Exception:  # the next period tries again; the server goes on serving
                log.exception("dropping expired workers failed")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
