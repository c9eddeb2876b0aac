"""Mixed precision (models/precision.py): fp16 and bf16 layers against float64 within the
dtype's rounding, the loss scaler's skips, backoff and growth, the measured activation
bytes against the cost model, training near the fp32 loss, and flags refused by name."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from support.mpirun import mpirun
from support.pserver_util import ONE_BLAS_THREAD, ROOT
from support.twins import single_params

from dtlab.models.attention import CausalSelfAttention
from dtlab.models.config import ConfigError
from dtlab.models.cost import estimate
from dtlab.models.layers import (
    GELU,
    Embedding,
    LayerNorm,
    Linear,
    ReLU,
    RMSNorm,
    Sequential,
    SwiGLU,
)
from dtlab.models.memory import context_bytes
from dtlab.models.mlp import MLPConfig
from dtlab.models.model import Replica
from dtlab.models.params import FlatParams
from dtlab.models.precision import PRECISIONS, UNIT_ROUNDOFF, Cast, LossScaler, MixedReplica
from dtlab.models.run.metrics import MetricsLog, read_metrics
from dtlab.models.run.session import build_session, parse
from dtlab.models.run.trainer import Trainer, config_differences
from dtlab.models.transformer import TransformerConfig
from dtlab.models.zoo import build_model

pytestmark = pytest.mark.usefixtures("mpiexec")

HALVES = ("fp16", "bf16")
D = 16

LAYERS = {
    "linear": lambda: Linear("l", D, 24),
    "layernorm": lambda: LayerNorm("n", D),
    "rmsnorm": lambda: RMSNorm("n", D),
    "gelu": GELU,
    "relu": ReLU,
    "swiglu": lambda: SwiGLU("s", D, 32),
    "attention": lambda: CausalSelfAttention("a", D, 2),
    "block": lambda: Sequential([LayerNorm("n", D), Linear("f", D, 32), GELU(),
                                 Linear("p", 32, D)]),
}


def run_layer(layer, dtype, x, dy):
    """Output, input gradient and parameter gradient of `layer` (wrapped in a Sequential)
    with parameters of `dtype`; a half dtype runs through the Cast policy."""
    seq = Sequential([layer])
    P = FlatParams(seq.specs(), dtype=dtype, xp=np)
    half = np.dtype(dtype).itemsize == 2
    if half:
        P.cast = Cast(dtype)
        x, dy = x.astype(dtype), dy.astype(dtype)
    y, ctx = seq.forward(P, x)
    dx = seq.backward(P, ctx, dy)
    return y, dx, P.grad.copy()


def rel_err(got, want) -> float:
    """max |got - want| / max |want| (0 for an all-zero reference)."""
    scale = float(np.abs(want).max())
    return float(np.abs(got.astype(np.float64) - want).max()) / (scale or 1.0)


@pytest.mark.parametrize("precision", HALVES)
@pytest.mark.parametrize("name", sorted(LAYERS))
def test_layer_in_half_precision_is_float64_within_its_rounding(name, precision):
    """Half storage rounds inputs, weights, outputs and gradients once each (unit
    roundoff u); float32 compute adds nothing at this scale. The output, the input gradient
    and the weight gradients stay within a few u of float64, and are stored in half."""
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 8, D))
    seq = Sequential([LAYERS[name]()])
    dy = rng.standard_normal(seq.forward(FlatParams(seq.specs(), dtype=np.float64, xp=np),
                                         x)[0].shape)
    y64, dx64, g64 = run_layer(LAYERS[name](), np.float64, x, dy)
    y, dx, g = run_layer(LAYERS[name](), PRECISIONS[precision], x, dy)
    assert y.dtype == dx.dtype == g.dtype == PRECISIONS[precision]
    u = UNIT_ROUNDOFF[precision]
    for what, got, want in (("output", y, y64), ("input gradient", dx, dx64),
                            ("parameter gradient", g, g64)):
        if want.size:
            assert rel_err(got, want) < 8 * u, f"{name} {what}: {rel_err(got, want) / u:.1f} u"


@pytest.mark.parametrize("precision", HALVES)
def test_embedding_gathers_half_rows_and_scatters_half_gradients(precision):
    tokens = np.random.default_rng(2).integers(0, 7, (2, 5))
    dy = np.random.default_rng(3).standard_normal((2, 5, D))
    emb = Sequential([Embedding("e", 7, D, max_len=5)])
    ref = FlatParams(emb.specs(), dtype=np.float64, xp=np)
    y64, ctx = emb.forward(ref, tokens)
    emb.backward(ref, ctx, dy)
    P = FlatParams(emb.specs(), dtype=PRECISIONS[precision], xp=np)
    P.cast = Cast(P.dtype)
    y, ctx = emb.forward(P, tokens)
    emb.backward(P, ctx, dy.astype(P.dtype))
    u = UNIT_ROUNDOFF[precision]
    assert y.dtype == P.dtype
    assert rel_err(y, y64) < 4 * u and rel_err(P.grad, ref.grad) < 8 * u


MODELS = [
    ("mlp", MLPConfig(d_in=5, d_hidden=7, n_layers=2, n_classes=3)),
    ("mlp", MLPConfig(d_in=9, d_hidden=4, n_layers=3, n_classes=5, activation="relu")),
    ("transformer", TransformerConfig(vocab=11, seq_len=12, d_model=16, n_heads=2, n_layers=2,
                                      d_ff=32)),
    ("transformer", TransformerConfig(vocab=11, seq_len=12, d_model=16, n_heads=2, n_layers=2,
                                      d_ff=32, norm="rmsnorm", ffn="swiglu")),
]


def batch(name, cfg, B=4):
    rng = np.random.default_rng(0)
    if name == "mlp":
        return (rng.standard_normal((B, cfg.d_in)).astype(np.float32),
                rng.integers(0, cfg.n_classes, B))
    tokens = rng.integers(0, cfg.vocab, (2, B, cfg.seq_len))
    return tokens[0], tokens[1]


@pytest.mark.parametrize("precision", HALVES)
@pytest.mark.parametrize("name, cfg", MODELS, ids=[f"{n}{i}" for i, (n, _) in enumerate(MODELS)])
def test_measured_activation_bytes_equal_the_cost_model(name, cfg, precision):
    """The forward context kept in half is what models.cost predicts for the precision
    (float elements at 2 bytes, token ids and ReLU masks as they are), half of fp32's
    float bytes; the gradient buffer is 2 bytes a parameter."""
    model = build_model(name, cfg)
    replica = MixedReplica(model, model.init_params(0, xp=np), precision, LossScaler())
    replica.compute_grads([batch(name, cfg)])
    _, ctx = model.forward(replica.work, batch(name, cfg))
    cost = estimate(name, cfg, 4)
    assert context_bytes(ctx) == cost.memory[precision].activations
    assert replica.work.grad.nbytes == cost.memory[precision].grads


@pytest.mark.parametrize("precision", HALVES)
def test_mixed_replica_gradient_is_the_fp32_gradient_within_rounding(precision):
    name, cfg = MODELS[2]
    model = build_model(name, cfg)
    ref = model.init_params(0, xp=np)
    loss32 = Replica(model, ref).compute_grads([batch(name, cfg)] * 2)
    mixed = MixedReplica(model, model.init_params(0, xp=np), precision,
                         LossScaler(scale=1024.0))
    loss = mixed.compute_grads([batch(name, cfg)] * 2)
    ok, record = mixed.finish_grads()
    assert ok and record == {"loss_scale": 1024.0, "skipped": False, "skipped_steps": 0}
    assert mixed.params.grad.dtype == np.float32
    assert abs(loss - loss32) < 16 * UNIT_ROUNDOFF[precision] * loss32
    assert rel_err(mixed.params.grad, ref.grad) < 32 * UNIT_ROUNDOFF[precision]


def test_loss_scaler_backs_off_on_overflow_and_grows_after_a_window():
    s = LossScaler(scale=1024.0, window=3)
    s.update(False)
    assert (s.scale, s.skipped, s.good_steps) == (512.0, 1, 0)
    for _ in range(2):
        s.update(True)
    assert s.scale == 512.0
    s.update(True)
    assert (s.scale, s.good_steps) == (1024.0, 0)
    fixed = LossScaler(scale=1.0, dynamic=False)
    fixed.update(False)
    assert (fixed.scale, fixed.skipped) == (1.0, 1)
    tiny = LossScaler(scale=2.0**-24)
    with pytest.raises(FloatingPointError, match="overflow"):
        tiny.update(False)


def session(*flags):
    return build_session(parse(["--model", "mlp", "--d-in", "8", "--d-hidden", "16",
                                "--n-classes", "4", "--optimizer", "adam", "--lr", "1e-2",
                                "--warmup", "0", *flags], prog="test"))


def test_forced_overflow_skips_the_step_and_halves_the_scale():
    """A loss scale of 1e30 overflows fp16 (largest 65504): the step is skipped (parameters
    and optimizer state unchanged), the scale halves, the record says so."""
    s = session("--precision", "fp16", "--loss-scale", "1e30")
    before = s.params.data.copy()
    record = Trainer(s, MetricsLog("", {})).step(0)
    assert record["skipped"] and record["skipped_steps"] == 1 and record["grad_norm"] is None
    assert record["loss_scale"] == 1e30 and s.replica.scaler.scale == 5e29
    np.testing.assert_array_equal(s.params.data, before)
    assert s.optimizer.steps == 0


def test_scale_grows_after_the_window_of_finite_steps():
    s = session("--precision", "fp16", "--loss-scale", "1024", "--loss-scale-window", "3")
    trainer = Trainer(s, MetricsLog("", {}))
    records = [trainer.step(i) for i in range(4)]
    assert [r["loss_scale"] for r in records] == [1024.0, 1024.0, 1024.0, 2048.0]
    assert not any(r["skipped"] for r in records) and s.optimizer.steps == 4


@pytest.mark.parametrize("flags, words", [
    (["--precision", "fp8"], "fp8"),
    (["--precision", "fp16", "--dtype", "float64"], "--dtype float32"),
    (["--precision", "fp16", "--loss-scale", "0"], "--loss-scale must be positive"),
    (["--precision", "fp16", "--loss-scale-backoff", "1.5"], "--loss-scale-backoff"),
])
def test_bad_precision_flags_are_refused_by_name(flags, words):
    r = subprocess.run([sys.executable, "-m", "dtlab.models.run.train", "--model", "mlp",
                        "--steps", "1", *flags], cwd=ROOT, capture_output=True, text=True,
                       timeout=60, env=ONE_BLAS_THREAD)
    assert r.returncode == 2 and words in r.stderr, r.stderr
    with pytest.raises((ConfigError, SystemExit)):
        parse(["--model", "mlp", *flags], prog="test")


TINY_LM = ["--model", "transformer", "--vocab", "8", "--seq-len", "16", "--d-model", "32",
           "--n-heads", "2", "--n-layers", "1", "--d-ff", "64", "--markov-order", "1",
           "--markov-support", "2", "--n-tokens", "200000", "--batch-size", "16", "--lr", "1e-2",
           "--steps", "300"]


def test_half_precision_training_reaches_the_floor_as_fp32_does(tmp_path):
    """The same run at each precision: every one within 0.1 nats of the Markov source's
    entropy rate, fp16 and bf16 within 0.02 nats of fp32's final loss."""
    final = {}
    for precision in PRECISIONS:
        path = tmp_path / f"{precision}.jsonl"
        r = subprocess.run([sys.executable, "-m", "dtlab.models.run.train", *TINY_LM,
                            "--precision", precision, "--metrics", str(path)], cwd=ROOT,
                           capture_output=True, text=True, timeout=120, env=ONE_BLAS_THREAD)
        assert r.returncode == 0, r.stderr
        header, records = read_metrics(str(path))
        final[precision] = np.mean([x["loss"] for x in records[-30:]])
        assert final[precision] - header["floor"] < 0.1, (precision, final, header["floor"])
        if precision != "fp32":
            assert f"{precision}: " in r.stdout and "loss_scale" in records[-1]
    for precision in HALVES:
        assert abs(final[precision] - final["fp32"]) < 0.02, final


