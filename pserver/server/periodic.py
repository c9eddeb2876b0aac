"""Periodic shard checkpoints (--checkpoint-every-s), besides SIGTERM and SaveCheckpoint.

A thread saves the shard every `every_s` seconds through the daemon's
save_checkpoint, the same consistent copy (ShardStore.state) and the same
atomic directory as the other saves (models.run.checkpoint: written under a
temporary name, synced, renamed into place), so a server killed, even in the
middle of a save, leaves whole checkpoints only, and `--resume` starts from
the newest that verifies (pserver.server.checkpoint.newest: a checkpoint of
the same version that a killed save had moved aside is put back first, its
temporary directory removed). `--keep K` prunes all but the K newest that
verify after each save. A save is skipped while the shard has not changed since the one before:
the same version and the same count of accepted gradients (a BSP round in
progress changes the count, not the version).

What a server killed with -9 loses is what it accepted after its newest
save, at most `every_s` seconds of updates: its workers go on from their own
step after the restart (their next push is newer than any step the restored
shard saw), and those updates are not redone.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from dtlab.models.run.checkpoint import CheckpointError

log = logging.getLogger(__name__)


class PeriodicCheckpoints:
    """Calls `save()` every `every_s` seconds while `changes()` (the shard's version and
    accepted pushes, over its partitions too) moved since the last save."""

    def __init__(self, every_s: float, changes: Callable[[], tuple[int, int]],
                 save: Callable[[], tuple[str, int]]):
        self.every_s, self._mark, self._save = every_s, changes, save
        self._saved = self._mark()  # the state the last save (or the start) held
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="checkpoints", daemon=True)

    def start(self) -> None:
        log.info("checkpoints every %g s while the shard changes (--checkpoint-every-s)",
                 self.every_s)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            mark = self._mark()
            if mark == self._saved:
                log.debug("periodic checkpoint skipped: nothing changed since version %d",
                          mark[0])
                continue
            try:
                self._save()
            except (OSError, CheckpointError) as e:  # the next period tries again
                log.error("periodic checkpoint failed: %s", e)
                continue
            self._saved = mark

    def stop(self) -> None:
        """No save starts after this returns (one in progress is finished)."""
        self._stop.set()
        self._thread.join()
