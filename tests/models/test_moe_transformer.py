"""The MoE FFN inside the transformer: config flags and their errors, the whole model against
finite differences, models/cost.py's MoE part against an instrumented run, and training to
the Markov source's floor."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
from support.gradcheck import assert_grad_close, numeric_grad, sample_offsets
from test_cost import COUNTING_XP, Counting, batch_for
from test_train import TINY_LM, train

from dtlab.models.config import ConfigError
from dtlab.models.cost import estimate
from dtlab.models.memory import context_bytes
from dtlab.models.moe import moe_aux_loss, moe_layers
from dtlab.models.params import FlatParams
from dtlab.models.transformer import Transformer, TransformerConfig
from dtlab.models.zoo import build_model

TINY = dict(vocab=11, seq_len=5, d_model=8, n_heads=2, n_layers=2, d_ff=12)


def test_moe_every_places_the_layers():
    model = Transformer(TransformerConfig(**{**TINY, "n_layers": 4}, moe_experts=3,
                                          moe_every=2))
    assert sorted(m.name for m in moe_layers(model.body)) == ["h1.moe", "h3.moe"]
    names = {s.name for s in model.specs()}
    assert "h0.ffn.fc.W" in names and "h1.moe.e2.fc.W" in names and "h1.ffn.fc.W" not in names


@pytest.mark.parametrize("ffn,extra", [
    ("gelu", dict(moe_top_k=2, moe_capacity_factor=1.0, moe_aux_coef=0.5, moe_z_coef=0.1)),
    ("swiglu", dict(moe_top_k=1, moe_dropless=True, moe_shared_experts=1, moe_z_coef=0.2,
                    norm="rmsnorm", recompute=True)),
])
def test_transformer_with_moe_matches_finite_differences(ffn, extra):
    """The scalar is the model's loss plus the balancing terms the layers report."""
    model = Transformer(TransformerConfig(**TINY, ffn=ffn, moe_experts=3, **extra))
    P = model.init_params(0, dtype="float64", xp=np)
    P.data[...] = np.random.default_rng(1).normal(0.0, 0.3, P.size)
    tokens = np.random.default_rng(0).integers(0, 11, size=(3, 6))
    batch = tokens[:, :-1], tokens[:, 1:]

    def loss():
        value, ctx = model.forward(P, batch)
        if extra.get("recompute"):  # Recompute keeps no context: the layers have the terms
            return value + sum(m.last_aux_loss for m in moe_layers(model.body))
        return value + moe_aux_loss(ctx)

    P.zero_grad()
    model.loss_and_grad(P, batch)
    offsets = sample_offsets(P, 3, np.random.default_rng(0))
    num = numeric_grad(loss, P.data, offsets)
    assert np.abs(num).max() > 1e-3
    assert_grad_close(P.grad[offsets], num, "transformer with MoE: parameter gradients")


# ---- cost: parameters, FLOPs and bytes against the implementation ----

COST_CONFIGS = [
    TransformerConfig(**TINY, moe_experts=4, moe_top_k=2, moe_dropless=True),
    TransformerConfig(vocab=9, seq_len=6, d_model=8, n_heads=2, n_layers=3, d_ff=10,
                      ffn="swiglu", moe_experts=3, moe_top_k=1, moe_every=2,
                      moe_dropless=True, moe_shared_experts=2, moe_bias_rate=0.01),
    TransformerConfig(**TINY, ffn="swiglu", recompute=True, moe_experts=5, moe_top_k=5,
                      moe_dropless=True),
]


