"""dtlab.lab.bench.fanout runs at a tiny size, so it cannot rot: every path ends with the
exact parameters, one row per (path, S) cold and the hot baseline beside them."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dtlab.lab.bench.fanout", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=180)


def test_tiny_fanout_benchmark(tiny_bench):
    r = tiny_bench("fanout")
    assert r.rc == 0, r
    assert "Out of bounds values : 0 OK" in r.stdout and "x hot" in r.stdout
    rows = r.data["rows"]
    assert [(row["path"], row["shards"], row["gap_ms"]) for row in rows] == [
        (path, s, gap) for path in ("shm", "fused") for s, gap in ((1, 0.0), (1, 1.0), (2, 1.0))]
    for row in rows:
        assert row["mode"] == "fanout" and row["bytes"] == 64 * 1024 and row["co_runners"] == 0
        assert row["round_p90_ms"] >= row["round_ms"] > 0
        assert row["rounds"] == 3 and row["wrong"] == 0
        assert row["gap_mb"] == (16.0 if row["gap_ms"] else 0.0)
        # the worker's CPU in its rounds (its gaps left out) and the shards' own: both work
        assert 0 < row["client_cpu_ms"] and 0 < row["server_cpu_ms"]


def test_co_runners_compute_beside_the_rounds_and_stop(tmp_path):
    out = tmp_path / "fanout.json"
    r = bench("--tiny", "--co-runners", "1", "--json", str(out))
    assert r.returncode == 0, r.stderr
    assert "1 co-runner(s)" in r.stdout
    rows = json.loads(out.read_text())["rows"]
    assert {row["co_runners"] for row in rows} == {1} and not any(row["wrong"] for row in rows)
    left = subprocess.run(["pgrep", "-f", "bench fanout --co-run"], capture_output=True)
    assert left.returncode == 1, left.stdout  # no co-runner outlives the benchmark


def test_bad_flags_are_named():
    r = bench("--shards", "0")
    assert r.returncode == 2 and "at least 1 shard" in r.stderr
    r = bench("--sizes-kb", "x")
    assert r.returncode == 2 and "comma lists of numbers" in r.stderr
    r = bench("--gap-mb", "-1")
    assert r.returncode == 2 and "no negative" in r.stderr
