"""dtlab.lab.bench.model runs at a tiny size inside the suite, so it never rots: with its
PyTorch comparison where PyTorch is installed, and saying so where it is not."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

from support.bench_runs import check_shape

ROOT = Path(__file__).resolve().parents[2]
HAS_TORCH = importlib.util.find_spec("torch") is not None
# the benchmark's main in a process where `import torch` fails, as where it is not installed
WITHOUT_TORCH = ("import sys; sys.modules['torch'] = None; "
                 "from dtlab.lab.bench.model import main; sys.exit(main(sys.argv[1:]))")


def run_bench(*args, torch=True):
    env = {**os.environ, "DTLAB_DEVICE": "cpu"}
    cmd = ["-m", "dtlab.lab.bench.model"] if torch else ["-c", WITHOUT_TORCH]
    return subprocess.run([sys.executable, *cmd, *args], capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=180)


def table(lines: list[str]) -> list[str]:
    """The main table's rows: the lines before any per-layer table that are not comments."""
    end = next((i for i, line in enumerate(lines) if line.startswith("# per layer")),
               len(lines))
    return [line for line in lines[:end] if line and not line.startswith("#")]


def check_rows(lines: list[str], rows: list[dict]) -> None:
    header = next(line for line in lines if "step(ms)" in line)
    for col in ("GFLOP/s", "mm GFLOP/s", "ratio", "act MB", "est MB", "#wrong", "torch(ms)",
                "torch/dtlab"):
        assert col in header
    assert lines[-1].endswith("0 OK")
    assert [r["model"] for r in rows] == ["mlp"] * 3 + ["transformer"] * 4
    assert len({(r["model"], r["size"]) for r in rows}) == 7
    assert len(table(lines)) == len(rows)
    for row in rows:
        assert row["wrong"] == 0
        assert row["act_bytes_measured"] == row["act_bytes_estimated"] > 0
        assert 0 < row["step_s_best"] <= row["step_s_median"] and row["matmul_gflops"] > 0
        assert min(row["step_s_each"]) == row["step_s_best"]  # every timed step, in order
        assert row["gflops"] == row["flops_step"] / row["step_s_best"] / 1e9
        assert row["ratio"] == row["gflops"] / row["matmul_gflops"]
        assert len(row["matmul_shape"]) == 3


def steps(data: dict) -> list[dict]:
    return [r for r in data["rows"] if r["table"] == "step"]


def test_tiny_run_prints_table_and_writes_json(tiny_bench):
    r = tiny_bench("model")
    assert r.rc == 0, r
    lines = r.stdout.splitlines()
    data = r.data
    check_rows(lines, steps(data))
    header = data["meta"]
    assert header["device"] == "cpu"
    assert header["blas"]["libraries"], "threadpoolctl names the BLAS NumPy runs"
    assert "NumPy's BLAS: " in lines[0]
    if not HAS_TORCH:
        assert header["torch"] is None and "PyTorch not installed" in r.stdout
        return
    assert header["torch"] and "# PyTorch " in r.stdout
    def layers_of(row: dict) -> list[dict]:
        return [x for x in data["rows"] if x["table"] == "layer"
                and (x["model"], x["size"]) == (row["model"], row["size"])]

    for row in steps(data):
        # the twin computes the same loss from the same parameters
        assert abs(row["torch_first_loss"] - row["first_loss"]) <= 1e-4 * row["first_loss"]
        assert row["torch_over_dtlab"] == row["torch_step_s_median"] / row["step_s_median"]
        assert len(row["torch_step_s_each"]) == len(row["step_s_each"])
        layers = [x["layer"] for x in layers_of(row)]
        assert layers[0].startswith("Linear 8->" if row["model"] == "mlp" else "Embedding")
        assert layers[-2] == "cross-entropy" and layers[-1].startswith("AdamW")
        for x in layers_of(row):
            assert x["count"] >= 1 and x["dtlab_s"] > 0 and x["torch_s"] > 0
        # one line per layer and one for their sum, after the main table
        after = lines[next(i for i, line in enumerate(lines) if line.startswith("# per layer")):]
        size_lines = [line for line in after if line.split()[:2] == [row["model"], row["size"]]]
        assert len(size_lines) == len(layers) + 1
    transformer = {x["layer"] for x in layers_of(steps(data)[3])}
    assert {"attention core", "LayerNorm", "GELU", "Linear 16->48"} <= transformer


def test_without_pytorch_it_says_so_and_keeps_its_baseline(tmp_path):
    out = tmp_path / "bench.json"
    r = run_bench("--tiny", "--json", str(out), torch=False)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "# PyTorch not installed: no comparison with PyTorch, the matmul baseline only" \
        in r.stdout
    data = json.loads(out.read_text())
    check_shape(data, "model")
    check_rows(r.stdout.splitlines(), steps(data))
    assert data["meta"]["torch"] is None
    assert not any("torch_step_s_median" in row or row["table"] != "step"
                   for row in data["rows"])
    assert "# per layer" not in r.stdout


def test_bad_reps_is_an_error():
    r = run_bench("--tiny", "--reps", "-1")
    assert r.returncode == 2
    assert "--reps" in r.stderr
