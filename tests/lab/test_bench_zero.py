"""dtlab.lab.bench.zero runs at a tiny size, so it cannot rot; its measured bytes (memory
per rank and bytes sent per step) agree with the paper's formulas."""

from pathlib import Path

import pytest

pytestmark = pytest.mark.usefixtures("mpiexec")

ROOT = Path(__file__).resolve().parents[2]


def test_tiny_zero_benchmark(tiny_bench):
    r = tiny_bench("zero")
    assert r.rc == 0, r
    assert "# legend: vs DP" in r.stdout and "within 1% of the formulas): met" in r.stdout
    rows = r.data["rows"]
    assert [(row["n"], row["stage"]) for row in rows] == [(n, s) for n in (1, 2)
                                                          for s in (0, 1, 2, 3)]
    by = {(row["n"], row["stage"]): row for row in rows}
    psi = rows[0]["params"]
    for row in rows:
        assert row["step_ms"] > 0 and abs(row["memory_ratio"] - 1) <= 0.01
        # the same training (the clip's norm is summed in another order: last bits)
        assert row["final_loss"] == pytest.approx(by[(row["n"], 0)]["final_loss"], rel=1e-5)
    # fp32 Adam at dp 2: 16, 12, 10 and 8 bytes per parameter; one rank sends nothing
    assert [by[(2, s)]["total_bytes"] / psi for s in (0, 1, 2, 3)] == \
        pytest.approx([16, 12, 10, 8], abs=0.05)
    assert all(by[(1, s)]["sent_bytes"] == 0 for s in (0, 1, 2, 3))
    # two ranks: each sends half of 2 parameter volumes (stages 0-2), of 3 (stage 3)
    assert [by[(2, s)]["sent_bytes"] for s in (0, 1, 2, 3)] == [4 * psi] * 3 + [6 * psi]
    assert by[(2, 0)]["working_bytes"] == by[(2, 1)]["working_bytes"] == 0
    assert 0 < by[(2, 2)]["working_bytes"] <= by[(2, 3)]["working_bytes"]
