"""Speed-aware local steps (dtlab-worker --local-steps H --dylu): DyLU, "dynamic local
updates" of Liu et al. 2024, "Asynchronous Local-SGD Training for Language Modeling".

In asynchronous local SGD a worker k times slower than the fastest takes k times as long
over its H inner steps, so its outer gradient arrives late and stale. DyLU scales each
worker's round to its speed, so that every worker's outer gradient covers about the same
wall time:

    H_i = max(1, round(H * t_fast / t_i))        (round half up)

    t_i     worker i's inner step time: the median wall time of its last H inner steps
            (`RecentStepTimes`; a median, so that a step the host's scheduler delayed moves
            it little; the launch's first step, which warms up, left out),
            communication aside (a record's straggle_s + step_s - pull_s - push_s: the
            straggler's wait, compute and the inner optimizer)
    t_fast  the fastest worker's: each outer push carries t_i (PushHeader.step_s); the
            servers keep every worker's latest and answer the least
            (PushReply.fastest_step_s; pserver.server.step_times)

A worker's first round has H steps (nothing measured yet); each push's answer sets the
next round's H_i. The fastest worker has t_fast = t_i exactly, so its H_i is H; so has a
worker alone (bit for bit the fixed-H run: tests/pserver/test_pserver_dylu.py). An
evaluation inside a round reads the servers' parameters without ending it (`OuterPushPull.
refresh`): a round cut at every evaluation step made --eval-every, not speed, set the
rounds' lengths (at --eval-every 10 even the fastest workers pushed 1-step rounds).
"""

from __future__ import annotations

import math
import statistics
from collections import deque

from dtlab.pserver.common.errors import FailedPrecondition


class RecentStepTimes:
    """The running median of a worker's last `window` inner step times (seconds), the
    first step it observes left out (the launch's: first touches of memory, a cold
    cache)."""

    def __init__(self, window: int):
        self.times: deque[float] = deque(maxlen=window)
        self.warm = False  # whether the first step went by

    def observe(self, record: dict) -> None:
        """A finished step's record: its wall time, the exchange's communication aside."""
        if not self.warm:
            self.warm = True
            return
        wall = record["step_s"] + record.get("straggle_s", 0.0)
        self.times.append(wall - record.get("pull_s", 0.0) - record.get("push_s", 0.0))

    def median(self) -> float | None:
        """The median over the window (None: no step measured yet)."""
        return statistics.median(self.times) if self.times else None


def speed_aware_steps(local_steps: int, fastest_s: float, own_s: float) -> int:
    """H_i = max(1, round(H * t_fast / t_i)), rounding halves up."""
    return max(1, math.floor(local_steps * fastest_s / own_s + 0.5))


def fastest_of(replies: list) -> float:
    """The servers' fastest worker's step time from the push's replies (the least any
    shard answers); FailedPrecondition where none answers one (a server that predates
    PushReply.fastest_step_s)."""
    answered = [r.fastest_step_s for r in replies if r.fastest_step_s > 0]
    if not answered:
        raise FailedPrecondition("--dylu: the servers answered no fastest step time "
                                 "(PushReply.fastest_step_s): they predate speed-aware local "
                                 "steps; run them from this version", reason="step_s")
    return min(answered)
