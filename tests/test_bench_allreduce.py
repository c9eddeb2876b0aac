"""scripts/bench_allreduce.py at a tiny size, so the benchmark never rots.

Checks the nccl-tests style table (one row per size, ring/naive/mpi groups
and the ratio columns), the JSON rows, busbw = algbw * 2(n-1)/n, and that
every algorithm got every element right.
"""

from __future__ import annotations

import json

import pytest
from mpirun import mpirun

pytestmark = pytest.mark.mpi


@pytest.mark.parametrize("n", [2, 3])
def test_tiny_benchmark_table_and_json(n, tmp_path):
    out = tmp_path / "bench.json"
    r = mpirun(n, "scripts/bench_allreduce.py", "--tiny", "--json", out, timeout=120)
    assert r.rc == 0, r
    lines = r.stdout.splitlines()
    header = next(line for line in lines if "#wrong" in line)
    for col in ("size", "count", "type", "time(us)", "algbw", "busbw", "#wrong"):
        assert col in header, header
    assert any("ring/mpi" in line for line in lines), r.stdout
    rows = [line.split() for line in lines if line and not line.startswith("#")]
    assert [int(row[0]) for row in rows] == [4096, 8192, 16384], r.stdout
    assert "# total #wrong: 0" in r.stdout, r.stdout

    data = json.loads(out.read_text())
    assert data["meta"]["n"] == n
    got = {(row["algo"], row["bytes"]) for row in data["rows"]}
    assert got == {(a, b) for a in ("ring", "naive", "mpi") for b in (4096, 8192, 16384)}
    for row in data["rows"]:
        assert row["n"] == n and row["wrong"] == 0 and row["time_us"] > 0, row
        assert row["algbw"] == pytest.approx(row["bytes"] / row["time_us"] / 1e3)
        assert row["busbw"] == pytest.approx(row["algbw"] * 2 * (n - 1) / n)
