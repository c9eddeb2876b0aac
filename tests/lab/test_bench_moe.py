"""dtlab.lab.bench.moe runs at a tiny size inside the suite, so it never rots: the
single-process rows and the expert-parallel all-to-all and layer rows (4 ranks; 2 ranks by
dtlab.lab.bench.moe_ep on its own)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.usefixtures("mpiexec")

ROOT = Path(__file__).resolve().parents[2]


def run_bench(*args):
    env = {**os.environ, "DTLAB_DEVICE": "cpu"}
    return subprocess.run([sys.executable, "-m", "dtlab.lab.bench.moe", *args],
                          capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)


def table(data: dict, name: str) -> list[dict]:
    return [r for r in data["rows"] if r["table"] == name]


def test_tiny_run_prints_tables_and_writes_json(tiny_bench):
    r = tiny_bench("moe")  # its expert-parallel rows on 4 ranks
    assert r.rc == 0, r
    lines = r.stdout.splitlines()
    assert any(line.startswith("# legend:") for line in lines)
    header = next(line for line in lines if "MoE ms" in line)
    for col in ("dense ms", "ratio", "floor", "router p50/95/99 ms", "dispatch p50/95/99 ms",
                "compute p50/95/99 ms", "combine p50/95/99 ms", "#wrong"):
        assert col in header
    assert lines[-1].endswith("0 OK")

    data = r.data
    assert data["meta"]["device"] == "cpu" and data["meta"]["floor"] == 1.5
    assert data["meta"]["ep_floor"] == 0.9
    for row in table(data, "layer"):
        assert row["wrong"] == 0
        assert row["ratio"] == row["moe_step_s"] / row["dense_step_s"]
        # the dense baseline has the active expert parameters of the MoE layer (GELU
        # experts: but one output bias instead of k)
        extra = (row["top_k"] - 1) * row["d"] if row["kind"] == "gelu" else 0
        assert row["dense_params"] + extra == row["active_expert_params"]
        for phase in ("router", "dispatch", "compute", "combine"):
            assert 0 < row[f"{phase}_p50_s"] <= row[f"{phase}_p95_s"] <= row[f"{phase}_p99_s"]
    ep_header = next(line for line in lines if "ours us" in line)
    for col in ("bytes", "pairwise us", "MPI us", "busbw GB/s", "ours/MPI", "floor", "#wrong"):
        assert col in ep_header
    check_ep(data, 4)

    balance = {b["method"]: b for b in table(data, "balance")}
    assert set(balance) == {"none", "aux", "bias"}
    assert balance["none"]["imbalance_last"] == balance["none"]["imbalance_first"] > 1.5
    for method in ("aux", "bias"):
        assert balance[method]["imbalance_last"] < balance[method]["imbalance_first"]


def check_ep(data: dict, ranks: int) -> None:
    """The expert-parallel part: our all-to-all and MPI's on `ranks` ranks, the layer row."""
    assert [r["ranks"] for r in table(data, "alltoall")] == [ranks]
    for r in table(data, "alltoall"):
        assert r["wrong"] == 0 and r["bytes"] == 65536
        for k in ("ours", "pairwise", "mpi"):
            assert r[f"{k}_busbw"] == r["bytes"] / r[f"{k}_s"] * (r["ranks"] - 1) / r["ranks"] / 1e9
        assert r["ratio"] == r["ours_busbw"] / r["mpi_busbw"]
    assert [r["ranks"] for r in table(data, "ep_layer")] == [ranks]
    for r in table(data, "ep_layer"):
        assert r["wrong"] == 0 and r["experts"] == 2 * r["ranks"] and r["chunks"] == 4


def test_tiny_expert_parallel_run_on_two_ranks(tiny_bench):
    r = tiny_bench("moe_ep")
    assert r.rc == 0, r
    check_ep(r.data, 2)


def test_bad_reps_is_an_error():
    r = run_bench("--tiny", "--reps", "0")
    assert r.returncode == 2
    assert "--reps" in r.stderr
    r = run_bench("--tiny", "--ep-ranks", "1")
    assert r.returncode == 2
    assert "--ep-ranks" in r.stderr