def test_sync_ranks_agree_on_skipped_steps_and_stay_identical(tmp_path):
    """2 ranks with --precision fp16 and a loss scale that overflows at first: every rank
    skips the same steps (the check follows the all-reduce), so the replicas stay
    identical (the trainer compares their checksums at the end and fails otherwise)."""
    path = tmp_path / "sync.jsonl"
    r = mpirun(2, "-m", "dtlab.collective.train", "--model", "mlp", "--d-hidden", "32",
               "--steps", "12", "--batch-size", "16", "--precision", "fp16",
               "--loss-scale", "1e9", "--metrics", str(path), timeout=120)
    assert r.rc == 0, r
    header, records = read_metrics(str(path))
    skipped = [x["step"] for x in records if x["skipped"]]
    assert skipped and skipped == list(range(1, len(skipped) + 1)), skipped
    assert records[-1]["loss_scale"] < 1e9 and records[-1]["skipped_steps"] == len(skipped)
    assert 2 * records[-1]["wire_bytes"] == header["param_bytes"]  # half gradients reduced
    assert 2 * header["grad_bytes"] == header["param_bytes"]


def test_bias_balancing_in_half_precision_nudges_the_float32_bias():
    """--moe-bias-rate under bf16: each backward nudges the master (float32) bias by
    +-rate, so after k steps every entry is an integer multiple of the rate, however far
    below bf16's resolution, and the half copy selects with it rounded."""
    rate = 1e-3
    setup = parse([*TINY_LM[:-2], "--steps", "6", "--moe-experts", "4", "--moe-top-k", "1",
                   "--moe-bias-rate", str(rate), "--precision", "bf16"], prog="t")
    s = build_session(setup)
    Trainer(s, MetricsLog("", {})).run()
    bias = s.params["h0.moe.router.bias"]
    assert bias.dtype == np.float32 and np.abs(bias).max() > 0
    np.testing.assert_allclose(bias / rate, np.round(bias / rate), atol=1e-3)
    assert np.abs(np.round(bias / rate)).max() <= 6  # at most one step per backward
    np.testing.assert_array_equal(s.replica.work["h0.moe.router.bias"],
                                  bias.astype(s.replica.work.dtype))


