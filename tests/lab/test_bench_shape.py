"""Every registered benchmark (`dtlab-bench --list`) runs at its tiny size with --json and
writes the one shape: {"meta": the environment record, "rows": flat dicts}. The runs are
the ones each benchmark's own tests check further (tests/lab/conftest.py's tiny_bench)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
from support.bench_runs import SPECS, check_shape

from dtlab.lab.bench import harness
from dtlab.lab.bench.cli import NAMES

MPI = [name for name in NAMES if SPECS[name].mpi]
NO_MPI = [name for name in NAMES if not SPECS[name].mpi]


def test_every_benchmark_has_a_tiny_run():
    assert sorted(SPECS) == sorted(NAMES)


def check(name: str, tiny_bench) -> None:
    needs = SPECS[name].needs
    if needs and importlib.util.find_spec(needs) is None:
        pytest.skip(f"{needs} not built")
    r = tiny_bench(name)
    assert r.rc == 0, r
    check_shape(r.data, name)


@pytest.mark.parametrize("name", NO_MPI)
def test_tiny_run_writes_meta_and_flat_rows(name, tiny_bench):
    check(name, tiny_bench)


@pytest.mark.parametrize("name", MPI)
def test_tiny_mpi_run_writes_meta_and_flat_rows(name, tiny_bench, mpiexec):
    check(name, tiny_bench)


@pytest.mark.parametrize("old", [{"header": {}, "rows": []}, {"config": {}, "env": {}, "rows": []},
                                 [{"n": 1}]])
def test_the_one_reader_refuses_the_old_shapes(tmp_path, old):
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    with pytest.raises(ValueError, match=r"not a benchmark's JSON \{meta, rows\}"):
        harness.read(path)
    r = subprocess.run([sys.executable, "-m", "dtlab.lab.simulate", "--calibrate", "--bench",
                        str(path), "--calibration", str(tmp_path / "cal.json")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and f"--bench {path}: not a benchmark's JSON" in r.stderr


def test_rows_are_written_flat_or_not_at_all(tmp_path):
    path = tmp_path / "b.json"
    with pytest.raises(ValueError, match="row 1: 'phases' is not flat"):
        harness.write(path, "x", [{"a": 1}, {"a": 2, "phases": {"p50": 1.0}}])
    assert not path.exists()
    harness.write(path, "x", [{"a": 1, "shape": [2, 3], "config.d": 4}], reps=3)
    meta, rows = harness.read(path)
    assert meta["bench"] == "x" and meta["reps"] == 3 and "mpi" not in meta
    assert rows == [{"a": 1, "shape": [2, 3], "config.d": 4}]
    assert harness.nested(rows[0], "config") == {"d": 4}
