"""One worker's parameter-server round over S shards, as a training loop meets it.

    dtlab-bench fanout --json runs/fanout.json     # S = 1, 2; 64 KB..4 MB; ~1 min
    dtlab-bench fanout --tiny                      # seconds (tests)

A worker pushes its gradient to S shards in parallel and waits for every
reply (PSClient.push_pull: the push carrying the next pull, as dtlab-worker
runs). In a cost model's first guess the S messages travel at once and the
round costs what one shard's costs. On a host they do not: the worker's
per-shard work (building each message, the copies, reading each reply)
runs in one process under one interpreter lock, and S more server
processes wake for it. And between two rounds the worker computes for
milliseconds over megabytes of activations and gradients: every thread of
the round falls asleep and the caches fill with the step's data, so a
training round is a cold one, its wake-ups and cache misses in it
(figures: scripts/RESULTS.md). So each round here follows a gap of
`--gap-ms` (default 5) of copying a working set of `--gap-mb` (default 16
MB, beyond the caches) in
this process, and the baseline is the same round hot, back to back, on one
shard:

    round      median of one push_pull over S shards, ms (the gap not counted)
    x hot      round / the hot one-shard round of the same path and size
    cpu        CPU time of a round, ms: the worker's (every thread, the gap's
               copies left out) plus the S shard daemons' (/proc schedstat),
               which can exceed the round: both sides and gRPC's threads run
               at once

on the shared-memory path (`shm`, a worker's path to shards on its host)
and the gRPC one (`fused`). dtlab-simulate --calibrate fits per path
round = alpha + (S - 1) per_shard + n beta over the cold rows
(simulate/calibration_fit.py), the parameter server's round on this host, and
the same form over the CPU column, the CPU a round takes from the cores
that the other workers compute on.
`--co-runners K` keeps K processes computing dtlab's default transformer
(a worker's compute, in a loop) beside all of it, as other workers on the
host: the round then waits for cores that the model's steps hold, and its
tail grows (the p90 column). Those rows are measurements, not fitted.
`wrong` counts paths whose final parameters are not the exact sum of what
was pushed (lr 1, gradients of 2^-12: exact in float32).
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from dtlab.lab.bench import harness
from dtlab.lab.bench.harness import trainer_step
from dtlab.lab.bench.shards import GRAD, MODEL, Servers
from dtlab.models.config import build
from dtlab.models.run.allocator import keep_freed_memory
from dtlab.models.run.session import build_session, parse
from dtlab.models.run.threads import share_cores
from dtlab.pserver.common.config import ClientConfig
from dtlab.pserver.worker.client import PSClient

PATHS = {"shm": True, "fused": False}  # name: shared memory on


class Gap:
    """A step's compute as far as the round is concerned: `seconds` of copying a working set
    of `nbytes` (a step's activations and gradients), which leaves the caches holding it
    and none of the round's code and data, while the round's threads sleep."""

    def __init__(self, seconds: float, nbytes: int):
        self.seconds = seconds
        self.src = np.ones(max(1, nbytes // 8), np.float32)  # (n,)
        self.dst = np.empty_like(self.src)  # (n,): source and copy make up nbytes

    def __call__(self) -> None:
        end = time.perf_counter() + self.seconds
        while time.perf_counter() < end:
            np.copyto(self.dst, self.src)


def cpu_seconds(pid: int) -> float:
    """CPU time of every thread of process `pid` so far, in ns resolution (Linux
    /proc/PID/task/*/schedstat, whose first field is the time on a CPU; 0 elsewhere)."""
    total = 0
    for stat in Path(f"/proc/{pid}/task").glob("*/schedstat"):
        try:
            total += int(stat.read_text().split()[0])
        except (OSError, IndexError, ValueError):  # a thread that ended meanwhile
            continue
    return total * 1e-9


def rounds(client: PSClient, grad: np.ndarray, params: np.ndarray, step: int, count: int,
           gap: Gap) -> tuple[list[float], float, int]:
    """(seconds of each of `count` push_pull rounds, each after a gap; this process's CPU
    seconds in the rounds: every thread's, less the gaps', which run in this thread; the
    next step)."""
    times, gaps = [], 0.0
    start = time.process_time()
    for _ in range(count):
        g0 = time.thread_time()
        gap()
        gaps += time.thread_time() - g0
        t0 = time.perf_counter()
        client.push_pull(grad, step, params)
        times.append(time.perf_counter() - t0)
        step += 1
    return times, time.process_time() - start - gaps, step


def co_run(processes: int) -> None:
    """A co-runner: dtlab's default transformer's worker compute (batch, forward, backward,
    norm) in a loop until SIGTERM, at its share of the cores among `processes`."""
    share_cores(processes=processes)
    session = build_session(parse([], prog="bench fanout --co-run"))
    step = trainer_step(session, "worker")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    while not stop.is_set():
        step()


@contextmanager
def co_runners(k: int):
    """K co-runner processes (co_run) for the duration of the block."""
    procs = [subprocess.Popen([sys.executable, "-m", "dtlab.lab.bench.fanout", "--co-run",
                               str(k + 1)])
             for _ in range(k)]
    try:
        time.sleep(2.0 if k else 0.0)  # started and stepping
        if any(p.poll() is not None for p in procs):
            raise RuntimeError("a co-runner exited at start")
        yield
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=30)


def measure(path: str, nbytes: int, shards: int, gap_ms: float, gap_mb: float, count: int,
            warmup: int, co_runners: int, tmp: Path) -> dict:
    elements = nbytes // 4
    servers = Servers(elements, shards, "sgd", tmp, lr=1.0, name=f"-{path}-fanout")
    try:
        client = PSClient(build(ClientConfig, {"servers": ",".join(servers.addresses)}),
                          transport="session", shm=PATHS[path])
        try:
            step = client.connect(0, MODEL, elements)
            params, grad = np.zeros(elements, np.float32), np.full(elements, GRAD, np.float32)
            client.pull(params)
            gap = Gap(gap_ms * 1e-3, int(gap_mb * 1e6))
            _, _, step = rounds(client, grad, params, step, warmup, gap)
            before = sum(cpu_seconds(p.pid) for p in servers.procs)
            times, cpu, step = rounds(client, grad, params, step, count, gap)
            server_cpu = sum(cpu_seconds(p.pid) for p in servers.procs) - before
            client.pull(params)
            pushes = client.stats()[0].pushes
            wrong = int(not np.array_equal(params, np.full(elements, -pushes * GRAD, np.float32))
                        or all(s.shared_memory for s in client.shards) != PATHS[path])
        finally:
            client.close()
    finally:
        servers.stop()
    return {"mode": "fanout", "path": path, "bytes": nbytes, "shards": shards, "gap_ms": gap_ms,
            "gap_mb": gap_mb, "co_runners": co_runners,
            "round_ms": 1e3 * statistics.median(times),
            "round_p90_ms": 1e3 * statistics.quantiles(times, n=10)[-1] if count > 1 else
            1e3 * times[0], "client_cpu_ms": 1e3 * cpu / count,
            "server_cpu_ms": 1e3 * server_cpu / count, "rounds": count, "wrong": wrong}


TABLE = harness.Table(
    "size: gradient bytes; round, p90: median and 90th percentile; x hot: round / the same "
    "path and size hot on one shard; cpu: the worker's and the shards' CPU time a round; "
    "wrong: final parameters not the exact sum pushed",
    [harness.Column("size", 9, lambda r: r["bytes"]),
     harness.Column("path", 6, lambda r: r["path"]),
     harness.Column("S", 3, lambda r: r["shards"]),
     harness.Column("gap ms", 7, lambda r: r["gap_ms"], ".1f"),
     harness.Column("round ms", 9, lambda r: r["round_ms"], ".3f"),
     harness.Column("p90 ms", 8, lambda r: r["round_p90_ms"], ".3f"),
     harness.Column("x hot", 7, lambda r: r["x_hot"], ".2f"),
     harness.Column("cpu ms", 7, lambda r: r["client_cpu_ms"] + r["server_cpu_ms"], ".3f"),
     harness.Column("wrong", 5, lambda r: r["wrong"])])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--co-run"]:
        co_run(int(argv[1]))
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes-kb", default="64,1024,4096", help="gradient sizes in KiB")
    p.add_argument("--shards", default="1,2", help="shard counts S")
    p.add_argument("--gap-ms", type=float, default=5.0,
                   help="compute before each cold round, ms (default 5)")
    p.add_argument("--gap-mb", type=float, default=16.0,
                   help="the working set the gap goes over, MB (default 16: beyond the caches, "
                        "as a step's activations and gradients)")
    p.add_argument("--rounds", type=int, default=100, help="timed rounds per row (default 100)")
    p.add_argument("--warmup", type=int, default=5, help="untimed rounds first (default 5)")
    p.add_argument("--co-runners", type=int, default=0,
                   help="processes computing dtlab's default transformer beside the rounds "
                        "all along, as other workers on the host (default 0; not fitted)")
    harness.common_flags(p, "64 KB, 3 rounds: a smoke run (tests)")
    o = p.parse_args(argv)
    try:
        sizes = [int(float(k) * 1024) for k in o.sizes_kb.split(",")]
        shard_counts = [int(s) for s in o.shards.split(",")]
    except ValueError as e:
        p.error(f"--sizes-kb and --shards take comma lists of numbers: {e}")
    if min(sizes) < 4 or min(shard_counts) < 1 or o.rounds < 1 or min(
            o.gap_ms, o.gap_mb, o.warmup, o.co_runners) < 0:
        p.error("sizes of at least 4 bytes, at least 1 shard, --rounds >= 1, and no negative "
                "--gap-ms, --gap-mb, --warmup or --co-runners")
    if o.tiny:
        sizes, shard_counts, o.rounds, o.warmup, o.gap_ms = [64 * 1024], [1, 2], 3, 1, 1.0
    keep_freed_memory()  # as pserver's worker does
    print(f"# dtlab: a worker's push_pull over S shards, each round after {o.gap_ms:g} ms of "
          f"work over {o.gap_mb:g} MB (cold), against the hot one-shard round; median of "
          f"{o.rounds} rounds; {o.co_runners} co-runner(s); "
          f"load average {os.getloadavg()[0]:.2f}")
    print(TABLE.head())
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-fanout-") as tmp, co_runners(o.co_runners):
        for nbytes in sizes:
            for path in PATHS:
                hot = measure(path, nbytes, 1, 0.0, 0.0, o.rounds, o.warmup, o.co_runners,
                              Path(tmp))
                rows.append({**hot, "x_hot": 1.0})
                print(TABLE.line(rows[-1]), flush=True)
                for shards in shard_counts:
                    cold = measure(path, nbytes, shards, o.gap_ms, o.gap_mb, o.rounds,
                                   o.warmup, o.co_runners, Path(tmp))
                    rows.append({**cold, "x_hot": cold["round_ms"] / hot["round_ms"]})
                    print(TABLE.line(rows[-1]), flush=True)
    status = harness.closing(rows)
    if o.json:
        harness.write(o.json, "fanout", rows, **vars(o))
    return status


if __name__ == "__main__":
    sys.exit(main())
