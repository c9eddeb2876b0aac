"""What chain replication costs a push: one shard with a backup (--replicas 2) against one without.

    dtlab-bench replication --json bench-replication.json
    dtlab-bench replication --tiny --json /tmp/r.json    # a few seconds (the suite)

For every payload (float32, 1 MB and 16 MB by default) two setups run side by side,
as separate processes on this host: a shard daemon alone (replicas 1, the baseline)
and a primary with its backup (replicas 2, pserver.server.replication.primary: every push is
applied by the primary, streamed to the backup, applied there, and only then
acknowledged). W worker processes (the real pserver.worker.client.PSClient, over gRPC, no
shared memory unless --shm) push R gradients each, back to back, to one setup
and then the other, in alternating order, --trials times; a trial's time is from
the first worker's first push to the last worker's last reply (CLOCK_MONOTONIC is
shared by all processes), and the table shows the median over trials:

    push GB/s   W * R * bytes / time (GB = 1e9 B): gradient bytes acknowledged per second
    updates/s   W * R / time: pushes acknowledged (applied by the optimizer) per second
    x1          this setup's updates/s over the baseline's in the same run

The optimizer is SGD (ASP, one update per push). `wrong` counts setups whose
parameters after the run differ from the exact expected values (gradients of
2^-12 and lr 1: every sum is exact in float32) or whose replicas' versions are not
all the number of pushes made (the backup applied every one).
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import grpc
import numpy as np

from dtlab.lab.bench import harness
from dtlab.models.config import ConfigError, add_flags, build, described, from_namespace
from dtlab.models.optim import OptimConfig, Schedule
from dtlab.models.run.allocator import keep_freed_memory
from dtlab.models.run.cli import run_cli
from dtlab.protos import dtlab_ps_pb2 as pb
from dtlab.pserver.common.codec import SERVICE
from dtlab.pserver.common.config import ClientConfig, ServerConfig
from dtlab.pserver.server.allocator import huge_empty
from dtlab.pserver.server.cache_blocked import BlockedOptimizer
from dtlab.pserver.server.consistency import Consistency
from dtlab.pserver.server.daemon import Daemon
from dtlab.pserver.server.replication.journal import REPLICATION
from dtlab.pserver.server.store import ShardLayout, ShardStore
from dtlab.pserver.worker.client import PSClient

MODEL = "bench-flat"
MB = 1 << 20
GRAD = 2.0 ** -12  # every gradient element: sums of it stay exact in float32
def size_text(nbytes: int) -> str:
    return f"{nbytes / MB:g}MB" if nbytes >= MB else f"{nbytes // 1024}KB"


TABLE = harness.Table(
    "push GB/s = gradient bytes acknowledged per second (W workers, GB = 1e9 B); updates/s = "
    "pushes acknowledged per second; x1 = updates/s over replicas 1's in the same run; wrong "
    "= parameters not exact, or a replica's version != pushes made",
    [harness.Column("size", 8, lambda r: size_text(r["bytes"])),
     harness.Column("W", 3, lambda r: r["workers"]),
     harness.Column("replicas", 8, lambda r: r["replicas"]),
     harness.Column("push GB/s", 10, lambda r: r["push_gbps"], ".3f"),
     harness.Column("updates/s", 10, lambda r: r["updates_per_s"], ".1f"),
     harness.Column("x1", 6, lambda r: r["x1"], ".2f"),
     harness.Column("wrong", 5, lambda r: r["wrong"])])


@dataclass
class BenchConfig:
    json: str = described("", "write the JSON {meta, rows} here")
    tiny: bool = described(False, "tiny sizes and few pushes: a smoke run (the test suite's)")
    sizes_mb: str = described("1,16", "gradient sizes in MiB, comma-separated")
    workers: str = described("1,2", "worker counts, comma-separated")
    pushes: int = described(20, "timed pushes per worker per trial")
    trials: int = described(5, "trials per setup (alternating setups); the median is shown")
    shm: bool = described(False, "workers push through shared memory (same host) instead of gRPC")

    def validate(self):
        if self.pushes < 1 or self.trials < 1:
            raise ConfigError("--pushes and --trials must be at least 1")
        for name in ("sizes_mb", "workers"):
            try:
                values = [float(v) for v in getattr(self, name).split(",")]
            except ValueError:
                raise ConfigError(f"--{name.replace('_', '-')}: comma-separated numbers") from None
            if not values or min(values) <= 0:
                raise ConfigError(f"--{name.replace('_', '-')}: positive numbers")


# -- daemons --------------------------------------------------------------------------------


def serve(elements: int, ready: str, replicas: int, replica_of: str) -> None:
    """One flat shard daemon (SGD lr 1, ASP), a primary or (replica_of) its backup."""
    logging.basicConfig(level=logging.ERROR)  # not the replicas' warnings at the end of a row
    keep_freed_memory()
    layout = ShardLayout(MODEL, elements, 0, 1)
    params = huge_empty(layout.length, np.float32)
    params[...] = 0
    ocfg = build(OptimConfig, {"optimizer": "sgd", "lr": 1.0, "warmup": 0,
                               "schedule": "constant", "clip": 0.0})
    cfg = build(ServerConfig, {"ready_file": ready, "log_level": "warning",
                               "replicas": replicas, "replica_of": replica_of})
    store = ShardStore(layout, params, BlockedOptimizer(ocfg, params, threads=cfg.apply_threads),
                       Schedule(ocfg, 0), Consistency("asp"), log_every=0)
    daemon = Daemon(cfg, store, {"server": asdict(cfg), "model": {}, "optim": asdict(ocfg)})
    signal.signal(signal.SIGTERM, lambda *_: daemon.stopping.set())
    daemon.start()
    daemon.stopping.wait()
    daemon.shutdown()


class Setup:
    """A shard of `elements` float32: one daemon (replicas 1) or a primary and a backup."""

    def __init__(self, elements: int, replicas: int, tmp: Path):
        self.replicas, self.procs, self.addresses = replicas, [], []
        primary = ""
        for i in range(replicas):
            ready = tmp / f"ready-{elements}-{replicas}-{i}.json"
            ready.unlink(missing_ok=True)
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "dtlab.lab.bench.replication", "--serve", str(elements),
                 str(ready), str(replicas),
                 primary]))
            deadline = time.monotonic() + 60
            while not ready.exists():
                if time.monotonic() > deadline or self.procs[-1].poll() is not None:
                    self.stop()
                    raise RuntimeError("bench daemons did not start")
                time.sleep(0.05)
            self.addresses.append(f"127.0.0.1:{json.loads(ready.read_text())['port']}")
            primary = self.addresses[0]
        self.servers = "|".join(self.addresses)

    def params(self, elements: int) -> np.ndarray:
        """The shard's parameters, pulled as a worker would (from the primary)."""
        c = PSClient(build(ClientConfig, {"servers": self.servers, "rpc_timeout_s": 60.0}),
                     shm=False)
        try:
            c.connect(10_000, MODEL, elements)
            values = np.empty(elements, np.float32)
            c.pull(values)
            return values
        finally:
            c.close()

    def versions(self) -> list[int]:
        """Each replica's version (ReplicaStatus; replicas 1: Stats)."""
        found = []
        for a in self.addresses:
            with grpc.insecure_channel(a) as ch:
                if self.replicas == 1:
                    call = ch.unary_unary(f"/{SERVICE}/Stats",
                                          response_deserializer=pb.StatsReply.FromString)
                else:
                    call = ch.unary_unary(f"/{REPLICATION}/ReplicaStatus",
                                          response_deserializer=pb.ReplicaStatusReply.FromString)
                found.append(call(b"", timeout=30).version)
        return found

    def stop(self) -> None:
        for p in reversed(self.procs):  # the backup first: the primary goes on alone
            p.terminate()
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


