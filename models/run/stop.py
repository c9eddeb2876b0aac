"""SIGTERM and SIGINT ask a training run to stop after its step, not in the middle of it.

    with StopSignals() as stop:
        for step in ...:
            train_one_step()
            if stop.agreed(agree):        # every rank sees the same answer
                save_checkpoint(); break
    exit(stop.exit_code)                  # 0 for SIGTERM, 130 for SIGINT

The first SIGTERM or SIGINT only sets a flag, so the step in progress
finishes (or, for a data-parallel rank, completes its all-reduce) and the
trainer can write a consistent checkpoint. A second signal is not caught:
SIGINT raises KeyboardInterrupt, SIGTERM ends the process, as without the
handler. Ranks of one job may receive a signal at different steps, so
`agreed` combines the flags over every rank (`agree`: a sum over the world)
and all of them stop after the same step. That sum is one small all-reduce
per step, or none of its own: where the ranks whose losses make the global
batch are the whole job, the trainer's step carries the counts in its loss
average (models/run/trainer.py `Trainer.scalars`), so a signal caught after
that point of the step is agreed at the next one.
Handlers are installed only from the main thread and restored on exit.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable

import numpy as np

SIGNALS = (signal.SIGTERM, signal.SIGINT)
EXIT_CODES = {signal.SIGTERM: 0, signal.SIGINT: 130}


class StopSignals:
    def __init__(self):
        self.received: set[int] = set()  # signals this process caught
        self.stopped_by: int | None = None  # the signal the run stopped on, agreed
        self._old: dict = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._old[sig] = signal.signal(sig, self._catch)
        return self

    def __exit__(self, *exc) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()

    def _catch(self, signum: int, frame) -> None:
        self.received.add(signum)
        for sig, old in self._old.items():  # a second signal acts as if uncaught
            signal.signal(sig, old)

    def counts(self) -> np.ndarray:
        """This process's caught signals as (2,) counts: [SIGTERM, SIGINT], each 0 or 1
        (what `agree` sums over the ranks, or a trainer's step carries with its loss)."""
        return np.array([signal.SIGTERM in self.received, signal.SIGINT in self.received],
                        dtype=np.int64)  # (2,)

    def agreed(self, agree: Callable[[np.ndarray], np.ndarray] | None = None) -> bool:
        """Whether any rank caught a signal; `agree` sums the (2,) counts over the ranks.
        SIGINT wins over SIGTERM when ranks caught different ones."""
        counts = self.counts()
        if agree is not None:
            counts = agree(counts)
        if counts[1]:
            self.stopped_by = signal.SIGINT
        elif counts[0]:
            self.stopped_by = signal.SIGTERM
        return self.stopped_by is not None

    @property
    def exit_code(self) -> int:
        return EXIT_CODES.get(self.stopped_by, 0)

    @property
    def name(self) -> str:
        return signal.Signals(self.stopped_by).name if self.stopped_by else ""
