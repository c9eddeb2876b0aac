"""The models on CuPy agree with their NumPy twins.

Tests marked `gpu` skip unless CuPy sees a GPU; scripts/gpu_check runs them
with DTLAB_DEVICE=gpu. The device-error tests run everywhere: a subprocess
with DTLAB_DEVICE=gpu and no visible GPU (CUDA_VISIBLE_DEVICES="") must fail
with models.backend.DeviceError and a message that says what to do.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dtlab.models import backend
from dtlab.models.cost import estimate
from dtlab.models.memory import context_bytes
from dtlab.models.mlp import MLPConfig
from dtlab.models.model import Replica
from dtlab.models.transformer import TransformerConfig
from dtlab.models.zoo import build_model

ROOT = Path(__file__).resolve().parents[2]

TINY_T = dict(vocab=13, seq_len=6, d_model=16, n_heads=2, n_layers=2, d_ff=24)
MODELS = [
    ("mlp", MLPConfig(d_in=5, d_hidden=16, n_layers=2, n_classes=4), 8),
    ("mlp", MLPConfig(d_in=5, d_hidden=16, n_layers=2, n_classes=4, activation="relu"), 8),
    ("transformer", TransformerConfig(**TINY_T), 3),
    ("transformer", TransformerConfig(ffn="swiglu", norm="rmsnorm", **TINY_T), 3),
    ("transformer", TransformerConfig(recompute=True, **TINY_T), 3),
    ("transformer", TransformerConfig(moe_experts=4, moe_top_k=2, moe_dropless=True, **TINY_T), 3),
]
IDS = ["mlp-gelu", "mlp-relu", "gpt", "swiglu-rmsnorm", "recompute", "moe"]


def no_gpu_env(**extra):
    return {**os.environ, "PYTHONPATH": str(ROOT), "DTLAB_DEVICE": "gpu",
            "CUDA_VISIBLE_DEVICES": "", **extra}


def test_gpu_without_gpu_raises_device_error():
    code = "from dtlab.models import backend; backend.xp()"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=no_gpu_env(), timeout=120)
    assert r.returncode != 0
    assert "dtlab.models.backend.DeviceError: DTLAB_DEVICE=gpu but no GPU is usable" in r.stderr
    assert "cupy-cuda12x" in r.stderr


def test_bench_without_gpu_is_a_clean_error():
    r = subprocess.run([sys.executable, "-m", "dtlab.lab.bench.model", "--tiny"],
                       capture_output=True, text=True, env=no_gpu_env(), timeout=120)
    assert r.returncode == 2
    assert "error: DTLAB_DEVICE=gpu but no GPU is usable" in r.stderr
    assert "Traceback" not in r.stderr


def test_unknown_device_is_rejected():
    code = "from dtlab.models import backend; backend.xp()"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=no_gpu_env(DTLAB_DEVICE="tpu"), timeout=120)
    assert r.returncode != 0
    assert "DeviceError: DTLAB_DEVICE must be cpu, gpu or auto, not 'tpu'" in r.stderr


@pytest.fixture
def cupy():
    """CuPy as chosen by the backend; the process default is restored afterwards."""
    try:
        xp = backend.select("gpu")
    except backend.DeviceError as e:
        pytest.skip(str(e))
    yield xp
    backend.select()


def batch_for(name, cfg, B, seed=0):
    rng = np.random.default_rng(seed)
    if name == "mlp":
        return rng.standard_normal((B, cfg.d_in)), rng.integers(0, cfg.n_classes, size=B)
    return (rng.integers(0, cfg.vocab, size=(B, cfg.seq_len)),
            rng.integers(0, cfg.vocab, size=(B, cfg.seq_len)))


def loss_and_grads(name, cfg, B, xp, dtype):
    model = build_model(name, cfg)
    P = model.init_params(0, dtype=dtype, xp=xp)
    loss = Replica(model, P).compute_grads([batch_for(name, cfg, B)])
    return loss, backend.to_host(P.grad)


@pytest.mark.gpu
@pytest.mark.parametrize("name,cfg,B", MODELS, ids=IDS)
def test_forward_backward_match_numpy_float64(cupy, name, cfg, B):
    loss_np, grad_np = loss_and_grads(name, cfg, B, np, "float64")
    loss_cp, grad_cp = loss_and_grads(name, cfg, B, cupy, "float64")
    assert loss_cp == pytest.approx(loss_np, rel=1e-12)
    np.testing.assert_allclose(grad_cp, grad_np, rtol=1e-9, atol=1e-13)


@pytest.mark.gpu
@pytest.mark.parametrize("name,cfg,B", MODELS, ids=IDS)
def test_forward_backward_match_numpy_float32(cupy, name, cfg, B):
    loss_np, grad_np = loss_and_grads(name, cfg, B, np, "float32")
    loss_cp, grad_cp = loss_and_grads(name, cfg, B, cupy, "float32")
    assert grad_cp.dtype == np.float32
    assert loss_cp == pytest.approx(loss_np, rel=1e-5)
    np.testing.assert_allclose(grad_cp, grad_np, rtol=1e-3, atol=1e-5 * np.abs(grad_np).max())


@pytest.mark.gpu
@pytest.mark.parametrize("name,cfg,B", MODELS, ids=IDS)
def test_activation_bytes_on_gpu_match_estimate(cupy, name, cfg, B):
    model = build_model(name, cfg)
    P = model.init_params(0, xp=cupy)
    _, ctx = model.forward(P, batch_for(name, cfg, B))
    assert context_bytes(ctx) == estimate(name, cfg, B).activation_bytes


@pytest.mark.gpu
def test_bench_runs_on_gpu(cupy):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DTLAB_DEVICE": "gpu"}
    r = subprocess.run([sys.executable, "-m", "dtlab.lab.bench.model", "--tiny"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "on cpu" not in r.stdout.splitlines()[0]
