"""dtlab.lab.bench.model runs at a tiny size inside the suite, so it never rots."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_bench(*args):
    env = {**os.environ, "DTLAB_DEVICE": "cpu"}
    return subprocess.run([sys.executable, "-m", "dtlab.lab.bench.model", *args],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)


def test_tiny_run_prints_table_and_writes_json(tmp_path):
    out = tmp_path / "bench.json"
    r = run_bench("--tiny", "--json", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    header = next(line for line in lines if "step(ms)" in line)
    for col in ("GFLOP/s", "mm GFLOP/s", "ratio", "act MB", "est MB", "#wrong"):
        assert col in header
    assert lines[-1].endswith("0 OK")

    data = json.loads(out.read_text())
    assert data["header"]["device"] == "cpu"
    rows = data["rows"]
    assert [r["model"] for r in rows] == ["mlp"] * 3 + ["transformer"] * 4
    assert len({(r["model"], r["size"]) for r in rows}) == 7
    table = [line for line in lines if line and not line.startswith("#")]
    assert len(table) == len(rows)
    for row in rows:
        assert row["wrong"] == 0
        assert row["act_bytes_measured"] == row["act_bytes_estimated"] > 0
        assert row["step_s_best"] > 0 and row["matmul_gflops"] > 0
        assert row["gflops"] == row["flops_step"] / row["step_s_best"] / 1e9
        assert row["ratio"] == row["gflops"] / row["matmul_gflops"]
        assert len(row["matmul_shape"]) == 3


def test_bad_reps_is_an_error():
    r = run_bench("--tiny", "--reps", "-1")
    assert r.returncode == 2
    assert "--reps" in r.stderr
