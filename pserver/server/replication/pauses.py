"""Whether this daemon ran all along since a given moment, or was paused meanwhile.

A primary goes on without a backup that answers nothing only if it itself ran all
along while that backup was silent (pserver.server.replication.primary): a primary
that was paused instead may have been replaced by then (its workers, finding it
silent, asked the backup to take over), and must hear that from the backup first.

A thread ticks every `period` s. CLOCK_MONOTONIC runs on while a process is stopped
(SIGSTOP, a frozen VM, a starved host), so a tick that comes more than `stall` s after
the one before it marks a pause that ended then; and a last tick older than `stall`
means a pause under way, or just ended and not yet seen by the thread.
"""

from __future__ import annotations

import threading
import time


class PauseWatch:
    """`ran_since(t)`: whether this process has run without a pause of more than `stall`
    s since monotonic time `t` (or since the watch began, if later: a pause before this
    daemon's replica existed is none of its concern)."""

    def __init__(self, period: float, stall: float):
        if not 0 < period < stall:
            raise ValueError(f"a pause watch ticks more often than a pause lasts "
                             f"(period {period}, stall {stall})")
        self.period, self.stall = period, stall
        self._last = time.monotonic()
        self._awake_since = 0.0  # the end of the last pause seen (none yet: before any t)
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._tick, name="ps-pause-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()

    def ran_since(self, t: float) -> bool:
        return time.monotonic() - self._last < self.stall and self._awake_since <= t

    def _tick(self) -> None:
        while not self._stopped.wait(self.period):
            now = time.monotonic()
            if now - self._last > self.stall:
                self._awake_since = now
            self._last = now
