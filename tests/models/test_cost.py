"""dtlab.models.cost against what the implementation really does.

- parameter counts equal the FlatParams size exactly;
- FLOPs equal the matmul FLOPs counted while a real forward and backward
  run (every np.matmul an array of `Counting` takes part in is recorded);
- activation bytes equal models.memory's measurement of the context that
  Model.forward returns, to the byte (tolerance 0);
- the seed exercise (GPT-2-ish d = n = 1024, B = 8, L = 24) is reproduced.
"""

from __future__ import annotations

import json
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from dtlab.models.config import ConfigError
from dtlab.models.cost import estimate, zero_memory, zero_traffic
from dtlab.models.memory import context_bytes
from dtlab.models.mlp import MLPConfig
from dtlab.models.params import FlatParams
from dtlab.models.transformer import TransformerConfig
from dtlab.models.zoo import MODELS, build_model

ROOT = Path(__file__).resolve().parents[2]

CONFIGS = [
    ("mlp", MLPConfig(d_in=5, d_hidden=7, n_layers=2, n_classes=3), 6),
    ("mlp", MLPConfig(d_in=9, d_hidden=4, n_layers=3, n_classes=5, activation="relu"), 4),
    ("mlp", MLPConfig(d_in=6, n_layers=0, n_classes=2), 3),
    ("transformer", TransformerConfig(vocab=13, seq_len=7, d_model=12, n_heads=3, n_layers=2,
                                      d_ff=20), 3),
    ("transformer", TransformerConfig(vocab=10, seq_len=5, d_model=8, n_heads=2, n_layers=3,
                                      d_ff=12, ffn="swiglu", norm="rmsnorm"), 2),
    ("transformer", TransformerConfig(vocab=9, seq_len=6, d_model=8, n_heads=4, n_layers=2,
                                      d_ff=16, recompute=True), 3),
    ("transformer", TransformerConfig(vocab=9, seq_len=4, d_model=8, n_heads=1, n_layers=1,
                                      d_ff=8, ffn="swiglu", recompute=True), 5),
    ("transformer", TransformerConfig(vocab=9, seq_len=6, d_model=8, n_heads=2, n_layers=2,
                                      d_ff=16, selective_recompute=True), 3),
]
IDS = [f"{m}-{i}" for i, (m, _, _) in enumerate(CONFIGS)]


def batch_for(name, cfg, B, seed=0):
    """A contiguous batch (a slice of a larger array would count its parent's bytes)."""
    rng = np.random.default_rng(seed)
    if name == "mlp":
        return (rng.standard_normal((B, cfg.d_in)).astype(np.float32),
                rng.integers(0, cfg.n_classes, size=B))
    return (rng.integers(0, cfg.vocab, size=(B, cfg.seq_len)),
            rng.integers(0, cfg.vocab, size=(B, cfg.seq_len)))


class Counting(np.ndarray):
    """An ndarray that adds 2 m k n to `flops` for every (m, k) @ (k, n) it takes part in."""

    flops = 0

    def __array_ufunc__(self, ufunc, method, *inputs, out=None, **kwargs):
        def plain(a):
            return a.view(np.ndarray) if isinstance(a, Counting) else a

        inputs = tuple(plain(a) for a in inputs)
        if out is not None:
            kwargs["out"] = tuple(plain(a) for a in out)
        result = getattr(ufunc, method)(*inputs, **kwargs)
        if ufunc is np.matmul and method == "__call__":
            Counting.flops += 2 * result.size * inputs[0].shape[-1]
        return result.view(Counting) if isinstance(result, np.ndarray) else result


COUNTING_XP = types.SimpleNamespace(
    asarray=lambda a, dtype=None: np.asarray(a, dtype=dtype).view(Counting),
    zeros=lambda shape, dtype=None: np.zeros(shape, dtype=dtype).view(Counting),
)