# -- workers --------------------------------------------------------------------------------


def worker_main(wid: int, conn, elements: int, servers: list[str], shm: bool,
                barrier) -> None:
    """Connect to every setup; then, per command (setup index, pushes), push that many
    gradients back to back after the barrier and answer (start, end)."""
    clients = []
    for s in servers:
        c = PSClient(build(ClientConfig, {"servers": s, "rpc_timeout_s": 120.0}), shm=shm)
        c.connect(wid, MODEL, elements)
        clients.append(c)
    grad, values = np.full(elements, GRAD, np.float32), np.empty(elements, np.float32)
    steps = [0] * len(clients)
    for c in clients:
        c.pull(values)
    conn.send("ready")
    while (command := conn.recv()) is not None:
        k, pushes = command
        barrier.wait()
        start = time.monotonic()
        for _ in range(pushes):
            clients[k].push(grad, steps[k])
            steps[k] += 1
        conn.send((start, time.monotonic()))
    for c in clients:
        c.close()


class Workers:
    def __init__(self, count: int, elements: int, servers: list[str], shm: bool):
        ctx = mp.get_context("spawn")
        self.barrier = ctx.Barrier(count)
        self.pipes, self.procs = [], []
        for wid in range(count):
            ours, theirs = ctx.Pipe()
            p = ctx.Process(target=worker_main, args=(wid, theirs, elements, servers, shm,
                                                      self.barrier), daemon=True)
            p.start()
            self.pipes.append(ours)
            self.procs.append(p)
        for pipe in self.pipes:
            if not pipe.poll(120) or pipe.recv() != "ready":
                raise RuntimeError("bench workers did not start")

    def run(self, setup: int, pushes: int) -> float:
        """Seconds from the first push of any worker to the last reply of any."""
        for pipe in self.pipes:
            pipe.send((setup, pushes))
        spans = [pipe.recv() for pipe in self.pipes]
        return max(end for _, end in spans) - min(start for start, _ in spans)

    def close(self) -> None:
        for pipe in self.pipes:
            pipe.send(None)
        for p in self.procs:
            p.join(timeout=60)


