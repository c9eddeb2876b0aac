"""dtlab.lab.bench.moe runs at a tiny size inside the suite, so it never rots: the
single-process rows and the expert-parallel all-to-all and layer rows (2 and 4 ranks)."""

from __future__ import annotations

import json
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


def test_tiny_run_prints_tables_and_writes_json(tmp_path):
    out = tmp_path / "bench.json"
    r = run_bench("--tiny", "--json", str(out))
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert any(line.startswith("# legend:") for line in lines)
    header = next(line for line in lines if "MoE ms" in line)
    for col in ("dense ms", "ratio", "floor", "router p50/95/99 ms", "dispatch p50/95/99 ms",
                "compute p50/95/99 ms", "combine p50/95/99 ms", "#wrong"):
        assert col in header
    assert lines[-1].endswith("0 OK")

    data = json.loads(out.read_text())
    assert data["header"]["device"] == "cpu" and data["header"]["floor"] == 1.5
    for row in data["rows"]:
        assert row["wrong"] == 0
        assert row["ratio"] == row["moe_step_s"] / row["dense_step_s"]
        # the dense baseline has the active expert parameters of the MoE layer (GELU
        # experts: but one output bias instead of k)
        extra = (row["top_k"] - 1) * row["d"] if row["kind"] == "gelu" else 0
        assert row["dense_params"] + extra == row["active_expert_params"]
        for phase in ("router", "dispatch", "compute", "combine"):
            t = row["phases_s"][phase]
            assert 0 < t["p50"] <= t["p95"] <= t["p99"]
    # the expert-parallel part: our all-to-all and MPI's on 2 and 4 ranks, the layer rows
    ep_header = next(line for line in lines if "ours us" in line)
    for col in ("bytes", "pairwise us", "MPI us", "busbw GB/s", "ours/MPI", "floor", "#wrong"):
        assert col in ep_header
    assert [r["ranks"] for r in data["alltoall"]] == [2, 4]
    for r in data["alltoall"]:
        assert r["wrong"] == 0 and r["bytes"] == 65536
        for k in ("ours", "pairwise", "mpi"):
            assert r[f"{k}_busbw"] == r["bytes"] / r[f"{k}_s"] * (r["ranks"] - 1) / r["ranks"] / 1e9
        assert r["ratio"] == r["ours_busbw"] / r["mpi_busbw"]
    assert [r["ranks"] for r in data["ep_layer"]] == [2, 4]
    for r in data["ep_layer"]:
        assert r["wrong"] == 0 and r["experts"] == 2 * r["ranks"] and r["chunks"] == 4
        assert r["overlap_speedup_ours"] == r["ours_chunks1_s"] / r["ours_chunksk_s"]
    assert data["header"]["ep_floor"] == 0.9

    balance = {b["method"]: b for b in data["balance"]}
    assert set(balance) == {"none", "aux", "bias"}
    assert balance["none"]["imbalance_last"] == balance["none"]["imbalance_first"] > 1.5
    for method in ("aux", "bias"):
        assert balance[method]["imbalance_last"] < balance[method]["imbalance_first"]


def test_bad_reps_is_an_error():
    r = run_bench("--tiny", "--reps", "0")
    assert r.returncode == 2
    assert "--reps" in r.stderr
    r = run_bench("--tiny", "--ep-ranks", "1")
    assert r.returncode == 2
    assert "--ep-ranks" in r.stderr
