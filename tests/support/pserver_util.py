"""Helpers for the parameter-server tests: real daemons on ephemeral loopback ports.

`serve(...)` runs shard daemons in this process (fast, for unit-level tests);
`DaemonProcess` runs `python -m dtlab.pserver serve` as a subprocess (signals,
exit codes, checkpoints); `run_workers` starts real `python -m dtlab.pserver.worker`
processes. Every wait is bounded and every process is killed in teardown.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from dtlab.models.config import build
from dtlab.models.data import DataConfig
from dtlab.models.optim import OptimConfig
from dtlab.models.params import FlatParams
from dtlab.models.zoo import build_model, config_class
from dtlab.pserver.common import codec as wire
from dtlab.pserver.common.config import ClientConfig, ServerConfig
from dtlab.pserver.server.daemon import Daemon, build_store, config_record
from dtlab.pserver.worker.client import PSClient

ROOT = Path(__file__).resolve().parents[2]
TINY_MLP = {"d_in": 4, "d_hidden": 8, "n_layers": 1, "n_classes": 3}
TINY_MLP_FLAGS = ["--model", "mlp", "--d-in", "4", "--d-hidden", "8", "--n-layers", "1",
                  "--n-classes", "3"]
SGD1 = {"optimizer": "sgd", "lr": 1.0, "warmup": 0, "schedule": "constant", "clip": 0.0}
OPENSSL = shutil.which("openssl")
# Several processes share few cores: a multi-threaded BLAS per process is far slower on tiny
# matmuls under that contention, so worker and reference-trainer processes get one thread.
ONE_BLAS_THREAD = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}


def initial_params(model: str = "mlp", model_cfg: dict | None = None, seed: int = 0,
                   dtype: str = "float32") -> FlatParams:
    """The model's seeded initial parameters, as every shard and trainer starts."""
    cfg = build(config_class(model), dict(TINY_MLP if model_cfg is None else model_cfg))
    return FlatParams(build_model(model, cfg).specs(), seed=seed, dtype=dtype, xp=np)


@contextmanager
def serve(shards: int = 1, model: str = "mlp", model_cfg: dict | None = None,
          optim: dict | None = None, shm: bool = True, data: dict | None = None, **server):
    """`shards` daemons of one model in this process; yields them, shuts them down after.
    `data`: the data config workers must bring (Register checks it)."""
    model_cfg = build(config_class(model), dict(TINY_MLP if model_cfg is None else model_cfg))
    ocfg = build(OptimConfig, dict(SGD1 if optim is None else optim))
    dcfg = build(DataConfig, dict(data or {}))
    daemons = []
    try:
        for i in range(shards):
            cfg = build(ServerConfig, {"shard": i, "num_shards": shards, "grace_s": 2.0,
                                       **server})
            d = Daemon(cfg, build_store(cfg, model, model_cfg, ocfg),
                       config_record(cfg, model, model_cfg, ocfg, dcfg), shm=shm)
            d.start()
            daemons.append(d)
        yield daemons
    finally:
        for d in daemons:
            d.shutdown()


def addresses(daemons) -> str:
    return ",".join(f"127.0.0.1:{d.port}" for d in daemons)


def connect(servers: str, worker: int = 0, params: FlatParams | None = None,
            transport: str = "session", shm: bool = True, **client) -> PSClient:
    """A connected client for `servers` (registered as `worker` for the tiny MLP)."""
    params = params or initial_params()
    c = PSClient(build(ClientConfig, {"servers": servers, "connect_timeout_s": 20.0,
                                      "rpc_timeout_s": 20.0, **client}),
                 transport=transport, shm=shm)
    c.connect(worker, "mlp", params.size, wire.layout_crc(params.specs))
    return c


class DaemonProcess:
    """`python -m dtlab.pserver serve ARGS` in a subprocess, ready once it wrote its ready file."""

    def __init__(self, tmp: Path, args: list[str], env: dict | None = None, wait: bool = True,
                 timeout: float = 60.0):
        self.ready = tmp / f"ready-{time.monotonic_ns()}.json"
        self.log = tmp / f"{self.ready.stem}.log"
        self.args = [sys.executable, "-m", "dtlab.pserver", "serve",
                     "--ready-file", str(self.ready), *args]
        self._log_f = open(self.log, "w")  # noqa: SIM115 - closed in close()
        self.proc = subprocess.Popen(self.args, cwd=ROOT, stdout=self._log_f,
                                     stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        self.port = self.metrics_port = None
        if wait:
            self.wait_ready(timeout)

    def wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not self.ready.exists():
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode}:\n{self.output()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"daemon not ready in {timeout} s:\n{self.output()}")
            time.sleep(0.05)
        info = json.loads(self.ready.read_text())
        self.port, self.metrics_port = info["port"], info["metrics_port"]

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def output(self) -> str:
        self._log_f.flush()
        return self.log.read_text()

    def terminate(self, timeout: float = 30.0) -> int:
        """SIGTERM and wait; the exit code."""
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=timeout)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)
        self._log_f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def run_workers(servers: str, count: int, flags: list[str], tmp: Path,
                timeout: float = 120.0, ids: bool = True, name: str = "worker") -> list[Path]:
    """`count` real worker processes to completion; their metrics files, in launch order.
    ids=False: no --worker-id or --num-workers (the servers assign ids and know the count);
    each process's stderr is kept in NAME{i}.err."""
    procs, paths = [], []
    try:
        for w in range(count):
            path = tmp / f"{name}{w}.jsonl"
            paths.append(path)
            given = ["--worker-id", str(w), "--num-workers", str(count)] if ids else []
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "dtlab.pserver.worker", "--servers", servers, *given,
                 "--metrics", str(path), *flags],
                cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                env=ONE_BLAS_THREAD))
        deadline = time.monotonic() + timeout
        for p, path in zip(procs, paths, strict=True):
            _, err = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
            path.with_suffix(".err").write_text(err)
            assert p.returncode == 0, f"worker exited with {p.returncode}:\n{err}"
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
    return paths


def make_cert(tmp: Path, name: str) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 / localhost with the openssl CLI."""
    cert, key = tmp / f"{name}.crt", tmp / f"{name}.key"
    subprocess.run([OPENSSL, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", f"/CN={name}", "-addext",
                    "subjectAltName=IP:127.0.0.1,DNS:localhost", "-keyout", str(key),
                    "-out", str(cert)], check=True, capture_output=True, timeout=60)
    return cert, key


def wait_stopped(proc: subprocess.Popen, timeout: float = 60.0) -> None:
    """Until the child `proc` has stopped, every thread of it (SIGSTOP, sent by us or by
    itself): kill() returns before the stop takes effect, and a thread still running on
    another core meanwhile can take a message meant to find the process paused."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pid, status = os.waitpid(proc.pid, os.WNOHANG | os.WUNTRACED)
        if pid:
            assert os.WIFSTOPPED(status), f"the daemon ended ({status:#x}) before it stopped"
            return
        time.sleep(0.01)
    raise TimeoutError("the daemon never stopped")


def pause(proc: subprocess.Popen) -> None:
    """SIGSTOP the child `proc` and return once it has stopped (wait_stopped)."""
    os.kill(proc.pid, signal.SIGSTOP)
    wait_stopped(proc, 10)