@pytest.mark.parametrize("cfg", COST_CONFIGS, ids=range(len(COST_CONFIGS)))
def test_cost_part_matches_the_implementation(cfg):
    B = 3
    model = build_model("transformer", cfg)
    cost = estimate("transformer", cfg, B)
    P = FlatParams(model.specs(), xp=np)
    assert cost.params_total == P.size
    layers = moe_layers(model.body)
    expert = [s.size for s in P.specs if s.name.startswith(f"{layers[0].name}.e0.")]
    L_moe = len(layers)
    assert cost.params_active == P.size - L_moe * (cfg.moe_experts - cfg.moe_top_k) * sum(expert)
    _, ctx = model.forward(model.init_params(0, xp=np), batch_for("transformer", cfg, B))
    assert context_bytes(ctx) == cost.activation_bytes
    Pc = model.init_params(0, xp=COUNTING_XP)
    Counting.flops = 0
    _, ctx = model.forward(Pc, batch_for("transformer", cfg, B))
    assert Counting.flops == cost.flops_forward
    model.backward(Pc, ctx)
    assert Counting.flops == cost.flops_step


def test_cost_cli_states_total_active_and_ratio():
    r = subprocess.run([sys.executable, "-m", "dtlab.models.run.cost", "--model", "transformer",
                        "--moe-experts", "8", "--moe-top-k", "2", "--ffn", "swiglu"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    cfg = TransformerConfig(moe_experts=8, moe_top_k=2, ffn="swiglu")
    cost = estimate("transformer", cfg, 8)
    line = next(x for x in r.stdout.splitlines() if x.startswith("parameters"))
    ratio = cost.params_active / cost.params_total
    assert f"{cost.params_total:,} total, {cost.params_active:,} active ({ratio:.1%}" in line
    assert 0.2 < ratio < 0.4


# ---- config errors ----

@pytest.mark.parametrize("fields,flag", [
    (dict(moe_experts=4, moe_top_k=5), "--moe-top-k"),
    (dict(moe_experts=4, moe_top_k=0), "--moe-top-k"),
    (dict(moe_experts=4, moe_capacity_factor=0.0), "--moe-capacity-factor"),
    (dict(moe_experts=4, moe_capacity_factor=-1.0), "--moe-capacity-factor"),
    (dict(moe_experts=-1), "--moe-experts"),
    (dict(moe_experts=4, moe_every=3), "--moe-every"),
    (dict(moe_experts=4, moe_every=0), "--moe-every"),
    (dict(moe_experts=4, moe_dynamic_p=1.5), "--moe-dynamic-p"),
    (dict(moe_experts=4, moe_dynamic_p=0.5, moe_k_max=5), "--moe-k-max"),
    (dict(moe_experts=4, moe_k_max=2), "--moe-k-max"),
    (dict(moe_experts=4, moe_noise_temperature=0.0), "--moe-noise-temperature"),
    (dict(moe_experts=4, moe_aux_coef=-0.1), "--moe-aux-coef"),
    (dict(moe_experts=4, moe_bias_rate=-1.0), "--moe-bias-rate"),
    (dict(moe_experts=4, moe_shared_experts=-1), "--moe-shared-experts"),
    (dict(moe_top_k=3), "--moe-top-k"),  # no effect without experts
    (dict(moe_experts=4, moe_dropless=True, moe_capacity_factor=2.0), "--moe-capacity-factor"),
    (dict(moe_experts=4, moe_noise_temperature=0.5), "--moe-noise-temperature"),
])
def test_bad_moe_config_names_the_flag(fields, flag):
    with pytest.raises(ConfigError, match=flag):
        TransformerConfig(**TINY, **fields).validate()


def test_cli_exits_2_naming_the_flag():
    r = subprocess.run([sys.executable, "-m", "dtlab.models.run.train", "--moe-experts", "4",
                        "--moe-top-k", "5"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].endswith(
        "error: --moe-top-k 5 must be in 1..--moe-experts 4")


# ---- training ----

def test_moe_transformer_reaches_the_entropy_rate():
    session, summary = train(TINY_LM + ["--steps", "300", "--moe-experts", "4",
                                        "--moe-top-k", "2"])
    assert summary.gap < 0.1, f"final {summary.final_loss:.3f} vs floor {summary.floor:.3f}"
    stats = moe_layers(session.model.body)[0].stats.summary()
    assert stats["forwards"] == 300 and stats["imbalance"] < 2.0