@pytest.mark.parametrize("name,cfg,B", CONFIGS, ids=IDS)
def test_param_count_is_flat_params_size(name, cfg, B):
    cost = estimate(name, cfg, B)
    P = FlatParams(build_model(name, cfg).specs(), xp=np)
    assert cost.params_total == P.size
    assert cost.params_active == P.size  # dense
    emb = sum(s.size for s in P.specs if s.name.startswith("wte."))
    assert cost.params_embedding == emb


@pytest.mark.parametrize("name,cfg,B", CONFIGS, ids=IDS)
def test_flops_match_counted_matmuls(name, cfg, B):
    model = build_model(name, cfg)
    P = model.init_params(0, xp=COUNTING_XP)
    assert isinstance(P.data, Counting)
    cost = estimate(name, cfg, B)
    Counting.flops = 0
    loss, ctx = model.forward(P, batch_for(name, cfg, B))
    forward = Counting.flops
    model.backward(P, ctx)
    assert forward == cost.flops_forward
    assert Counting.flops == cost.flops_step
    assert Counting.flops - forward == cost.flops_backward + cost.flops_recompute
    assert cost.flops_step > 0


@pytest.mark.parametrize("name,cfg,B", CONFIGS, ids=IDS)
def test_activation_bytes_match_measured_context(name, cfg, B):
    model = build_model(name, cfg)
    P = model.init_params(0, xp=np)
    _, ctx = model.forward(P, batch_for(name, cfg, B))
    assert context_bytes(ctx) == estimate(name, cfg, B).activation_bytes


def test_recompute_trades_memory_for_one_forward():
    base = dict(vocab=11, seq_len=16, d_model=16, n_heads=2, n_layers=4, d_ff=32)
    plain = estimate("transformer", TransformerConfig(**base), 4)
    rec = estimate("transformer", TransformerConfig(recompute=True, **base), 4)
    blocks = sum(p.count * p.flops_forward for p in plain.parts if p.name.startswith("h."))
    assert rec.flops_recompute == blocks
    assert rec.flops_step == plain.flops_step + blocks
    assert rec.flops_model == plain.flops_model
    assert rec.activation_bytes < plain.activation_bytes


def test_selective_recompute_is_bit_identical_and_keeps_no_scores():
    """Korthikanti et al. 2022: the softmax is rebuilt, not kept; the gradients are the
    plain run's to the last bit, and the context is B heads T^2 floats per layer smaller."""
    base = dict(vocab=11, seq_len=12, d_model=16, n_heads=4, n_layers=3, d_ff=32)
    B, out = 3, {}
    for selective in (False, True):
        model = build_model("transformer", TransformerConfig(selective_recompute=selective,
                                                             **base))
        P = model.init_params(0, xp=np)
        loss, ctx = model.forward(P, batch_for("transformer", model.config, B))
        out[selective] = (loss, context_bytes(ctx))
        model.backward(P, ctx)
        out[selective] += (P.grad.copy(),)
    assert out[True][0] == out[False][0]
    np.testing.assert_array_equal(out[True][2], out[False][2])
    scores = 3 * B * 4 * 12 * 12 * 4  # layers x B x heads x T^2 float32
    assert out[False][1] - out[True][1] == scores


def test_context_bytes_counts_shared_buffers_once():
    a = np.zeros((4, 6), dtype=np.float32)
    b = np.zeros(10, dtype=np.int64)
    assert context_bytes(a) == 96
    assert context_bytes((a, a.T, [a[1:], {"x": a.reshape(-1)}])) == 96
    assert context_bytes((a, b, None, 3)) == 96 + 80
    assert context_bytes(a[1:3]) == 48  # a slice holds only what it spans
    assert context_bytes((a[:1], a[3:])) == 48  # disjoint spans of one buffer
    assert context_bytes(a[:, 0]) == 3 * 24 + 4  # strided: first to last element
    assert context_bytes(b[::-1]) == 80
    assert context_bytes(np.zeros((0, 5))) == 0