@pytest.mark.parametrize("precision", HALVES)
def test_a_pipeline_in_half_precision_equals_one_process_and_its_stages_skip_together(
        tmp_path, precision):
    """pp 2 with 1F1B (each stage accumulates its micro-batches' gradients in the order one
    process does) and a first loss scale that overflows: every stage skips the same steps
    and the final parameters equal single-process training at that precision, bit for
    bit: half activations and gradients cross the stages as they cross the modules.
    (--clip 0: a clip's norm sums the stages' squares in another order, an ulp apart.)"""
    flags = ["--model", "mlp", "--d-hidden", "32", "--n-layers", "2", "--steps", "12",
             "--batch-size", "8", "--grad-accum", "2", "--precision", precision,
             "--loss-scale", "1e9", "--seed", "5", "--clip", "0"]
    single = single_params(tmp_path, flags, 12)
    out, metrics = tmp_path / "pp.npy", tmp_path / "pp.jsonl"
    r = mpirun(2, "tests/support/mpi_progs/grid_train.py", out, "--pp", "2",
               "--pp-schedule", "1f1b",
               *flags, "--metrics", metrics, timeout=120)
    assert r.rc == 0, r
    np.testing.assert_array_equal(np.load(out), single)
    records = read_metrics(str(metrics))[1]
    assert precision == "bf16" or any(x["skipped"] for x in records)  # fp16: 1e9 overflows


