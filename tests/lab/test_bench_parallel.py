"""dtlab.lab.bench.parallel runs at a tiny size, so it cannot rot; its formula columns
agree with what the ranks measured (bytes exactly, memory within 5%)."""

import math
from pathlib import Path

import pytest

from dtlab.models.schedule import bubble_formula

pytestmark = pytest.mark.usefixtures("mpiexec")

ROOT = Path(__file__).resolve().parents[2]
KEYS = ("tp", "pp", "microbatches", "schedule", "step_ms", "comm_bytes", "comm_bytes_formula",
        "bubble", "bubble_formula", "bubble_expected", "bubble_p2p", "param_bytes_per_rank",
        "state_bytes_per_rank", "state_bytes_estimate", "memory_ratio",
        "activation_bytes_per_rank", "activation_bytes_estimate", "activation_ratio")


def test_tiny_parallel_benchmark(tiny_bench):
    r = tiny_bench("parallel")
    assert r.rc == 0, r
    assert "# legend: vs 1x1" in r.stdout and "# floors (memory within 5%" in r.stdout
    assert "(bubbles not judged at --tiny)): met" in r.stdout
    data = r.data
    assert data["meta"]["cores"] >= 1 and data["meta"]["versions"]["numpy"]
    rows = data["rows"]
    cases = {(row["tp"], row["pp"], row["schedule"], row["microbatches"]) for row in rows}
    assert cases == {(1, 1, "-", 2), (1, 1, "-", 4), (2, 1, "-", 2), (2, 1, "-", 4)} | {
        (tp, 2, s, m) for tp in (1, 2) for s in ("gpipe", "1f1b", "interleaved", "zb-h1",
                                                 "zb-v", "dualpipev")
        for m in (2, 4) if s != "dualpipev" or m >= 4}
    for row in rows:
        assert all(k in row for k in KEYS), sorted(set(KEYS) - set(row))
        assert row["step_ms"] > 0 and math.isfinite(row["step_ms"])
        # the ranks' own counts of what they sent against the config's formula
        assert row["comm_bytes_p2p"] == row["comm_bytes_p2p_formula"]
        assert row["comm_bytes_tp"] == row["comm_bytes_tp_formula"]
        assert row["comm_bytes"] == row["comm_bytes_formula"]
        assert (row["comm_bytes_p2p"] > 0) == (row["pp"] > 1)
        assert (row["comm_bytes_tp"] > 0) == (row["tp"] > 1)
        assert abs(row["memory_ratio"] - 1) <= 0.05 and abs(row["activation_ratio"] - 1) <= 0.05
        assert row["param_bytes_per_rank"] < row["state_bytes_per_rank"]
        if row["pp"] > 1:
            assert row["chunks"] == (1 if row["schedule"] in ("gpipe", "1f1b", "zb-h1") else 2)
            assert row["bubble_formula"] == bubble_formula(row["schedule"], row["pp"],
                                                           row["microbatches"], v=row["chunks"])
            assert 0 <= row["bubble"] < 1 and 0 <= row["bubble_expected"] < 1
            # receives only lengthen the replay; the per-micro-batch costs beside it
            assert row["bubble_expected"] <= row["bubble_p2p"] + 1e-12 < 1
            assert row["p2p_us"] > 0 and row["send_us"] > 0 and row["overhead_us_per_op"] > 0
        else:
            assert row["bubble"] == row["bubble_formula"] == 0
    # a split rank holds less than the whole model
    whole = {row["microbatches"]: row["state_bytes_per_rank"] for row in rows
             if row["tp"] == row["pp"] == 1}
    assert all(row["state_bytes_per_rank"] < whole[row["microbatches"]] for row in rows
               if row["tp"] * row["pp"] > 1)
