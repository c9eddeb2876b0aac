"""Optimizer step throughput, one-pass C against NumPy's passes, read against p += g.

    dtlab-bench optim --json bench-optim.json     # 1-64 MB, ~30 s
    dtlab-bench optim --tiny                      # seconds; run by the test suite

An update is memory-bound: SGD reads p and g and writes p (3 x the tensor's
bytes), momentum also reads and writes v (5 x), Adam m and v (7 x). For each
size, optimizer and thread count this times one step of the parameter
server's optimizer (pserver.server.cache_blocked.BlockedOptimizer over models.optim, the
trainers' code) on float32, by both paths: `C` (models/_fused.c, one pass)
and `numpy` (the array lines it replaces, models.optim._fused switched off),
and next to it, in the same run, the simplest update there is, `p += g` in
one NumPy pass on the same blocks and threads (3 x the bytes, like STREAM's
add kernel done in place, so no write-allocate traffic on either side):

    traffic GB/s = bytes the update must move / step time
    ratio        = traffic GB/s / (p += g) GB/s     1.0: the update runs at memory speed

Median of --rounds after a warm-up step. Both paths start from the same
values; a step whose result differs between them by a single bit counts in
#wrong and makes the exit status 1.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np

import dtlab.models.optim as optim
from dtlab.lab.bench import harness
from dtlab.models.config import (
    ConfigError,
    add_flags,
    build,
    described,
    from_namespace,
    positive_list,
)
from dtlab.models.optim import OptimConfig
from dtlab.models.run.cli import run_cli
from dtlab.pserver.server.cache_blocked import BlockedOptimizer

MB = 1 << 20
TRAFFIC = {"sgd": 3, "momentum": 5, "adam": 7}  # tensor-sized reads + writes per step
SETTINGS = {"sgd": {"optimizer": "sgd"}, "momentum": {"optimizer": "sgd", "momentum": 0.9},
            "adam": {"optimizer": "adam"}}


@dataclass
class BenchConfig:
    json: str = described("", "write the JSON {meta, rows} here")
    tiny: bool = described(False, "2 MB, 2 rounds: a smoke run (the test suite's)")
    sizes_mb: str = described("1,16,64", "flat buffer sizes in MB")
    optimizers: str = described("sgd,momentum,adam", "update rules to time")
    threads: str = described("1,2", "optimizer threads (blocks split among them)")
    rounds: int = described(11, "timed steps per row (the median is reported)")

    def validate(self):
        unknown = set(self.optimizers.split(",")) - set(TRAFFIC)
        if unknown:
            raise ConfigError(f"--optimizers: unknown {', '.join(sorted(unknown))} "
                              f"({', '.join(TRAFFIC)})")
        if self.rounds < 1:
            raise ConfigError("--rounds must be at least 1")
        for name in ("sizes_mb", "threads"):
            positive_list(self, name)


def median_seconds(fn, rounds: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def one_step(name: str, n: int, threads: int, fused: bool, rounds: int):
    """(median step seconds, parameters after one step from the seeded start)."""
    saved = optim._fused
    optim._fused = saved if fused else None
    try:
        rng = np.random.default_rng(n)
        params = rng.standard_normal(n).astype(np.float32)
        grad = rng.standard_normal(n).astype(np.float32)
        cfg = build(OptimConfig, {"lr": 1e-3, "warmup": 0, **SETTINGS[name]})
        optimizer = BlockedOptimizer(cfg, params, threads=threads)
        optimizer.step(params, grad, 1e-3)
        after_one = params.copy()
        seconds = median_seconds(lambda: optimizer.step(params, grad, 1e-3), rounds)
        return seconds, after_one
    finally:
        optim._fused = saved


def add_seconds(n: int, threads: int, rounds: int) -> float:
    """p += g in one NumPy pass on the optimizer's own blocks and thread groups."""
    p, g = np.zeros(n, np.float32), np.full(n, 1e-3, np.float32)
    blocked = BlockedOptimizer(build(OptimConfig, {"optimizer": "sgd"}), p, threads=threads)

    def add():
        def run(blocks):
            for k in blocks:
                lo, hi = blocked.bounds[k]
                p[lo:hi] += g[lo:hi]
        blocked.parallel.run(run, blocked.groups)

    return median_seconds(add, rounds)


TABLE = harness.Table(
    "size = bytes of the flat buffer; thr = optimizer threads; path = C (models/_fused.c) or "
    "numpy; traffic GB/s = bytes the update must read and write / step time; p+=g GB/s = the "
    "same for one NumPy add on the same blocks and threads; ratio = traffic / p+=g; #wrong = "
    "elements where C and numpy differ",
    [harness.Column("size", 10, lambda r: r["bytes"]),
     harness.Column("optimizer", 9, lambda r: r["optimizer"]),
     harness.Column("thr", 3, lambda r: r["threads"]),
     harness.Column("path", 5, lambda r: r["path"]),
     harness.Column("step(ms)", 9, lambda r: 1e3 * r["step_s"], ".3f"),
     harness.Column("traffic GB/s", 12, lambda r: r["traffic_gbps"], ".2f"),
     harness.Column("p+=g GB/s", 9, lambda r: r["add_gbps"], ".2f"),
     harness.Column("ratio", 6, lambda r: r["ratio"], ".2f"),
     harness.Column("#wrong", 6, lambda r: r["wrong"])])


def sweep(cfg: BenchConfig) -> list[dict]:
    sizes = [int(s * MB) // 4 * 4 for s in positive_list(cfg, "sizes_mb")]
    threads = [int(t) for t in positive_list(cfg, "threads")]
    names = [o.strip() for o in cfg.optimizers.split(",") if o.strip()]
    if optim._fused is None:
        print("# models/_fused.c is not built: numpy rows only", flush=True)
    paths = ["C", "numpy"] if optim._fused is not None else ["numpy"]
    rows = []
    print(TABLE.head(), flush=True)
    for nbytes in sizes:
        n = nbytes // 4
        for t in threads:
            add_gbps = 3 * nbytes / add_seconds(n, t, cfg.rounds) / 1e9
            for name in names:
                results = {p: one_step(name, n, t, p == "C", cfg.rounds) for p in paths}
                reference = results["numpy"][1]
                for path, (seconds, after_one) in results.items():
                    traffic = TRAFFIC[name] * nbytes / seconds / 1e9
                    rows.append({"bytes": nbytes, "optimizer": name, "threads": t, "path": path,
                                 "step_s": seconds, "traffic_gbps": traffic,
                                 "add_gbps": add_gbps, "ratio": traffic / add_gbps,
                                 "wrong": int(not np.array_equal(after_one, reference))})
                    print(TABLE.line(rows[-1]), flush=True)
    return rows


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_flags(parser, BenchConfig, "benchmark")
    cfg = from_namespace(BenchConfig, parser.parse_args(argv))
    if cfg.tiny:
        cfg.sizes_mb, cfg.threads, cfg.rounds = "2", "1,2", 2
    rows = sweep(cfg)
    wrong = sum(r["wrong"] for r in rows)
    print(f"# {len(rows)} rows, {wrong} wrong: {'OK' if not wrong else 'MISMATCH'}")
    if cfg.json:
        harness.write(cfg.json, "optim", rows, **asdict(cfg))
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
