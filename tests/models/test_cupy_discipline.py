"""The CuPy-discipline check, in one process: the strict namespace itself, and a training
step of every single-process model kind held to CuPy's rules, bit for bit NumPy's.

`support.strict_xp` (named by DTLAB_ARRAY_MODULE, which `dtlab.models.backend`
honours) refuses what CuPy refuses and computes with NumPy, so a run under it must
equal the NumPy run exactly. This is not a GPU run: it finds, on every CPU run of the
suite, the host escapes, NumPy-CuPy mixes and calls CuPy lacks that would otherwise
first fail on a cluster; and it counts the device synchronisations each step makes
(scalar reads of device values), printed per model kind (`pytest -s`).
The parallel kinds and both topologies: tests/collective/test_cupy_discipline_sync.py,
tests/pserver/test_cupy_discipline_worker.py.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI
from support import strict_xp

from dtlab.models import backend
from dtlab.models.mlp import MLPConfig
from dtlab.models.model import Replica
from dtlab.models.optim import OptimConfig, make_optimizer
from dtlab.models.transformer import TransformerConfig
from dtlab.models.zoo import build_model
from dtlab.protos import dtlab_ps_pb2 as pb

ROOT = Path(__file__).resolve().parents[2]
TINY_T = dict(vocab=13, seq_len=6, d_model=16, n_heads=2, n_layers=2, d_ff=24)
MOE = dict(TINY_T, moe_experts=4)
KINDS = {
    "mlp": ("mlp", MLPConfig(d_in=5, d_hidden=16, n_layers=2, n_classes=4)),
    "mlp-relu": ("mlp", MLPConfig(d_in=5, d_hidden=16, n_layers=2, n_classes=4,
                                  activation="relu")),
    "transformer": ("transformer", TransformerConfig(**TINY_T)),
    "swiglu-rmsnorm": ("transformer", TransformerConfig(ffn="swiglu", norm="rmsnorm", **TINY_T)),
    "recompute": ("transformer", TransformerConfig(recompute=True, **TINY_T)),
    "selective-recompute": ("transformer",
                            TransformerConfig(selective_recompute=True, **TINY_T)),
    "moe-topk-capacity": ("transformer", TransformerConfig(moe_top_k=2, moe_capacity_factor=1.0,
                                                           moe_aux_coef=0.5, moe_z_coef=0.1,
                                                           **MOE)),
    "moe-dropless-shared": ("transformer", TransformerConfig(ffn="swiglu", moe_top_k=1,
                                                             moe_dropless=True,
                                                             moe_shared_experts=1, **MOE)),
    "moe-dynamic-k": ("transformer", TransformerConfig(moe_dynamic_p=0.6, moe_k_max=3, **MOE)),
    "moe-jitter": ("transformer", TransformerConfig(moe_noise="jitter", **MOE)),
    "moe-gumbel": ("transformer", TransformerConfig(moe_noise="gumbel",
                                                    moe_noise_temperature=0.5, **MOE)),
    "moe-bias-groups": ("transformer", TransformerConfig(moe_bias_rate=0.01, moe_groups=2,
                                                         moe_every=2, **MOE)),
}


@pytest.fixture
def strict():
    """The process's array module is the strict namespace for the test, NumPy after it."""
    saved = os.environ.get(backend.ARRAY_MODULE_ENV)
    os.environ[backend.ARRAY_MODULE_ENV] = "support.strict_xp"
    try:
        yield backend.select("gpu")
    finally:
        os.environ.pop(backend.ARRAY_MODULE_ENV)
        if saved is not None:
            os.environ[backend.ARRAY_MODULE_ENV] = saved
        backend.select()


def batch(name, cfg, B=4, seed=0):
    rng = np.random.default_rng(seed)
    if name == "mlp":
        return rng.standard_normal((B, cfg.d_in)), rng.integers(0, cfg.n_classes, size=B)
    return (rng.integers(0, cfg.vocab, size=(B, cfg.seq_len)),
            rng.integers(0, cfg.vocab, size=(B, cfg.seq_len)))