@pytest.mark.parametrize("name,cfg,B", CONFIGS[:1] + CONFIGS[3:5], ids=IDS[:1] + IDS[3:5])
def test_palm_formula_differs_only_by_biases_and_gains(name, cfg, B):
    """6N + 12LHQT counts 6 FLOPs per token for every bias and norm gain, which
    are added, not multiplied, and 2 per weight of the MLP's first layer, whose input
    gradient is not computed (its input is data); otherwise it is our count exactly."""
    cost = estimate(name, cfg, B)
    P = FlatParams(build_model(name, cfg).specs(), xp=np)
    vectors = sum(s.size for s in P.specs if len(s.shape) == 1)
    first = P.specs[0].size if name == "mlp" else 0  # the first Linear's W
    assert cost.flops_palm_step - cost.flops_model == \
        (6 * vectors + 2 * first) * cost.tokens_per_step


@pytest.mark.parametrize("optimizer,per_param", [("sgd", 8), ("sgd-momentum", 12),
                                                 ("adam", 16), ("adamw", 16)])
def test_state_bytes_per_parameter(optimizer, per_param):
    cfg = TransformerConfig()
    cost = estimate("transformer", cfg, 2, optimizer=optimizer)
    n = cost.params_total
    fp32, bf16 = cost.memory["fp32"], cost.memory["bf16"]
    assert fp32.weights + fp32.grads + fp32.optimizer == per_param * n
    # ZeRO's mixed precision: 2 + 2 bytes of 16-bit weights and grads plus a
    # 4-byte fp32 master copy, the same total as fp32 (16 bytes for Adam)
    assert bf16.weights + bf16.master + bf16.grads + bf16.optimizer == per_param * n
    assert bf16.weights == 2 * n and bf16.grads == 2 * n and bf16.master == 4 * n
    assert bf16.optimizer == fp32.optimizer
    assert fp32.activations == cost.activation_bytes
    assert bf16.activations < fp32.activations
    assert cost.optimal_tokens == 20 * n


def test_bad_arguments_name_the_flag():
    with pytest.raises(ConfigError, match="--optimizer"):
        estimate("mlp", MLPConfig(), 4, optimizer="lion")
    with pytest.raises(ConfigError, match="--batch-size"):
        estimate("mlp", MLPConfig(), 0)
    with pytest.raises(ConfigError, match="--model"):
        estimate("gpt5", MLPConfig(), 4)
    with pytest.raises(ConfigError, match="--n-heads"):
        estimate("transformer", TransformerConfig(d_model=10, n_heads=3), 4)


# ---- the seed exercise: "FLOPs and memory of a transformer layer" ----

def seed_layer_flops(d, n, B):
    """The seed's transformer_layer_flops, verbatim in arithmetic."""
    qkv_flops = 3 * 2 * B * n * d * d
    attn_flops = 2 * 2 * B * n * n * d
    out_flops = 2 * B * n * d * d
    ffn_flops = 2 * 2 * B * n * d * 4 * d
    return qkv_flops + attn_flops + out_flops + ffn_flops