# -- the measurement ------------------------------------------------------------------------


def measure(cfg: BenchConfig, nbytes: int, width: int, tmp: Path) -> list[dict]:
    elements = nbytes // 4
    setups = [Setup(elements, r, tmp) for r in (1, 2)]
    try:
        workers = Workers(width, elements, [s.servers for s in setups], cfg.shm)
        try:
            times: list[list[float]] = [[], []]
            for k in (0, 1):
                workers.run(k, 2)  # warm-up: sessions, connections, allocator
            for trial in range(cfg.trials):
                for k in ((0, 1) if trial % 2 == 0 else (1, 0)):
                    times[k].append(workers.run(k, cfg.pushes))
        finally:
            workers.close()
        pushed = width * (cfg.pushes * cfg.trials + 2)
        want = np.float32(-GRAD * pushed)
        rows = []
        for setup, spans in zip(setups, times, strict=True):
            t = statistics.median(spans)
            versions = setup.versions()
            wrong = int(not np.all(setup.params(elements) == want)
                        or versions != [pushed] * setup.replicas)
            rows.append({"bytes": nbytes, "workers": width, "replicas": setup.replicas,
                         "pushes": width * cfg.pushes, "seconds": t,
                         "push_gbps": width * cfg.pushes * nbytes / t / 1e9,
                         "updates_per_s": width * cfg.pushes / t, "wrong": wrong})
        for r in rows:
            r["x1"] = r["updates_per_s"] / rows[0]["updates_per_s"]
        return rows
    finally:
        for s in setups:
            s.stop()


def main(argv: list[str]) -> int:
    if argv[:1] == ["--serve"]:
        elements, ready, replicas, *primary = argv[1:]
        serve(int(elements), ready, int(replicas), primary[0] if primary else "")
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_flags(parser, BenchConfig, "benchmark")
    cfg = from_namespace(BenchConfig, parser.parse_args(argv))
    if cfg.tiny:
        cfg.sizes_mb, cfg.workers, cfg.pushes, cfg.trials = "0.0625", "1,2", 5, 2
    print(TABLE.head(), flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-replication-") as tmp:
        for size in cfg.sizes_mb.split(","):
            for width in cfg.workers.split(","):
                for r in measure(cfg, int(float(size) * MB), int(width), Path(tmp)):
                    rows.append(r)
                    print(TABLE.line(r), flush=True)
    if cfg.json:
        harness.write(cfg.json, "replication", rows, grpcio=grpc.__version__, **asdict(cfg))
    return 1 if any(r["wrong"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(run_cli(main))
