"""Per-layer Mixture-of-Experts statistics, one record per forward.

    stats = MoEStats()
    layer = MoE(..., stats=stats)        # each forward calls stats.record(...)
    stats.summary()                      # times: p50/p95/p99 (s); the rest: means

Recorded per forward (host values): tokens per expert (pairs choosing each, before
drops) and kept (after capacity), load imbalance max/mean, dropped pairs and dropped
tokens (all of a token's pairs dropped: its MoE output is 0, the residual carries it),
router entropy (nats), experts per token, the co-selection matrix (N x N: C[a, b] =
tokens that chose both a and b; the diagonal is the tokens choosing a), the selection
bias, the balancing terms' values and the times of router, dispatch, expert compute and
combine (time.perf_counter around each; on a GPU they include only the work the host
waited for). A forward run again by Recompute in backward records again.
"""

from __future__ import annotations

from collections import deque

import numpy as np

PHASES = ("router", "dispatch", "compute", "combine")


class MoEStats:
    """`window`: how many recent forwards the time percentiles cover (memory stays bounded
    in long runs); the means cover every forward since the stats were made."""

    def __init__(self, window: int = 4096):
        self.forwards = 0
        self.times: dict[str, deque[float]] = {k: deque(maxlen=window) for k in PHASES}
        self.sums: dict[str, np.ndarray | float] = {}
        self.last: dict = {}

    def record(self, times: dict[str, float], load, kept, dropped_tokens: int, entropy: float,
               experts_per_token: float, coselect, bias, aux: dict[str, float]) -> None:
        """One forward's figures; arrays are host NumPy arrays."""
        load = np.asarray(load, dtype=np.float64)
        mean = load.mean()
        rec = {"tokens_per_expert": load, "kept_per_expert": np.asarray(kept, np.float64),
               "imbalance": float(load.max() / mean) if mean > 0 else 1.0,
               "dropped_pairs": float(load.sum() - np.sum(kept)),
               "dropped_tokens": float(dropped_tokens), "entropy": entropy,
               "experts_per_token": experts_per_token,
               "coselect": np.asarray(coselect, np.float64),
               **({"bias": np.asarray(bias, np.float64)} if bias is not None else {}),
               **{f"aux_{k}": v for k, v in aux.items()}}
        for k in PHASES:
            self.times[k].append(times[k])
        for k, v in rec.items():
            self.sums[k] = self.sums.get(k, 0.0) + v
        self.forwards += 1
        self.last = {**rec, "times": dict(times)}

    def summary(self) -> dict:
        """{"forwards", "<phase>_s": {p50, p95, p99}, and the mean of every other figure}."""
        out: dict = {"forwards": self.forwards}
        if not self.forwards:
            return out
        for k in PHASES:
            p50, p95, p99 = np.percentile(self.times[k], [50, 95, 99])
            out[f"{k}_s"] = {"p50": float(p50), "p95": float(p95), "p99": float(p99)}
        for k, v in self.sums.items():
            mean = v / self.forwards
            out[k] = mean.tolist() if isinstance(mean, np.ndarray) else float(mean)
        return out