def test_seed_exercise_gpt2_scale():
    d, n, B, L, V = 1024, 1024, 8, 24, 50257
    cfg = TransformerConfig(vocab=V, seq_len=n, d_model=d, n_heads=16, n_layers=L, d_ff=4 * d)
    cost = estimate("transformer", cfg, B)
    layer = [p for p in cost.parts if p.name.startswith("h.")]
    assert all(p.count == L for p in layer)
    # forward FLOPs of one layer: the same matmuls as the seed's
    assert sum(p.flops_forward for p in layer) == seed_layer_flops(d, n, B)
    # step = 3 x forward for the layers; ours adds the LM head (3 x 2 N d V)
    seed_total = 3 * L * seed_layer_flops(d, n, B)
    assert sum(L * (p.flops_forward + p.flops_backward) for p in layer) == seed_total
    assert cost.flops_step == seed_total + 3 * 2 * B * n * d * V
    # parameters: the seed's L (12 d^2 + 13 d) are exactly our blocks
    assert sum(L * p.params for p in layer) == L * (12 * d * d + 13 * d)
    assert cost.params_total == L * (12 * d * d + 13 * d) + V * d + n * d + 2 * d + d * V
    # activations: ours keeps every head's probabilities and each matmul's input
    N = B * n
    ours = sum(p.act_bytes() for p in layer)
    assert ours == 4 * (8 * N * d + 2 * N + 3 * N * 4 * d + B * 16 * n * n)
    seed = (3 * B * n * d + B * n * n + B * n * 4 * d) * 2  # the seed's bf16 estimate
    assert ours / 2 > 4 * seed  # at 2 bytes, still over 4x the seed's rough figure
    assert cost.memory["fp32"].weights + cost.memory["fp32"].grads \
        + cost.memory["fp32"].optimizer == 16 * cost.params_total  # the seed's 16 bytes/param


# ---- the command ----

