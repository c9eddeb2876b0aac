"""dtlab.lab.bench.threads runs at a tiny size inside the suite, so it never rots."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.usefixtures("mpiexec")

ROOT = Path(__file__).resolve().parents[2]


def test_tiny_run_times_every_example_both_ways(tmp_path):
    out = tmp_path / "threads.json"
    r = subprocess.run([sys.executable, "-m", "dtlab.lab.bench.threads", "--tiny", "--json",
                        str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "# wall: seconds from launch to exit" in r.stdout  # the legend
    rows = json.loads(out.read_text())["rows"]
    assert [row["example"] for row in rows] == ["sync-2", "sync-4", "async"]
    for row in rows:
        assert row["shared_s"] > 0 and row["all_cores_s"] > 0
        assert row["ratio"] == row["all_cores_s"] / row["shared_s"]
    table = [line for line in r.stdout.splitlines() if line and not line.startswith("#")]
    assert len(table) == len(rows)
