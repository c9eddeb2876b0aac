"""dtlab.lab.bench.flight at a tiny size, so the benchmark never rots.

One launch: the nccl-tests style table (one row per size, its legend), the JSON rows whose
figures are the medians of their repetitions, overhead = on - off and ratio = on / off
(off timed on a communicator with the recorder off), every element of the verification
call right, and the recorder's pair costing something but far less than the all-reduce
it records. The benchmark's --help as dtlab-bench shows it.
"""

from __future__ import annotations

import statistics
import subprocess
import sys

import pytest
from support.mpirun import ROOT

pytestmark = pytest.mark.usefixtures("mpiexec")
SIZES = [4096, 8192, 16384]


def test_tiny_benchmark_table_and_json(tiny_bench):
    r = tiny_bench("flight")
    assert r.rc == 0, r
    lines = r.stdout.splitlines()
    assert any(line.startswith("# legend: ") and "overhead = on - off" in line
               for line in lines), r.stdout
    header = next(line for line in lines if "#wrong" in line and "legend" not in line)
    for col in ("size", "count", "type", "via", "off(us)", "on(us)", "overhead(us)", "rec(us)",
                "ratio"):
        assert col in header, header
    rows = [line.split() for line in lines if line and not line.startswith("#")]
    assert [int(row[0]) for row in rows] == SIZES, r.stdout
    assert "# total #wrong: 0" in r.stdout, r.stdout

    data = r.data
    assert data["meta"]["n"] == 2 and data["meta"]["reps"] == 3
    assert [row["bytes"] for row in data["rows"]] == SIZES
    for row, printed in zip(data["rows"], rows, strict=True):
        assert row["wrong"] == 0 and row["count"] * 4 == row["bytes"], row
        assert len(row["time_on_us_reps"]) == len(row["time_off_us_reps"]) == 3
        assert len(row["recorder_us_reps"]) == 3
        assert row["time_on_us"] == statistics.median(row["time_on_us_reps"])
        assert row["time_off_us"] == statistics.median(row["time_off_us_reps"])
        assert row["recorder_us"] == statistics.median(row["recorder_us_reps"])
        assert row["overhead_us"] == pytest.approx(row["time_on_us"] - row["time_off_us"])
        assert row["ratio"] == pytest.approx(row["time_on_us"] / row["time_off_us"])
        assert 0 < row["recorder_us"] < row["time_on_us"] / 2, row
        assert row["via"] in ("rd", "hd", "ring", "shm1", "shm2"), row
        assert float(printed[5]) == pytest.approx(row["time_on_us"], abs=0.01), printed


def test_listed_and_its_flags_have_help():
    r = subprocess.run([sys.executable, "-m", "dtlab.lab.bench", "--list"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "flight" in r.stdout, r.stdout + r.stderr
    r = subprocess.run([sys.executable, "-m", "dtlab.lab.bench", "flight", "--help"], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    for flag in ("--min-bytes", "--max-bytes", "--reps", "--pairs", "--warmup", "--tiny",
                 "--json"):
        assert flag in r.stdout, r.stdout
    r = subprocess.run([sys.executable, "-m", "dtlab.lab.bench", "flight", "--reps", "0"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--reps and --pairs must be >= 1" in r.stderr, r.stderr
