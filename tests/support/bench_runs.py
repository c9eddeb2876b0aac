"""Every registered benchmark at its tiny size, as the suite runs it, and the one JSON
shape they all write.

    from support.bench_runs import SPECS, run, check_shape

    r = run("flight", folder)     # `mpiexec -n 2 python -m dtlab.lab.bench.flight --tiny
    assert r.rc == 0, r           #  --json folder/flight.json`
    check_shape(r.data, "flight")

tests/lab/conftest.py's `tiny_bench` fixture runs each benchmark once a session, so the
shape test (tests/lab/test_bench_shape.py) and a benchmark's own checks read one run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from dtlab.models.run.threads import USER_VARS
from support.mpirun import ROOT, mpirun

CPU = {"DTLAB_DEVICE": "cpu"}
ONE_BLAS_THREAD = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}


@dataclass(frozen=True)
class Spec:
    """How the suite runs a benchmark at its tiny size."""

    args: tuple[str, ...] = ("--tiny",)
    ranks: int = 0  # under `mpiexec -n ranks` (0: a plain process)
    mpi: bool = False  # it starts MPI (the test asks for the mpiexec fixture)
    env: dict = field(default_factory=dict)  # added to the environment
    drop_user_vars: bool = False  # thread variables left out (the trainers share the cores)
    needs: str = ""  # a module without which the benchmark cannot run (skipped)
    timeout: float = 240


SPECS = {
    "allreduce": Spec(ranks=2, mpi=True, timeout=120),
    "fanout": Spec(timeout=180),
    "flight": Spec(ranks=2, mpi=True, timeout=120),
    "model": Spec(env=CPU, timeout=180),
    # 4 ranks here; moe_ep's own run is the 2-rank launch
    "moe": Spec(args=("--tiny", "--ep-ranks", "4"), mpi=True, env=CPU, timeout=180),
    "moe_ep": Spec(ranks=2, mpi=True, timeout=120),
    "optim": Spec(needs="dtlab.models._fused", timeout=120),
    "parallel": Spec(mpi=True, drop_user_vars=True, timeout=120),
    "pipedream": Spec(mpi=True, drop_user_vars=True, timeout=120),
    "precision": Spec(env=CPU, timeout=120),
    "pserver": Spec(env=ONE_BLAS_THREAD),
    "replication": Spec(env=ONE_BLAS_THREAD),
    "ring_steps": Spec(ranks=2, mpi=True, timeout=120),
    "sync": Spec(args=("--tiny", "--ranks", "1,2", "--allreduce", "ring,naive", "--wire",
                       "fp32,bf16", "--steps", "6"), mpi=True, drop_user_vars=True, timeout=180),
    "threads": Spec(mpi=True, timeout=300),
    "together": Spec(args=("--tiny", "--role", "rank"), ranks=2, mpi=True, timeout=120),
    "zero": Spec(mpi=True, drop_user_vars=True, timeout=120),
}


@dataclass
class BenchRun:
    cmd: list[str]
    rc: int
    stdout: str
    stderr: str
    path: Path  # its --json

    @property
    def data(self) -> dict:
        return json.loads(self.path.read_text())

    def __str__(self) -> str:
        return (f"{' '.join(self.cmd)}\nrc={self.rc}\n--- stdout (tail) ---\n"
                f"{self.stdout[-4000:]}\n--- stderr (tail) ---\n{self.stderr[-4000:]}")


def run(name: str, folder: Path, *extra: str, ranks: int | None = None) -> BenchRun:
    """Benchmark `name` as SPECS says (its args, then `extra`; `ranks` instead of its own),
    its JSON at folder/NAME.json."""
    spec = SPECS[name]
    path = folder / f"{name}.json"
    args = ["-m", f"dtlab.lab.bench.{name}", *spec.args, *extra, "--json", str(path)]
    env = {k: v for k, v in os.environ.items()
           if not (spec.drop_user_vars and k in USER_VARS)} | spec.env
    n = spec.ranks if ranks is None else ranks
    if n:
        r = mpirun(n, *args, timeout=spec.timeout, env=spec.env)
        return BenchRun(r.cmd, r.rc, r.stdout, r.stderr, path)
    cmd = [sys.executable, *args]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env,
                       timeout=spec.timeout)
    return BenchRun(cmd, r.returncode, r.stdout, r.stderr, path)


SCALARS = (str, int, float, bool, type(None))
# the environment record every benchmark's meta starts with
META = ("bench", "command", "date", "host", "cpu", "cores", "python", "numpy")


def check_shape(data: dict, name: str, mpi: bool | None = None) -> None:
    """{"meta": the environment record (+ the MPI library where MPI is used), "rows": a
    non-empty list of flat dicts: values numbers, strings, booleans, None or lists of those}."""
    assert set(data) == {"meta", "rows"}, sorted(data)
    meta, rows = data["meta"], data["rows"]
    missing = [k for k in META if not meta.get(k)]
    assert not missing, f"meta lacks {missing}"
    assert meta["bench"] == name and isinstance(meta["command"], str)
    assert isinstance(meta["cores"], int) and meta["cores"] >= 1
    if SPECS[name].mpi if mpi is None else mpi:
        assert meta.get("mpi"), "meta lacks the MPI library's version"
    assert isinstance(rows, list) and rows
    for row in rows:
        assert isinstance(row, dict) and row
        for key, value in row.items():
            flat = isinstance(value, SCALARS) or (
                isinstance(value, list) and all(isinstance(v, SCALARS) for v in value))
            assert flat, f"row {row} is not flat at {key!r}"
