"""When N workers of given speeds push, and what each push read: the staleness N workers
produce, from an event simulation (no training).

    speeds = Speeds.parse("jitter:0.1,slow:0.125:2")   # 1/8 of the workers 2x slower
    t = trace(64, speeds, pushes=6400)                  # ASP: t.worker, t.read, t.time
    t = trace(64, speeds, pushes=6400, bound=2)         # SSP with bound s = 2
    round_time(64, speeds, backups=4)                   # BSP closing at the first N of N + b

Worker w's k-th step takes base_w x exp(sigma z - sigma^2 / 2) units (z standard normal,
seeded; mean base_w): base_w = FACTOR for the first round(FRACTION N) workers (`slow`),
1 for the others; sigma = `jitter`. A worker reads the parameters when it starts a step
(the version: updates applied so far), pushes when it ends, and the push is applied at
once (ASP, Dean et al. 2012); its staleness is the updates applied between its read and
its push, as pserver/server/store.py counts it. Under SSP (Ho et al. 2013) a worker whose
clock (pushes accepted) leads the slowest worker's by more than s waits, and reads when
the slowest catches up (pserver/server/consistency.py's rule). Ties go to the lower
worker id, so N equal-speed workers push round-robin, worker w's step s as push s N + w,
every gradient after the first round N - 1 stale: models/run/simulated.py's order.

BSP with b backup workers (Chen et al. 2016) closes a round at the N-th of N + b
gradients: `round_time` is the mean over rounds of the N-th smallest of N + b step
times (a straggler's late gradient dropped and its worker starting afresh, as if each
round began with every worker ready: an approximation that ignores a straggler still
busy from the round before), and b = 0 is the slowest of N, sync's round.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass

import numpy as np

from dtlab.models.config import ConfigError


@dataclass(frozen=True)
class Speeds:
    jitter: float = 0.0  # sigma of each step's log-normal factor
    slow_fraction: float = 0.0  # the fraction of workers FACTOR times slower
    slow_factor: float = 1.0
    bases: tuple[float, ...] = ()  # measured: each worker's mean step over all workers' mean

    @classmethod
    def parse(cls, text: str, flag: str = "--speeds") -> Speeds:
        """"equal", or a comma list of jitter:SIGMA and slow:FRACTION:FACTOR; a
        ConfigError naming the entry that is wrong."""
        kw = {}
        for item in (x.strip() for x in text.split(",") if x.strip()):
            kind, *values = item.split(":")
            try:
                numbers = [float(v) for v in values]
            except ValueError:
                raise ConfigError(f"{flag} {item}: not numbers after {kind}:") from None
            if kind == "equal" and not numbers:
                continue
            if kind == "jitter" and len(numbers) == 1 and 0 <= numbers[0] < 3:
                kw["jitter"] = numbers[0]
            elif (kind == "slow" and len(numbers) == 2 and 0 <= numbers[0] <= 1
                  and numbers[1] >= 1):
                kw["slow_fraction"], kw["slow_factor"] = numbers
            else:
                raise ConfigError(f"{flag} {item}: expected equal, jitter:SIGMA (0 <= SIGMA "
                                  "< 3) or slow:FRACTION:FACTOR (FRACTION in [0, 1], "
                                  "FACTOR >= 1)")
        return cls(**kw)

    def describe(self) -> str:
        parts = []
        if self.jitter:
            parts.append(f"each step x lognormal(sigma {self.jitter:g})")
        if self.slow_fraction and self.slow_factor != 1:
            parts.append(f"{self.slow_fraction:g} of the workers {self.slow_factor:g}x slower")
        if self.bases:
            parts.append("workers' mean steps " + ", ".join(f"{b:.3g}" for b in self.bases))
        return "; ".join(parts) or "equal speeds"

    def base(self, n: int) -> np.ndarray:
        """(n,) each worker's mean step time (measured bases: worker w's, cycled)."""
        if self.bases:
            return np.resize(np.array(self.bases, dtype=float), n)
        out = np.ones(n)
        out[: round(self.slow_fraction * n)] = self.slow_factor
        return out

    def draws(self, rng: np.random.Generator, shape) -> np.ndarray:
        """Log-normal factors of mean 1 (ones without jitter)."""
        if not self.jitter:
            return np.ones(shape)
        s = self.jitter
        return np.exp(s * rng.standard_normal(shape) - s * s / 2)


@dataclass(frozen=True)
class Trace:
    worker: np.ndarray  # (P,) who pushed push p
    read: np.ndarray  # (P,) the version (updates applied) its gradient was computed on
    time: np.ndarray  # (P,) when it was applied, in units of a mean step

    @property
    def staleness(self) -> np.ndarray:
        return np.arange(self.read.size) - self.read  # (P,) updates between read and push

    def summary(self) -> dict:
        s = self.staleness
        return {"mean": float(s.mean()), "p50": float(np.percentile(s, 50)),
                "p95": float(np.percentile(s, 95)), "max": int(s.max()), "pushes": int(s.size)}


def trace(n: int, speeds: Speeds, pushes: int, bound: int | None = None,
          seed: int = 0) -> Trace:
    """The first `pushes` pushes of n workers under ASP (bound None) or SSP(bound)."""
    if n < 1 or pushes < 0:
        raise ValueError(f"n {n} and pushes {pushes}: n >= 1, pushes >= 0")
    rng = np.random.default_rng(seed)
    base = speeds.base(n)
    block = max(1, math.ceil(pushes / n) + 1)
    factors = speeds.draws(rng, (block, n)) * base  # (steps, n) each worker's step times
    steps = np.zeros(n, dtype=np.int64)  # steps started by each worker
    clock = np.zeros(n, dtype=np.int64)  # pushes accepted from each worker
    read = np.zeros(n, dtype=np.int64)  # the version each worker's running step read
    heap = [(float(factors[0, w]), w) for w in range(n)]
    heapq.heapify(heap)
    steps[:] = 1
    waiting: list[int] = []  # SSP: workers held at their read
    out_w = np.empty(pushes, dtype=np.int64)
    out_r = np.empty(pushes, dtype=np.int64)
    out_t = np.empty(pushes)
    for p in range(pushes):
        t, w = heapq.heappop(heap)
        out_w[p], out_r[p], out_t[p] = w, read[w], t
        clock[w] += 1
        waiting.append(w)
        slowest = int(clock.min()) if bound is not None else 0
        still = []
        for v in sorted(waiting):  # the lower id reads first, as in a tie
            if bound is not None and clock[v] - slowest > bound:
                still.append(v)
                continue
            if steps[v] >= factors.shape[0]:
                factors = np.concatenate([factors, speeds.draws(rng, (block, n)) * base])
            read[v] = p + 1
            heapq.heappush(heap, (t + float(factors[steps[v], v]), v))
            steps[v] += 1
        waiting = still
    return Trace(out_w, out_r, out_t)


def round_time(n: int, speeds: Speeds, backups: int = 0, rounds: int = 200,
               seed: int = 0) -> float:
    """Mean over rounds of the n-th smallest of n + backups step times (units of a mean
    step): BSP with backup workers; backups 0: the slowest of n (a sync step's compute)."""
    rng = np.random.default_rng(seed)
    times = speeds.draws(rng, (rounds, n + backups)) * speeds.base(n + backups)  # (R, n+b)
    return float(np.partition(times, n - 1, axis=1)[:, n - 1].mean())


def throughput(n: int, speeds: Speeds, bound: int | None = None, rounds: int = 20,
               seed: int = 0) -> float:
    """Pushes per mean step of n workers in steady state (ASP: the sum of their rates;
    SSP: fewer, where the bound holds the fast ones), from the second half of a trace of
    `rounds` x n pushes."""
    t = trace(n, speeds, rounds * n, bound, seed)
    half = t.time.size // 2
    return float((t.time.size - half) / (t.time[-1] - t.time[half - 1]))
