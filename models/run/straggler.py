"""Stragglers on purpose: the same slowdowns for every topology, so their effect compares.

    --straggler 1:3       rank (or async worker) 1 takes 3x its compute time each step
    --straggler 2:2,3:4   ranks 2 and 3 take 2x and 4x: workers of different speeds
    --straggler lognormal:0.5   every rank's factor exp(|z|), z ~ N(0, 0.25), seeded by
                          (seed, rank): speeds drawn from a distribution
    --delay-ms 5          every rank or worker waits a random extra time each step,
                          exponential with mean 5 ms, seeded by (seed, rank, step)

The delay is a sleep at the start of the step, before its compute (the
factor applies to the previous step's compute time, read on `compute_clock`'s
clock: see there): a sync rank then
reaches the all-reduce late, its buckets included, and every other rank
waits for it; an async worker pushes late and only its own updates suffer
(plus, under SSP and BSP, whoever waits for its clock). Draws depend on
(seed, rank, step) only, so two topologies see the same delays.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from dtlab.models.config import ConfigError
from dtlab.models.run.threads import threads_in_use


class Straggler:
    """The extra time rank `rank` spends after computing step `step`."""

    def __init__(self, spec: str, delay_ms: float, seed: int, rank: int,
                 on_device: bool = False):
        sigma = drawn_sigma(spec)
        self.factor = (slowdown(sigma, seed, rank) if sigma is not None
                       else parse_straggler(spec).get(rank, 1.0))
        if delay_ms < 0:
            raise ConfigError(f"--delay-ms must not be negative (got {delay_ms})")
        self.delay_s, self.seed, self.rank = delay_ms / 1e3, seed, rank
        # what the caller reads the compute time on, for the factor (`compute_clock`)
        self.clock = compute_clock(on_device) if self.active else time.perf_counter

    @property
    def active(self) -> bool:
        return self.factor != 1.0 or self.delay_s > 0

    def extra_s(self, step: int, compute_s: float) -> float:
        extra = (self.factor - 1.0) * compute_s
        if self.delay_s > 0:
            rng = np.random.default_rng([self.seed, self.rank, step, 7])
            extra += float(rng.exponential(self.delay_s))
        return extra

    def wait(self, step: int, compute_s: float) -> float:
        """Sleep the extra time; return it."""
        extra = self.extra_s(step, compute_s)
        if extra > 0:
            time.sleep(extra)
        return extra


def compute_clock(on_device: bool) -> Callable[[], float]:
    """The clock a rank's compute time is read on for the factor: the thread's own CPU time
    (`time.thread_time`) where the rank computes on the host with one BLAS thread, the wall
    clock otherwise (a device's kernels; BLAS threads of its own).

    On a host whose cores the ranks share, the wall time of a compute counts the others'
    turns on the cores as this rank's, and in a sync run the others are waiting for the
    straggler, their communication threads polling: a factor on that wall time grew with
    the wait it caused (ranks 1x, 1x, 2x, 4x on 2 cores, 200 steps: sync-ring 21.4 s
    against 8.9 s for BSP's same arithmetic; 12.1 s against 10.5 s on this clock:
    scripts/RESULTS.md, stop 43). The thread's CPU time is the same whoever waits, so the
    same factor slows every topology alike."""
    if on_device or max(threads_in_use().values(), default=1) > 1:
        return time.perf_counter
    return time.thread_time


def drawn_sigma(spec: str) -> float | None:
    """'lognormal:0.5' -> 0.5 (every rank's factor drawn); None for RANK:FACTOR pairs."""
    kind, _, value = spec.partition(":")
    if kind != "lognormal":
        return None
    try:
        sigma = float(value)
    except ValueError:
        sigma = -1.0
    if not sigma > 0:
        raise ConfigError(f"--straggler {spec!r}: lognormal:SIGMA takes a positive SIGMA")
    return sigma


def slowdown(sigma: float, seed: int, rank: int) -> float:
    """Rank `rank`'s factor under --straggler lognormal:SIGMA: exp(|z|), z ~ N(0, SIGMA^2)
    drawn from (seed, rank), so at least 1 (a median of exp(0.674 SIGMA)) and the same in
    every topology and launch."""
    z = np.random.default_rng([seed, rank, 13]).normal(0.0, sigma)
    return float(np.exp(abs(z)))


def parse_straggler(spec: str) -> dict[int, float]:
    """'1:3' -> {1: 3.0}; '1:2,3:4' -> {1: 2.0, 3: 4.0}; '' and 'lognormal:S' (every
    rank's factor drawn: `slowdown`) -> {}; anything else a ConfigError naming
    --straggler."""
    out: dict[int, float] = {}
    if drawn_sigma(spec) is not None:
        return out
    for item in spec.split(",") if spec else ():
        try:
            rank, factor = item.split(":")
            r, f = int(rank), float(factor)
        except ValueError:
            raise ConfigError(f"--straggler {spec!r}: expected RANK:FACTOR[,RANK:FACTOR...], "
                              "e.g. 1:3 or 2:2,3:4") from None
        if r < 0 or not f >= 1.0:
            raise ConfigError(f"--straggler {spec!r}: each rank must be >= 0 and each factor "
                              ">= 1")
        if r in out:
            raise ConfigError(f"--straggler {spec!r}: rank {r} given twice")
        out[r] = f
    return out
