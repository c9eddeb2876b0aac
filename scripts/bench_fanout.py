"""One worker's parameter-server round over S shards, as a training loop meets it.

    python scripts/bench_fanout.py --json runs/fanout.json     # S = 1, 2; 64 KB..4 MB; ~1 min
    python scripts/bench_fanout.py --tiny                      # seconds (tests)

A worker pushes its gradient to S shards in parallel and waits for every
reply (PSClient.push_pull: the push carrying the next pull, as dtlab-worker
runs). In a cost model's first guess the S messages travel at once and the
round costs what one shard's costs. On a host they do not: the worker's
per-shard work (building each message, the copies, reading each reply)
runs in one process under one interpreter lock, and S more server
processes wake for it. And between two rounds the worker computes for
milliseconds, long enough for every thread of the round to fall asleep, so
a training round is a cold one: the wake-ups are in it. So each round here
follows a gap of `--gap-ms` (default 5) of matrix products in this process,
and the baseline is the same round hot, back to back, on one shard:

    round      median of one push_pull over S shards, ms (the gap not counted)
    x hot      round / the hot one-shard round of the same path and size

on the shared-memory path (`shm`, a worker's path to shards on its host)
and the gRPC one (`fused`). simulate.py --calibrate fits per path
round = alpha + (S - 1) per_shard + n beta over the cold rows
(simulate_lib/calibrate.py), the parameter server's round on this host.
`wrong` counts paths whose final parameters are not the exact sum of what
was pushed (lr 1, gradients of 2^-12: exact in float32).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from bench_pserver import GRAD, MODEL, Servers
from threadpoolctl import threadpool_limits

from dtlab.models.config import build
from dtlab.models.run.allocator import keep_freed_memory
from dtlab.pserver.client import PSClient
from dtlab.pserver.config import ClientConfig

PATHS = {"shm": True, "fused": False}  # name: shared memory on


def busy(seconds: float, a: np.ndarray) -> None:
    """Matrix products for `seconds`: a step's compute, as far as the round is concerned."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a @ a


def rounds(client: PSClient, grad: np.ndarray, params: np.ndarray, step: int, count: int,
           gap_s: float, a: np.ndarray) -> tuple[list[float], int]:
    """(seconds of each of `count` push_pull rounds, each after a gap of `gap_s`, the next
    step)."""
    times = []
    for _ in range(count):
        busy(gap_s, a)
        t0 = time.perf_counter()
        client.push_pull(grad, step, params)
        times.append(time.perf_counter() - t0)
        step += 1
    return times, step


def measure(path: str, nbytes: int, shards: int, gap_ms: float, count: int, warmup: int,
            tmp: Path) -> dict:
    elements = nbytes // 4
    servers = Servers(elements, shards, "sgd", tmp, lr=1.0, name=f"-{path}-fanout")
    try:
        client = PSClient(build(ClientConfig, {"servers": ",".join(servers.addresses)}),
                          transport="session", shm=PATHS[path])
        try:
            step = client.connect(0, MODEL, elements)
            params, grad = np.zeros(elements, np.float32), np.full(elements, GRAD, np.float32)
            client.pull(params)
            a = np.ones((128, 128), np.float32)
            _, step = rounds(client, grad, params, step, warmup, gap_ms * 1e-3, a)
            times, step = rounds(client, grad, params, step, count, gap_ms * 1e-3, a)
            client.pull(params)
            pushes = client.stats()[0].pushes
            wrong = int(not np.array_equal(params, np.full(elements, -pushes * GRAD, np.float32))
                        or all(s.shared_memory for s in client.shards) != PATHS[path])
        finally:
            client.close()
    finally:
        servers.stop()
    return {"mode": "fanout", "path": path, "bytes": nbytes, "shards": shards, "gap_ms": gap_ms,
            "round_ms": 1e3 * statistics.median(times), "rounds": count, "wrong": wrong}


HEADER = (f"#{'size':>9} {'path':>6} {'S':>3} {'gap ms':>7} {'round ms':>9} {'x hot':>7} "
          f"{'wrong':>5}")


def line(r: dict, hot: float) -> str:
    return (f" {r['bytes']:>9} {r['path']:>6} {r['shards']:>3} {r['gap_ms']:>7.1f} "
            f"{r['round_ms']:>9.3f} {r['round_ms'] / hot:>7.2f} {r['wrong']:>5}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes-kb", default="64,1024,4096", help="gradient sizes in KiB")
    p.add_argument("--shards", default="1,2", help="shard counts S")
    p.add_argument("--gap-ms", type=float, default=5.0,
                   help="compute before each cold round, ms (default 5)")
    p.add_argument("--rounds", type=int, default=60, help="timed rounds per row (default 60)")
    p.add_argument("--warmup", type=int, default=5, help="untimed rounds first (default 5)")
    p.add_argument("--json", default="", metavar="PATH", help="write the rows here")
    p.add_argument("--tiny", action="store_true", help="64 KB, 3 rounds: a smoke run (tests)")
    o = p.parse_args(argv)
    try:
        sizes = [int(float(k) * 1024) for k in o.sizes_kb.split(",")]
        shard_counts = [int(s) for s in o.shards.split(",")]
    except ValueError as e:
        p.error(f"--sizes-kb and --shards take comma lists of numbers: {e}")
    if min(sizes) < 4 or min(shard_counts) < 1 or o.gap_ms < 0 or o.rounds < 1 or o.warmup < 0:
        p.error("sizes of at least 4 bytes, at least 1 shard, --rounds >= 1, and no negative "
                "--gap-ms or --warmup")
    if o.tiny:
        sizes, shard_counts, o.rounds, o.warmup, o.gap_ms = [64 * 1024], [1, 2], 3, 1, 1.0
    keep_freed_memory()  # as pserver's worker does
    threadpool_limits(limits=1)  # the gap's products: one core, as a worker sharing a host
    print(f"# dtlab: a worker's push_pull over S shards, each round after {o.gap_ms:g} ms of "
          f"compute (cold), against the hot one-shard round; median of {o.rounds} rounds; "
          f"load average {os.getloadavg()[0]:.2f}")
    print("# size: gradient bytes; x hot: round / the same path and size hot on one shard; "
          "wrong: final parameters not the exact sum pushed")
    print(HEADER)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-fanout-") as tmp:
        for nbytes in sizes:
            for path in PATHS:
                hot = measure(path, nbytes, 1, 0.0, o.rounds, o.warmup, Path(tmp))
                rows.append(hot)
                print(line(hot, hot["round_ms"]), flush=True)
                for shards in shard_counts:
                    rows.append(measure(path, nbytes, shards, o.gap_ms, o.rounds, o.warmup,
                                        Path(tmp)))
                    print(line(rows[-1], hot["round_ms"]), flush=True)
    wrong = sum(r["wrong"] for r in rows)
    print(f"# Out of bounds values : {wrong} {'OK' if not wrong else 'FAILED'}")
    if o.json:
        Path(o.json).write_text(json.dumps({
            "env": {"python": platform.python_version(), "cpus": os.cpu_count(),
                    "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")},
            "config": vars(o), "rows": rows}, indent=1))
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