def run_cost(*args):
    return subprocess.run([sys.executable, "-m", "dtlab.models.run.cost", *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=60)


def test_cli_prints_table_and_json():
    flags = ["--model", "transformer", "--d-model", "64", "--n-heads", "4", "--n-layers", "2",
             "--seq-len", "32", "--vocab", "100", "--batch-size", "3"]
    r = run_cost(*flags)
    assert r.returncode == 0, r.stderr
    assert "h.attention" in r.stdout and "PaLM 6N + 12LHQT" in r.stdout
    assert "bf16" in r.stdout and "compute-optimal" in r.stdout
    r = run_cost(*flags, "--json")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    want = estimate("transformer", TransformerConfig(vocab=100, seq_len=32, d_model=64,
                                                     n_heads=4, n_layers=2), 3)
    assert got["flops_step"] == want.flops_step
    assert got["params_total"] == want.params_total
    assert got["memory"]["fp32"]["total"] == want.memory["fp32"].total


def test_cli_mlp_and_bad_flag():
    r = run_cost("--model", "mlp", "--d-hidden", "32", "--batch-size", "16")
    assert r.returncode == 0, r.stderr
    assert "loss (dlogits)" in r.stdout
    r = run_cost("--model", "transformer", "--d-model", "10", "--n-heads", "3")
    assert r.returncode == 2
    assert "error: --d-model 10 is not divisible by --n-heads 3" in r.stderr
    assert "Traceback" not in r.stderr


MODULE_CONFIGS = [*CONFIGS,
                  ("transformer", TransformerConfig(vocab=16, seq_len=8, d_model=16, n_heads=2,
                                                    n_layers=4, d_ff=32, moe_experts=4,
                                                    moe_every=2), 2),
                  ("transformer", TransformerConfig(vocab=16, seq_len=8, d_model=16, n_heads=2,
                                                    n_layers=2, d_ff=32, moe_experts=2,
                                                    recompute=True), 2)]


@pytest.mark.parametrize("name,cfg,B", MODULE_CONFIGS,
                         ids=[f"{m}-{i}" for i, (m, _, _) in enumerate(MODULE_CONFIGS)])
def test_module_parts_are_the_body_modules_and_sum_to_the_whole(name, cfg, B):
    """What a pipeline stage is costed by: each body module's parts hold exactly its
    parameters, and all of them together are the model's parts."""
    model = build_model(name, cfg)
    groups = MODELS[name].cost.modules(cfg, B)
    assert len(groups) == len(model.body.modules)
    for module, parts in zip(model.body.modules, groups, strict=True):
        assert sum(p.count * p.params for p in parts) == sum(s.size for s in module.specs())
    whole = MODELS[name].cost.parts(cfg, B)
    for attr in ("params", "flops_forward", "flops_backward", "flops_recompute", "act_floats",
                 "act_other_bytes"):
        assert sum(p.count * getattr(p, attr) for g in groups for p in g) == \
            sum(p.count * getattr(p, attr) for p in whole), attr


# ---- ZeRO's per-rank bytes and traffic (Rajbhandari et al. 2020) ----

def test_zero_memory_reproduces_the_papers_example():
    """Figure 1: a 7.5B model on 64 ranks, mixed-precision Adam (K = 12)."""
    psi, n = 7_500_000_000, 64
    totals = [zero_memory(psi, s, n, "fp16", "adam")["total"] / 1e9 for s in (0, 1, 2, 3)]
    assert [round(t, 1) for t in totals] == [120.0, 31.4, 16.6, 1.9]
    assert zero_memory(psi, 0, n, "bf16", "adam") == zero_memory(psi, 0, 1, "bf16", "adam")


@pytest.mark.parametrize("n", [1, 2, 3, 64])
def test_zero_memory_per_parameter_in_fp32(n):
    """fp32 Adam: 4 + 4 + 8 bytes per parameter, each stage dividing one more term by N;
    float64 doubles each; SGD without momentum keeps no state."""
    psi = 1000
    per = {s: zero_memory(psi, s, n)["total"] / psi for s in (0, 1, 2, 3)}
    assert per == pytest.approx({0: 16, 1: 8 + 8 / n, 2: 4 + 12 / n, 3: 16 / n})
    assert zero_memory(psi, 2, n, itemsize=8)["total"] == 2 * zero_memory(psi, 2, n)["total"]
    assert zero_memory(psi, 1, n, optimizer="sgd")["optimizer"] == 0
    m = zero_memory(psi, 3, n)
    assert m["weights"] + m["grads"] + m["optimizer"] == m["total"]


def test_zero_traffic_is_two_then_three_parameter_volumes():
    psi = 600
    for n in (2, 3, 8):
        base = psi * 4 * (n - 1) / n  # one fp32 parameter volume through a ring
        assert [zero_traffic(psi, s, n) for s in (0, 1, 2, 3)] == \
            pytest.approx([2 * base, 2 * base, 2 * base, 3 * base])  # the paper's 1.5x
        assert zero_traffic(psi, 3, n, reshard=False) == pytest.approx(2 * base)
        assert zero_traffic(psi, 2, n, micro_batches=3) == pytest.approx(4 * base)
        assert zero_traffic(psi, 1, n, "bf16") == pytest.approx(base)
    assert zero_traffic(psi, 3, 1) == 0


def test_zero_bad_arguments_name_the_flag():
    with pytest.raises(ConfigError, match="--zero"):
        zero_memory(10, 4, 2)
    with pytest.raises(ConfigError, match="--dp"):
        zero_traffic(10, 1, 0)
    with pytest.raises(ConfigError, match="--precision"):
        zero_memory(10, 1, 2, precision="fp8")


def test_cli_zero_prints_the_stages_and_the_papers_example():
    flags = ["--model", "mlp", "--d-hidden", "32"]
    r = run_cost(*flags, "--zero", "2", "--dp", "4")
    assert r.returncode == 0, r.stderr
    assert "ZeRO at dp 4" in r.stdout
    assert "stages 0-3: 120, 31.4, 16.6, 1.88" in r.stdout
    r = run_cost(*flags, "--zero", "3", "--dp", "4", "--json")
    zero = json.loads(r.stdout)["zero"]
    n = estimate("mlp", MLPConfig(d_hidden=32), 8).params_total
    assert zero["per_rank"]["fp32"]["3"]["total"] == pytest.approx(16 * n / 4)
    assert set(zero["per_rank"]["fp32"]) == {"0", "3"}
    r = run_cost(*flags, "--dp", "4")
    assert r.returncode == 2 and "--dp 4 has no effect without --zero" in r.stderr
