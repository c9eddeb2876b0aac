"""scripts/lab/bench/model_gpu.py: without a GPU one line says so; its step code runs
under the CuPy-discipline check's strict namespace (CuPy's rules, NumPy's arithmetic) with
PyTorch on the CPU, which checks the code paths, not the figures (this is not a GPU run)."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dtlab.lab.bench import harness, model_gpu, model_torch
from dtlab.models import backend

ROOT = Path(__file__).resolve().parents[2]


def test_without_a_gpu_it_says_so_in_one_line():
    env = {**os.environ, "DTLAB_DEVICE": "gpu", "CUDA_VISIBLE_DEVICES": ""}
    env.pop(backend.ARRAY_MODULE_ENV, None)
    r = subprocess.run([sys.executable, "-m", "dtlab.lab.bench.model_gpu", "--tiny"],
                       capture_output=True, text=True, env=env, timeout=120, cwd=ROOT)
    assert r.returncode == 2
    assert r.stderr.count("\n") == 1
    assert r.stderr.startswith("dtlab-bench model_gpu: error: DTLAB_DEVICE=gpu but no GPU")


@pytest.mark.skipif(not model_torch.available(), reason="PyTorch not installed")
def test_each_setting_steps_under_the_strict_namespace(monkeypatch):
    monkeypatch.setenv(backend.ARRAY_MODULE_ENV, "support.strict_xp")
    try:
        for setting in ("fp32-tf32", "fp16", "bf16"):
            rows = model_gpu.one(setting, tiny=True, reps=1, warmup=1)
            assert [r["model"] for r in rows] == ["mlp", "transformer"]
            harness.check_rows(rows)  # the rows its --json writes: flat
            for r in rows:
                assert r["device"] == "CuPy-discipline check"
                assert math.isfinite(r["torch_ms"]) and r["torch_ms"] > 0
                assert (r["dtlab_ms"] is None) == (setting == "bf16")
    finally:
        monkeypatch.delenv(backend.ARRAY_MODULE_ENV)
        backend.select()
