"""Parameter-server shard daemons for the benchmarks, each in its own process: the real
pserver.server.daemon.Daemon over a flat float32 store of n elements (ASP), with a plain
gRPC sink and sources of the same tensor beside it (`ceiling_handler`: what moving the
tensor over gRPC costs before the parameter server adds its own work). Used by
bench/pserver.py and bench/fanout.py.

    python -m dtlab.lab.bench.shards ELEMENTS SHARD NUM_SHARDS OPTIMIZER READY CODEC LR
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import grpc
import numpy as np

from dtlab.models.config import build
from dtlab.models.optim import OptimConfig, Schedule
from dtlab.models.run.allocator import keep_freed_memory
from dtlab.pserver.common import codec as wire
from dtlab.pserver.common.config import ServerConfig
from dtlab.pserver.server.allocator import huge_empty
from dtlab.pserver.server.cache_blocked import BlockedOptimizer
from dtlab.pserver.server.consistency import Consistency
from dtlab.pserver.server.daemon import Daemon
from dtlab.pserver.server.store import ShardLayout, ShardStore

MODEL = "bench-flat"
CEILING = "dtlab.bench.Ceiling"
GRAD = 2.0**-12  # lr 1: parameters after k pushes of it are exactly -k * GRAD


def plain(values: np.ndarray) -> Iterator[bytes]:
    """A plain stream of `values`: each ~1 MiB message made from the array when asked for."""
    for lo, hi in wire.chunk_bounds(values.size, values.itemsize, wire.CHUNK_BYTES):
        yield values[lo:hi].tobytes()


def prebuilt(values: np.ndarray) -> list[bytes]:
    """The plain stream's messages, made once: the transport streams them as they are."""
    return list(plain(values))


def ceiling_handler(length: int) -> grpc.GenericRpcHandler:
    """A sink for client streams, and sources of plain and of prebuilt messages."""
    values = np.zeros(length, np.float32)
    messages = prebuilt(values)

    def sink(requests, context):
        for _ in requests:
            pass
        return b""

    return grpc.method_handlers_generic_handler(CEILING, {
        "Sink": grpc.stream_unary_rpc_method_handler(sink),
        "Source": grpc.unary_stream_rpc_method_handler(lambda request, context: plain(values)),
        "Prebuilt": grpc.unary_stream_rpc_method_handler(
            lambda request, context: iter(messages)),
    })


def serve(elements: int, shard: int, num_shards: int, optimizer: str, ready: str,
          codec: str = "hand", lr: float = 1e-6) -> None:
    keep_freed_memory()  # as pserver's daemon does
    layout = ShardLayout(MODEL, elements, shard, num_shards)
    params = huge_empty(layout.length, np.float32)  # as pserver's daemon does
    params[...] = 0
    ocfg = build(OptimConfig, {"optimizer": optimizer, "lr": lr, "warmup": 0,
                               "schedule": "constant", "clip": 0.0})
    cfg = build(ServerConfig, {"shard": shard, "num_shards": num_shards, "ready_file": ready,
                               "log_level": "warning"})
    store = ShardStore(layout, params, BlockedOptimizer(ocfg, params, threads=cfg.apply_threads),
                       Schedule(ocfg, 0), Consistency("asp"), log_every=0)
    daemon = Daemon(cfg, store, {"server": asdict(cfg), "model": {}, "optim": asdict(ocfg)},
                    handlers=(ceiling_handler(layout.length),), codec=wire.CODECS[codec])
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    daemon.start()
    stop.wait()
    daemon.shutdown()


class Servers:
    """S shard daemons in their own processes, for one (size, S, optimizer)."""

    def __init__(self, elements: int, num_shards: int, optimizer: str, tmp: Path,
                 codec: str = "hand", lr: float = 1e-6, name: str = ""):
        self.procs, ready = [], []
        for i in range(num_shards):
            path = tmp / f"ready-{elements}-{num_shards}-{optimizer}-{codec}{name}-{i}.json"
            path.unlink(missing_ok=True)
            ready.append(path)
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "dtlab.lab.bench.shards",
                 str(elements), str(i), str(num_shards),
                 optimizer, str(path), codec, str(lr)]))
        deadline = time.monotonic() + 60
        while not all(p.exists() for p in ready):
            if time.monotonic() > deadline or any(p.poll() is not None for p in self.procs):
                self.stop()
                raise RuntimeError("bench servers did not start")
            time.sleep(0.05)
        self.addresses = [f"127.0.0.1:{json.loads(p.read_text())['port']}" for p in ready]

    def stop(self) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


if __name__ == "__main__":
    elements, shard, num_shards, optimizer, ready, codec, lr = sys.argv[1:8]
    serve(int(elements), int(shard), int(num_shards), optimizer, ready, codec, float(lr))
