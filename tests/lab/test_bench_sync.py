"""dtlab.lab.bench.sync runs at a tiny size, so it cannot rot."""

import math
import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.usefixtures("mpiexec")

ROOT = Path(__file__).resolve().parents[2]


def test_tiny_sync_benchmark(tiny_bench):
    r = tiny_bench("sync")  # ranks 1, 2; ring and naive; fp32 and bf16 wires; 6 steps
    assert r.rc == 0, r
    assert "samples/s" in r.stdout and "wait %" in r.stdout
    assert "# legend: threads: BLAS threads per rank" in r.stdout
    rows = r.data["rows"]
    assert [(row["algo"], row["wire"], row["n"]) for row in rows] == [
        (algo, wire, n) for algo in ("ring", "naive") for wire in ("fp32", "bf16") for n in (1, 2)]
    by = {(row["algo"], row["wire"], row["n"]): row for row in rows}
    for algo in ("ring", "naive"):  # two ranks move half the bytes on a bf16 wire
        assert by[(algo, "bf16", 2)]["wire_mb"] * 2 == by[(algo, "fp32", 2)]["wire_mb"]
        assert by[(algo, "fp32", 2)]["loss_vs_fp32"] == 0.0
    cores = len(os.sched_getaffinity(0))
    for row in rows:
        assert row["threads"] == max(1, cores // row["n"])  # the trainer shares the cores
        assert math.isfinite(row["final_loss"])
        assert row["samples_per_step"] == 8 * row["n"] and row["samples_per_s"] > 0
        assert 0 <= row["comm_frac"] <= 1 and row["speedup"] > 0
    assert {row["speedup"] for row in rows if row["n"] == 1} == {1.0}
