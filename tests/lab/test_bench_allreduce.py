"""dtlab.lab.bench.allreduce at a tiny size, so the benchmark never rots.

One launch: the nccl-tests style table (one row per size, ring/naive/mpi
groups and the ratio columns), the JSON rows, busbw = algbw * 2(n-1)/n, and
that every algorithm got every element right. Several launches
(--launches): the median table per world size, its legend and floor lines,
and JSON that keeps every launch and whose medians are the launches' medians.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys

import pytest
from support.bench_runs import check_shape, run
from support.mpirun import ROOT, mpirun

pytestmark = pytest.mark.usefixtures("mpiexec")
SIZES = [4096, 8192, 16384]


@pytest.mark.parametrize("n", [2, 3])
def test_tiny_benchmark_table_and_json(n, tmp_path, tiny_bench):
    r = tiny_bench("allreduce") if n == 2 else run("allreduce", tmp_path, ranks=n)
    assert r.rc == 0, r
    lines = r.stdout.splitlines()
    assert any(line.startswith("# legend: ") and "via" in line for line in lines), r.stdout
    header = next(line for line in lines if "#wrong" in line and "legend" not in line)
    for col in ("size", "count", "type", "time(us)", "algbw", "busbw", "#wrong", "via"):
        assert col in header, header
    assert any("ring/mpi" in line for line in lines), r.stdout
    rows = [line.split() for line in lines if line and not line.startswith("#")]
    assert [int(row[0]) for row in rows] == SIZES, r.stdout
    assert "# total #wrong: 0" in r.stdout, r.stdout

    data = r.data
    check_shape(data, "allreduce")
    assert data["meta"]["n"] == n
    got = {(row["algo"], row["bytes"]) for row in data["rows"]}
    assert got == {(a, b) for a in ("ring", "naive", "mpi") for b in SIZES}
    for row in data["rows"]:
        assert row["n"] == n and row["wrong"] == 0 and row["time_us"] > 0, row
        assert row["algbw"] == pytest.approx(row["bytes"] / row["time_us"] / 1e3)
        assert row["busbw"] == pytest.approx(row["algbw"] * 2 * (n - 1) / n)
        assert row["via"] in (("rd", "hd", "ring", "shm1", "shm2") if row["algo"] == "ring"
                              else (row["algo"],)), row


def test_launches_print_medians_and_keep_every_launch(tmp_path):
    out = tmp_path / "medians.json"
    cmd = [sys.executable, "-m", "dtlab.lab.bench.allreduce", "--tiny", "--launches", "3",
           "--ranks", "2,3", "--algos", "ring,mpi", "--json", str(out)]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    for n in (2, 3):
        assert f"# n={n}: median over 3 launches" in r.stdout, r.stdout
    assert r.stdout.count("# legend:") == 2 and r.stdout.count("# floors") == 2, r.stdout
    rows = [line.split() for line in r.stdout.splitlines() if line and not line.startswith("#")]
    assert [int(row[0]) for row in rows] == SIZES * 2, r.stdout
    assert all(row[-1] == "0" for row in rows), r.stdout  # #wrong

    data = json.loads(out.read_text())
    check_shape(data, "allreduce")
    assert [len(data["meta"]["launch_meta"][n]) for n in ("2", "3")] == [3, 3]
    for n in (2, 3):
        launches = [[r for r in data["rows"] if r["table"] == "launch" and r["n"] == n
                     and r["launch"] == k] for k in range(3)]
        medians = [r for r in data["rows"] if r["table"] == "median" and r["n"] == n]
        assert all(len(rows) == len(medians) == 2 * len(SIZES) for rows in launches)
        for i, med in enumerate(medians):
            each = [rows[i]["time_us"] for rows in launches]
            assert med["time_us"] == statistics.median(each) and med["time_us_launches"] == each
            assert {rows[i]["algo"] for rows in launches} == {med["algo"]}
        assert {m["algo"] for m in medians} == {"ring", "mpi"}


def test_launches_refuse_to_run_under_mpiexec():
    r = mpirun(2, "-m", "dtlab.lab.bench.allreduce", "--tiny", "--launches", "2", wrap=False,
               timeout=60)
    assert r.rc != 0 and "start it without mpiexec" in r.stderr, r
