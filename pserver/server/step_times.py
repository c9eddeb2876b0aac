"""The workers' reported step times, for speed-aware local steps (dtlab-worker --dylu;
Liu et al. 2024, "Asynchronous Local-SGD Training for Language Modeling", DyLU).

A push may carry its worker's measured inner step time (PushHeader.step_s); the shard
keeps each worker's latest and answers every push with the least of them
(PushReply.fastest_step_s), the fastest worker's time, against which each worker scales
its local steps. A worker that left keeps its entry: the fleet's fastest speed does not
change because its fastest member finished its steps first.
"""

from __future__ import annotations

import math
import threading

from dtlab.protos import dtlab_ps_pb2 as pb
from dtlab.pserver.common.errors import InvalidArgument


class StepTimes:
    """worker id -> its latest reported step time (seconds); `fastest` the least."""

    def __init__(self):
        self._latest: dict[int, float] = {}
        self._lock = threading.Lock()

    def report(self, h: pb.PushHeader) -> None:
        """The push header's step time, if it carries one, as its worker's latest; one that
        is not a positive finite number is refused (INVALID_ARGUMENT, reason "step_s")
        before anything is applied."""
        if not h.HasField("step_s"):
            return
        if not (math.isfinite(h.step_s) and h.step_s > 0):
            raise InvalidArgument(f"push header step_s {h.step_s}: a worker's step time must "
                                  "be a positive finite number of seconds", reason="step_s")
        with self._lock:
            self._latest[h.worker_id] = h.step_s

    def fastest(self) -> float:
        """The least latest step time of any worker (0.0: none reported)."""
        with self._lock:
            return min(self._latest.values(), default=0.0)
