"""dtlab.lab.bench.precision runs at a tiny size inside the suite, so it never rots."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_tiny_run_prints_the_precision_table_and_writes_json(tiny_bench):
    r = tiny_bench("precision")
    assert r.rc == 0, r
    lines = r.stdout.splitlines()
    header = next(line for line in lines if "step(ms)" in line)
    for col in ("x fp32", "act MB", "grad MB", "opt MB", "loss", "d fp32", "gap", "#wrong"):
        assert col in header
    assert lines[-1].endswith("0 OK")
    rows = r.data["rows"]
    assert [(r["model"], r["precision"]) for r in rows] == [
        (m, p) for m in ("mlp", "transformer") for p in ("fp32", "fp16", "bf16")]
    for fp32, *halves in (rows[:3], rows[3:]):
        for row in halves:  # about half the bytes where half precision stores them
            assert row["act_bytes"] < 0.55 * fp32["act_bytes"]  # token ids stay int64
            assert 2 * row["grad_bytes"] == fp32["grad_bytes"] == row["f32_grad_bytes"]
            assert row["opt_bytes"] == fp32["opt_bytes"] and row["wrong"] == 0
            assert abs(row["d_fp32"]) < 0.05