def test_tensor_split_ranks_agree_on_a_skip():
    r = mpirun(2, "tests/support/mpi_progs/precision_agree.py", timeout=60)
    assert r.rc == 0 and "PASS precision agree 2" in r.stdout, r


def test_resume_carries_the_loss_scaler_on(tmp_path):
    """6 fp16 steps straight equal 3 steps, a checkpoint, and 3 resumed ones, bit for bit:
    the scale, its window count and the skipped steps come back with the weights."""
    flags = [*TINY_LM[:-2], "--precision", "fp16", "--loss-scale", "1e9",
             "--loss-scale-window", "2", "--checkpoint-every", "3"]

    def params(name, *more):
        ck = tmp_path / name
        for steps in more:
            s = build_session(parse([*flags, "--steps", str(steps), "--checkpoint-dir", str(ck),
                                     *(["--resume"] if steps != more[0] else [])], prog="t"))
            Trainer(s, MetricsLog("", {})).run()
        return s.params.data.copy(), s.replica.scaler.state_dict()

    straight, resumed = params("straight", 6), params("resumed", 3, 6)
    np.testing.assert_array_equal(straight[0], resumed[0])
    assert straight[1] == resumed[1] and straight[1]["skipped"] > 0


@pytest.mark.parametrize("flags, words", [
    (["--wire", "fp8"], "fp8"),
    (["--precision", "fp4"], "fp4"),
])
def test_worker_refuses_what_it_cannot_do_by_name(flags, words):
    r = subprocess.run([sys.executable, "-m", "dtlab.pserver.worker", "--servers",
                        "127.0.0.1:1", "--model", "mlp", *flags], cwd=ROOT, capture_output=True,
                       text=True, timeout=60, env=ONE_BLAS_THREAD)
    assert r.returncode == 2 and words in r.stderr, r.stderr


def test_a_checkpoint_from_before_the_precision_flags_resumes_as_fp32():
    """A saved config without the precision fields (written before they existed) ran as
    their defaults: no difference for an fp32 resume; an fp16 resume names the change."""
    now = parse(["--model", "mlp"], prog="t").as_dict()
    saved = {**now, "run": {k: v for k, v in now["run"].items()
                            if not k.startswith(("precision", "loss_scale"))}}
    assert config_differences(saved, now) == []
    fp16 = parse(["--model", "mlp", "--precision", "fp16"], prog="t").as_dict()
    assert config_differences(saved, fp16) == ["run.precision: 'fp32' -> 'fp16'"]
