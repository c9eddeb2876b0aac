"""dtlab.lab.bench.optim runs at a tiny size inside the suite, so it never rots."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_bench(*args):
    env = dict(os.environ)
    return subprocess.run([sys.executable, "-m", "dtlab.lab.bench.optim", *args],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)


def test_tiny_run_prints_table_and_writes_json(tiny_bench):
    pytest.importorskip("dtlab.models._fused")
    r = tiny_bench("optim")
    assert r.rc == 0, r
    lines = r.stdout.splitlines()
    header = next(line for line in lines if "step(ms)" in line)
    for col in ("optimizer", "thr", "path", "traffic GB/s", "p+=g GB/s", "ratio", "#wrong"):
        assert col in header
    assert lines[-1] == "# 12 rows, 0 wrong: OK"
    rows = r.data["rows"]
    table = [line for line in lines if line and not line.startswith("#")]
    assert len(table) == len(rows) == 12
    assert {(r["optimizer"], r["threads"], r["path"]) for r in rows} == {
        (o, t, p) for o in ("sgd", "momentum", "adam") for t in (1, 2) for p in ("C", "numpy")}
    for row in rows:
        assert row["wrong"] == 0
        assert row["step_s"] > 0 and row["traffic_gbps"] > 0 and row["add_gbps"] > 0


def test_bad_flag_names_it():
    r = run_bench("--optimizers", "sgd,lamb")
    assert r.returncode != 0
    assert "--optimizers: unknown lamb" in r.stderr


def test_bad_size_list_names_the_flag():
    r = run_bench("--sizes-mb", "1,0")
    assert r.returncode != 0
    assert "--sizes-mb must be a comma-separated list of positive numbers (got '1,0')" in r.stderr