def train_steps(name, cfg, xp, steps=2):
    """Loss, gradient and parameters after `steps` AdamW steps (two micro-batches each), and
    the device synchronisations per step: (scalar reads, device-to-host copies)."""
    model = build_model(name, cfg)
    P = model.init_params(0, xp=xp)
    replica = Replica(model, P)
    opt = make_optimizer(OptimConfig(weight_decay=0.1), P.data)
    strict_xp.SYNCS.clear()
    for step in range(steps):
        loss = replica.compute_grads([batch(name, cfg, seed=step), batch(name, cfg, seed=9)])
        model.clip_grad_norm(P, 1.0)
        opt.step(P.data, P.grad, 1e-2)
    syncs = (strict_xp.sync_count() / steps, strict_xp.SYNCS["get"] / steps)
    return loss, backend.to_host(P.grad).copy(), backend.to_host(P.data).copy(), syncs


@pytest.mark.parametrize("kind", KINDS)
def test_training_step_under_cupy_rules_equals_numpy(strict, kind, capsys):
    name, cfg = KINDS[kind]
    loss_np, grad_np, data_np, _ = train_steps(name, cfg, np)
    loss, grad, data, syncs = train_steps(name, cfg, strict)
    assert loss == loss_np
    assert grad.tobytes() == grad_np.tobytes()
    assert data.tobytes() == data_np.tobytes()
    with capsys.disabled():
        print(f"\nCuPy-discipline check: {kind}: per training step {syncs[0]:g} scalar reads, "
              f"{syncs[1]:g} device-to-host copies")


def test_no_implicit_conversion_to_host(strict):
    a = strict.arange(6.0).reshape(2, 3)
    for escape in (np.asarray, np.array, memoryview, bytes, lambda x: x.tolist(),
                   lambda x: x.tobytes(), lambda x: MPI.COMM_SELF.Allreduce(MPI.IN_PLACE, x),
                   lambda x: pb.Chunk(data=x)):  # a gRPC message's tensor bytes
        with pytest.raises((TypeError, BufferError)):
            escape(a)
    with pytest.raises(TypeError, match="Implicit conversion to a NumPy array is not allowed"):
        np.asarray(a)
    host = backend.to_host(a)
    assert isinstance(host, np.ndarray) and host.tolist() == [[0, 1, 2], [3, 4, 5]]


def test_numpy_arrays_do_not_mix_with_device_arrays(strict):
    a = strict.ones(3)
    for mix in (lambda: a + np.ones(3), lambda: np.ones(3) * a, lambda: strict.dot(a, np.ones(3)),
                lambda: strict.concatenate([a, np.ones(3)]), lambda: np.maximum(a, np.ones(3))):
        with pytest.raises(TypeError, match="Unsupported type|NotImplemented"):
            mix()
    assert float((a * np.float32(2) + 1.0).sum()) == 9.0  # NumPy and Python scalars are fine


def test_only_what_cupy_exports_exists(strict):
    assert strict_xp.CUPY_VERSION == strict_xp.NAMES["cupy_version"]
    for missing in ("bfloat16", "random", "nanpercentile_of_nothing"):
        with pytest.raises(AttributeError):
            getattr(strict, missing)
    with pytest.raises(NotImplementedError, match="multiply.at"):
        np.multiply.at(strict.ones(3), [0], 2.0)
    with pytest.raises(ValueError, match="Unsupported dtype"):
        strict.ones(3).astype("V2")
    a = strict.zeros(3)
    np.add.at(a, np.array([0, 0, 2]), 1.0)  # CuPy scatters add: allowed
    assert a.get().tolist() == [2.0, 0.0, 1.0]


def test_scalar_reads_are_counted(strict):
    strict_xp.SYNCS.clear()
    a = strict.arange(4.0)
    assert (float(a.sum()), int(a[1]), bool(a[2] > 1), a[3].item()) == (6.0, 1, True, 3.0)
    assert strict_xp.sync_count() == 4
    with pytest.raises(TypeError):  # CuPy's arrays have no __index__
        range(a[1])


def test_gpu_check_without_a_gpu_refuses_in_one_line(tmp_path):
    """scripts/gpu_check on a machine without a GPU runs nothing: one line naming the
    missing GPU, exit 2, no figures written."""
    listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True) \
        if shutil.which("nvidia-smi") else None
    if listed is not None and "GPU " in listed.stdout:
        pytest.skip("a GPU is here: scripts/gpu_check would run, not refuse")
    out = tmp_path / "figures.json"
    r = subprocess.run([str(ROOT / "scripts" / "gpu_check"), str(out)], capture_output=True,
                       text=True, timeout=30, cwd=tmp_path)
    assert r.returncode == 2
    assert r.stdout == ""
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("gpu_check: no GPU: "), r.stderr
    assert "nothing was run" in r.stderr
    assert not out.exists()
