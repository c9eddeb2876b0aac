"""dtlab.lab.bench.threads runs at a tiny size inside the suite, so it never rots."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = pytest.mark.usefixtures("mpiexec")

ROOT = Path(__file__).resolve().parents[2]


def test_tiny_run_times_every_example_both_ways(tiny_bench):
    r = tiny_bench("threads")
    assert r.rc == 0, r
    assert "# legend: wall: seconds from launch to exit" in r.stdout
    rows = r.data["rows"]
    assert [row["example"] for row in rows] == ["sync-2", "async"]  # --tiny spares sync-4
    for row in rows:
        assert row["shared_s"] > 0 and row["all_cores_s"] > 0
        assert row["ratio"] == row["all_cores_s"] / row["shared_s"]
    table = [line for line in r.stdout.splitlines() if line and not line.startswith("#")]
    assert len(table) == len(rows)
