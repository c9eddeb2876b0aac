"""The CuPy-discipline check on the comparison: `dtlab-compare`'s tiny run (sync-ring and
async-bsp) with DTLAB_ARRAY_MODULE naming the strict namespace (tests/support/strict_xp.py:
CuPy's rules, NumPy's arithmetic) reaches every process it starts (MPI ranks, servers,
workers) and logs the losses of the same run on NumPy, bit for bit. This is not a GPU run.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from test_compare import ONCE, ROOT, TINY

from dtlab.models.run.metrics import read_metrics

pytestmark = pytest.mark.usefixtures("mpiexec")

STRICT = {"DTLAB_ARRAY_MODULE": "support.strict_xp", "PYTHONPATH": str(ROOT / "tests")}
RUNS = ("sync-ring.jsonl", "async-bsp.w0.jsonl", "async-bsp.w1.jsonl")


def test_the_tiny_comparison_under_cupy_rules_equals_numpy(tmp_path):
    procs = {name: subprocess.Popen(
        [sys.executable, "-m", "dtlab.lab.compare", *ONCE, *TINY, "--lr", "0.1", "--warmup",
         "0", "--steps", "6", "--runs", "sync-ring,async-bsp", "--out", str(tmp_path / name)],
        cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        env={**os.environ, **env}) for name, env in (("numpy", {}), ("strict", STRICT))}
    for proc in procs.values():
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
    for run in RUNS:
        header, records = read_metrics(str(tmp_path / "strict" / run))
        assert header["hardware"]["device"] == "CuPy-discipline check"
        assert len(records) == 6
        numpy_losses = [r["loss"] for r in read_metrics(str(tmp_path / "numpy" / run))[1]]
        assert [r["loss"] for r in records] == numpy_losses
