"""The parameter-server benchmark runs at a tiny size, prints its table and writes its JSON."""

from __future__ import annotations

import json
import subprocess
import sys

from support.bench_runs import check_shape
from support.pserver_util import ONE_BLAS_THREAD, ROOT

from dtlab.models.precision import UNIT_ROUNDOFF

KEYS = {"op", "bytes", "workers", "shards", "optimizer", "gbps", "ceiling_gbps", "apply_ms"}


def test_tiny_benchmark(tiny_bench):
    r = tiny_bench("pserver")
    assert r.rc == 0, r
    lines = r.stdout.splitlines()
    assert lines[0].startswith("# legend: ") and "xport" in lines[0]
    assert lines[1].split()[:4] == ["#", "op", "size", "W"] and "ceil" in lines[1]
    rows = r.data["rows"]
    assert len(lines) == 2 + len(rows)
    ops = {(row["op"], row["workers"], row["optimizer"]) for row in rows}
    assert ops == {("push", 1, "sgd"), ("push", 2, "sgd"), ("pull", 1, "sgd"), ("pull", 2, "sgd"),
                   ("push", 1, "adam"), ("push", 2, "adam")}
    for row in rows:
        assert KEYS <= row.keys()
        assert row["gbps"] > 0 and row["ceiling_gbps"] > 0
        for server_time in ("receive_ms", "check_ms", "apply_ms"):
            assert (row[server_time] is None) == (row["op"] == "pull")


PATHS = {"calls", "session", "fused", "shm", "generated", "fp16", "bf16"}
FUSED = {"fused", "shm", "fp16", "bf16"}  # one push_pull per round


def test_tiny_rounds_benchmark(tmp_path):
    """Two launches, each in its own processes, and the table of their medians alone."""
    out = tmp_path / "rounds.json"
    r = subprocess.run([sys.executable, "-m", "dtlab.lab.bench.pserver", "--tiny",
                        "--mode", "rounds", "--launches", "2", "--quiet", "--json", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=240, env=ONE_BLAS_THREAD)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0] == "# median of 2 launches"
    assert lines[1].startswith("# legend: size:") and "wrong" in lines[1]
    assert lines[2].split()[:3] == ["#", "size", "path"]
    data = json.loads(out.read_text())
    check_shape(data, "pserver")
    rows = data["rows"]
    assert len(lines) == 3 + len(rows) and all(row["launches"] == 2 for row in rows)
    assert {(row["bytes"], row["path"]) for row in rows} == {
        (kb * 1024, path) for kb in (64, 256) for path in PATHS}
    for row in rows:
        assert row["wrong"] == 0  # every path's parameters exact, shm used where asked
        assert row["rounds_per_s"] > 0 and row["x_calls"] > 0
        for codec in ("codec_pull", "codec_push", "codec_round"):
            assert (row[codec] is None) == (row["path"] != "session")
        fused = row["path"] in FUSED  # one push_pull per round: no pull, push apart
        assert (row["pull_ms"] is None) == (row["push_ms"] is None) == fused
    by = {(row["bytes"], row["path"]): row for row in rows}
    for kb in (64, 256):  # a half wire moves half the bytes, rounded within its unit roundoff
        full = by[kb * 1024, "fused"]
        assert full["wire_bytes_per_round"] == 2 * kb * 1024 and full["error"] == 0
        for half in ("fp16", "bf16"):
            row = by[kb * 1024, half]
            assert 2 * row["wire_bytes_per_round"] == full["wire_bytes_per_round"]
            assert row["error"] <= UNIT_ROUNDOFF[half] and row["x_base"] > 0
