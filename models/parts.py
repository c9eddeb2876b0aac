"""What each layer of models/ costs: parameters, matmul FLOPs and the bytes its
forward context keeps, one function per module of models/layers.py,
attention.py and moe.py, and each model's Recipe built from them (registered with the
model in models/zoo.py). models/cost.py adds them up; tests/models/test_cost.py holds
them to an instrumented run, so a layer change that breaks them fails.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from dtlab.models.mlp import MLPConfig
from dtlab.models.transformer import TransformerConfig

FLOAT_BYTES = 4  # this implementation computes in float32
TOKEN_BYTES = 8  # int64 token ids (NumPy's default integer)


@dataclass(frozen=True)
class Part:
    """One kind of layer, occurring `count` times; all figures are per copy.

    act_floats: float elements its forward context keeps for backward.
    act_other_bytes: other bytes kept (int64 token ids, bool masks).
    embedding: its parameters are gathered, not multiplied (not in PaLM's N).
    """

    name: str
    count: int = 1
    params: int = 0
    params_active: int | None = None
    embedding: bool = False
    flops_forward: int = 0
    flops_backward: int = 0
    flops_recompute: int = 0
    act_floats: int = 0
    act_other_bytes: int = 0

    @property
    def active(self) -> int:
        return self.params if self.params_active is None else self.params_active

    def act_bytes(self, float_bytes: int = FLOAT_BYTES) -> int:
        return self.act_floats * float_bytes + self.act_other_bytes


def linear(name: str, N: int, d_in: int, d_out: int, bias: bool = True,
           input_grad: bool = True) -> Part:
    """y = x W + b on N rows: 2 N d_in d_out forward, 4 N d_in d_out backward (2 without
    the input's gradient: a model's first layer); keeps x."""
    f = 2 * N * d_in * d_out
    return Part(name, params=d_in * d_out + (d_out if bias else 0), flops_forward=f,
                flops_backward=2 * f if input_grad else f, act_floats=N * d_in)


def norm(name: str, kind: str, N: int, d: int) -> Part:
    """LayerNorm (g, b) or RMSNorm (g): keeps xhat (N, d) and 1/std (N, 1)."""
    return Part(name, params=2 * d if kind == "layernorm" else d, act_floats=N * d + N)


def attention(name: str, B: int, T: int, d: int, n_heads: int, selective: bool = False) -> Part:
    """Causal self-attention, full (T, T) scores per head.

    Forward 2 N d 3d (qkv) + 2 B T^2 d (Q K^T) + 2 B T^2 d (A V) + 2 N d^2 (proj);
    backward twice that. Keeps x, qkv (3 N d), A (B h T^2) and the heads' output;
    `selective` (Korthikanti et al. 2022) keeps no A and recomputes Q K^T in backward.
    """
    N = B * T
    f = 2 * N * d * 3 * d + 4 * B * T * T * d + 2 * N * d * d
    scores = 0 if selective else B * n_heads * T * T
    return Part(name, params=3 * d * d + 3 * d + d * d + d, flops_forward=f,
                flops_backward=2 * f, flops_recompute=2 * B * T * T * d if selective else 0,
                act_floats=N * d + 3 * N * d + scores + N * d)


def gelu_ffn(name: str, N: int, d: int, d_ff: int) -> Part:
    """Linear -> GELU -> Linear: keeps x, GELU's input and tanh, and its output."""
    fc, proj = linear("fc", N, d, d_ff), linear("proj", N, d_ff, d)
    return Part(name, params=fc.params + proj.params,
                flops_forward=fc.flops_forward + proj.flops_forward,
                flops_backward=fc.flops_backward + proj.flops_backward,
                act_floats=N * d + 3 * N * d_ff)


def swiglu_ffn(name: str, N: int, d: int, d_ff: int) -> Part:
    """(silu(x W1) * x W3) W2, no biases: 3 matmuls; keeps x, a, b, sigmoid(a)."""
    f = 3 * 2 * N * d * d_ff
    return Part(name, params=3 * d * d_ff, flops_forward=f, flops_backward=2 * f,
                act_floats=N * d + 3 * N * d_ff)


def moe_ffn(name: str, c: TransformerConfig, N: int) -> Part:
    """models/moe.py on N rows: a linear router (d x E, no bias; E bias entries with bias
    balancing), E experts and S shared experts of the dense FFN's shape, k experts a row.

    Parameters: router + (E + S) experts in all, router + (k + S) experts active. FLOPs:
    the router, k N expert rows (k_max N with dynamic k) and S N shared rows. Keeps x (N d),
    p (N E), lse (N), gates (N k), the gathered rows and the expert outputs (2 A d, A = k N
    pairs), the experts' contexts on A rows (3 A d_ff) and the shared ones' (3 S N d_ff);
    int64 choices (N k) and slots (A), a bool mask (N k) with dynamic k. Exact without
    drops; with drops or dynamic k (fewer pairs) the FLOPs and bytes are upper bounds.
    """
    d, f, E, S = c.d_model, c.d_ff, c.moe_experts, c.moe_shared_experts
    k = c.router_options().slots
    expert = (swiglu_ffn if c.ffn == "swiglu" else gelu_ffn)("expert", 1, d, f)  # one row
    router = linear("router", N, d, E, bias=False)
    fixed = router.params + (E if c.moe_bias_rate else 0)
    A = k * N
    rows = A + S * N
    return Part(name, params=fixed + (E + S) * expert.params,
                params_active=fixed + (k + S) * expert.params,
                flops_forward=router.flops_forward + rows * expert.flops_forward,
                flops_backward=router.flops_backward + rows * expert.flops_backward,
                act_floats=N * d + N * E + N + N * k + 2 * A * d + 3 * rows * f,
                act_other_bytes=(N * k + A) * TOKEN_BYTES + (N * k if c.moe_dynamic_p else 0))


def moe_blocks(c: TransformerConfig) -> int:
    """Blocks whose FFN is the MoE layer (TransformerConfig.is_moe)."""
    return sum(c.is_moe(i) for i in range(c.n_layers))


def recomputed(p: Part) -> Part:
    """Under Recompute the part keeps nothing and runs its forward again in backward."""
    return dataclasses.replace(p, flops_recompute=p.flops_forward, act_floats=0,
                               act_other_bytes=0)


def transformer_parts(c: TransformerConfig, B: int) -> list[Part]:
    """models/transformer.py: embedding, n_layers x (ln1, attention, ln2, ffn), ln_f, head.

    Per layer the context keeps 8 N d + 2 N + 3 N d_ff + B heads T^2 floats; under
    Recompute only the block's input (N d). The loss keeps dlogits (N vocab).
    """
    N, d, L = B * c.seq_len, c.d_model, c.n_layers
    L_moe = moe_blocks(c)
    layer = [
        norm("ln1", c.norm, N, d),
        attention("attention", B, c.seq_len, d, c.n_heads, c.selective_recompute),
        norm("ln2", c.norm, N, d),
    ]
    counts = [L] * len(layer)
    if L_moe < L:
        layer.append((swiglu_ffn if c.ffn == "swiglu" else gelu_ffn)(f"ffn ({c.ffn})", N, d,
                                                                      c.d_ff))
        counts.append(L - L_moe)
    if L_moe:
        layer.append(moe_ffn(f"moe ({c.ffn})", c, N))
        counts.append(L_moe)
    if c.recompute:
        layer = [recomputed(p) for p in layer] + [Part("block input", act_floats=N * d)]
        counts.append(L)
    head = linear("head", N, d, c.vocab, bias=False)
    return [
        Part("embedding", params=c.vocab * d + c.seq_len * d, embedding=True,
             act_other_bytes=N * TOKEN_BYTES),
        *(dataclasses.replace(p, name="h." + p.name, count=n)
          for p, n in zip(layer, counts, strict=True)),
        norm("ln_f", c.norm, N, d),
        head,
        Part("loss (dlogits)", act_floats=N * c.vocab),
    ]


def transformer_modules(c: TransformerConfig, B: int) -> list[list[Part]]:
    """The Parts of each module of the transformer's body, in body order: [embedding],
    one list per block (its FFN dense or MoE, as models/transformer.py builds block i),
    [ln_f], [head, loss]. Summed, they are transformer_parts (tests/models/test_cost.py)."""
    N, d = B * c.seq_len, c.d_model
    embedding, *_, ln_f, head, loss = transformer_parts(c, B)

    def block(moe: bool) -> list[Part]:
        ffn = moe_ffn(f"h.moe ({c.ffn})", c, N) if moe else \
            (swiglu_ffn if c.ffn == "swiglu" else gelu_ffn)(f"h.ffn ({c.ffn})", N, d, c.d_ff)
        parts = [norm("h.ln1", c.norm, N, d), attention("h.attention", B, c.seq_len, d,
                                                         c.n_heads, c.selective_recompute),
                 norm("h.ln2", c.norm, N, d), ffn]
        if c.recompute:
            parts = [recomputed(p) for p in parts] + [Part("h.block input", act_floats=N * d)]
        return parts

    return [[embedding], *(block(c.is_moe(i)) for i in range(c.n_layers)), [ln_f],
            [head, loss]]


def mlp_modules(c: MLPConfig, B: int) -> list[list[Part]]:
    """The Parts of each module of the MLP's body: one each, the loss with the last."""
    *modules, loss = mlp_parts(c, B)
    return [[p] for p in modules[:-1]] + [[modules[-1], loss]]


def mlp_parts(c: MLPConfig, B: int) -> list[Part]:
    """models/mlp.py: n_layers x (Linear, activation), Linear out; one row per sample."""
    widths = [c.d_in] + [c.d_hidden] * c.n_layers
    parts = []
    for i in range(c.n_layers):
        parts.append(linear(f"l{i}", B, widths[i], widths[i + 1], input_grad=i > 0))
        h = widths[i + 1]
        if c.activation == "gelu":
            parts.append(Part(f"gelu{i}", act_floats=2 * B * h))
        else:
            parts.append(Part(f"relu{i}", act_other_bytes=B * h))  # bool mask
    parts.append(linear("out", B, widths[-1], c.n_classes, input_grad=c.n_layers > 0))
    parts.append(Part("loss (dlogits)", act_floats=B * c.n_classes))
    return parts


def transformer_palm_flops(c: TransformerConfig, n_matmul_params: int) -> int:
    """6 N + 12 L H Q T per token (Chowdhery et al. 2022, appendix B); H Q = d_model.
    With MoE blocks N counts the active parameters: the experts a token does not use
    are left out."""
    inactive = 0
    if c.moe_experts:
        moe = moe_ffn("moe", c, 1)
        inactive = moe_blocks(c) * (moe.params - moe.active)
    return 6 * (n_matmul_params - inactive) + 12 * c.n_layers * c.d_model * c.seq_len


def mlp_palm_flops(c: MLPConfig, n_matmul_params: int) -> int:
    """6 N per sample: no attention term."""
    return 6 * n_matmul_params


class Recipe(NamedTuple):
    """How to cost one model: its parts, tokens per sample, PaLM FLOPs per token, and
    the parts of each module of its body (what a pipeline stage holds)."""

    parts: Callable[[Any, int], list[Part]]
    tokens_per_sample: Callable[[Any], int]
    palm_flops_per_token: Callable[[Any, int], int]
    modules: Callable[[Any, int], list[list[Part]]]
