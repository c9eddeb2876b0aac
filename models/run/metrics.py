"""JSON-lines metrics: one header object, then one object per step.

    {"type": "header", "topology": "sync", "config": {...}, "versions": {...},
     "hardware": {...}, "world": 4, "floor": 1.23, ...}
    {"step": 0, "loss": 2.77, "elapsed_s": 0.01, "lr": ..., ...}

The header records everything needed to reproduce and compare a run: the
full config, library versions, the machine, and (for synthetic data) the
known loss floor. Every line is flushed as it is written, so a crashed run
keeps what it measured.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import socket
from importlib import metadata

from dtlab.models import backend

_PACKAGES = ("dtlab", "numpy", "mpi4py", "mpich", "grpcio", "protobuf", "cupy-cuda12x")


def versions() -> dict:
    out = {"python": platform.python_version()}
    for pkg in _PACKAGES:
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            continue
    return out


def hardware() -> dict:
    return {
        "host": socket.gethostname(),
        "machine": platform.machine(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "device": backend.device_name(),
    }


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def run_header(session, topology: str, **extra) -> dict:
    """The header object for `session`'s run."""
    return {
        "type": "header",
        "topology": topology,
        "model": session.setup.model_name,
        "config": session.setup.as_dict(),
        "dataset": session.dataset.describe(),
        "floor": session.dataset.floor,
        "n_params": session.params.size,
        "world": session.world,
        "versions": versions(),
        "hardware": hardware(),
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **extra,
    }


class MetricsLog:
    """Appends JSON lines to `path` (nothing is written when path is empty)."""

    def __init__(self, path: str, header: dict, append: bool = False):
        self._f = None
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self._f = open(path, "a" if append else "w")  # noqa: SIM115 - closed in close()
            self.write(header)

    def write(self, record: dict) -> None:
        if self._f is not None:
            self._f.write(json.dumps(record, default=_jsonable) + "\n")
            self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def _jsonable(value):
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def read_metrics(path: str) -> tuple[dict, list[dict]]:
    """(header, step records) of a metrics file."""
    with open(path) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    headers = [r for r in lines if r.get("type") == "header"]
    if not headers:
        raise ValueError(f"{path}: no header line")
    return headers[-1], [r for r in lines if "step" in r]
