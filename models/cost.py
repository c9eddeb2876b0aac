"""What one training step of a model costs: parameters, FLOPs, memory, tokens.

    dtlab-cost --model transformer --vocab 50257 --seq-len 1024 \\
        --d-model 1024 --n-heads 16 --n-layers 24 --d-ff 4096 --batch-size 8

Counted for *this* implementation, layer by layer (one `Part` per kind of
layer, times how often it occurs), N = rows in the batch (B T tokens for the
transformer, B samples for the MLP):

- FLOPs are matmul FLOPs, 2 m k n per (m, k) @ (k, n), as executed. A Linear
  costs 2 N d_in d_out forward and twice that backward (dW = x^T dy,
  dx = dy W^T). Attention computes the full (T, T) scores, masked half
  included: Q K^T and A V are 2 B T^2 d each forward, dV, dA, dQ, dK
  8 B T^2 d backward. The embedding is a gather (0 FLOPs). Elementwise work
  (norms, softmax, GELU, loss, optimizer) is O(N d) against O(N d^2) and is
  not counted, as in PaLM and Megatron. Recomputation adds one block
  forward per block to the step (hardware FLOPs); MFU uses the model FLOPs
  (forward + backward), as Chowdhery et al. (2022) define it.
- PaLM's per-token count (Chowdhery et al. 2022, appendix B) is given
  beside it: 6 N + 12 L H Q T, with N the parameters that take part in
  matmuls (all but the gathered embedding tables; our head is untied) and
  H Q = d_model. It equals ours up to 6 x (biases + norm gains) per token.
- Activation bytes are the bytes the forward context keeps for backward:
  exactly what `models.memory.context_bytes` measures on the context
  `Model.forward` returns (float32, int64 token ids, bool ReLU masks),
  including the (N, vocab) logit gradient the loss keeps.
- Parameter, gradient and optimizer-state bytes follow ZeRO's accounting
  (Rajbhandari et al. 2020): fp32 keeps 4 + 4 bytes per parameter; mixed
  precision (bf16 or fp16, Micikevicius et al. 2018) keeps 2 + 2 plus a
  4-byte fp32 master copy; optimizer states are fp32 (SGD none, momentum
  one buffer, Adam/AdamW two). Mixed-precision activations are the float
  elements at 2 bytes (an estimate: this code runs float32).
- Compute-optimal tokens: 20 per parameter (Hoffmann et al. 2022).
- Sharded data parallelism (`zero_memory`, `zero_traffic`; `dtlab-cost --zero S --dp N`):
  the per-rank bytes of ZeRO's stages (Rajbhandari et al. 2020, section 5, Figure 1), with
  Psi parameters, N ranks, weights w, gradients g and K bytes of optimizer state per
  parameter (fp32 Adam: w = g = 4, K = 8; mixed precision: w = g = 2 and K = 12, the
  fp32 master copy counted in K as the paper does):

      stage 0 (plain DP)   (w + g + K) Psi
      stage 1 (P_os)       (w + g) Psi + K Psi / N
      stage 2 (P_os+g)     w Psi + (g + K) Psi / N
      stage 3 (P_os+g+p)   (w + g + K) Psi / N

  The paper's example, 7.5B parameters at N = 64 with K = 12: 120, 31.4, 16.6 and
  1.9 GB. Bytes each rank sends per step over a ring, (N - 1)/N of: stage 0, the
  gradient all-reduce's 2 g Psi; stages 1 and 2, a reduce-scatter of the gradients and
  an all-gather of the updated parameters, g Psi + w Psi (2 Psi-equivalents: the
  paper's "same communication volume as DP"); stage 3, the parameters all-gathered
  before forward and again before backward plus the reduce-scatter, 2 w Psi + g Psi (the
  paper's 1.5x). With k micro-batches per step, stages 2 and 3 reduce-scatter (and stage 3
  all-gathers) every micro-batch: k times those terms.

The seed exercise (GPT-2-ish d = n = 1024, B = 8, L = 24; 16 heads,
d_ff = 4d, vocab 50257 where ours needs them):

    figure                       seed's formula     ours
    layer forward FLOPs          240.5 G            240.5 G (same matmuls)
    step FLOPs, 24 layers        17.32 T            17.32 T + head 2.53 T = 19.85 T
    parameters                   302.3 M            302.3 M + 104.0 M embeddings, head, ln_f
    activations / layer          134 MB (bf16)      1,208 MB (fp32), 604 MB at 2 bytes
    activations, whole model     3.22 GB (bf16)     30.7 GB (fp32), logit gradient included

Where we differ: the seed counts the transformer layers only (no embedding
table, position table or LM head); its activation estimate keeps Q, K, V,
one (n, n) map per sequence and the 4d FFN hidden state, while our
implementation keeps, per layer, the attention probabilities of every head
(B heads n^2: 16x the seed's term, the largest), both norms' normalised
inputs, the input of every matmul, and GELU's input and tanh beside its
output: 8 N d + 2 N + 3 N d_ff + B heads n^2 floats. The seed's memory total
adds no logit gradient (N x vocab floats: 1.65 GB here). Both take a
step as 3 x forward for matmuls, and recomputation as +1 forward of the
blocks (the seed's "about 33%"): ours is exact, not approximate, there.

Extending it: a new model registers a `Recipe` (its Parts, tokens per
sample, PaLM count; models/parts.py) with its config and class in
models/zoo.py, the one registry of models. A mixture-of-experts FFN
(models/parts.py `moe_ffn`) is a Part whose `params_active` counts the
router, the k experts a token uses and the shared experts, against all E
experts in `params`; its FLOPs are those of k experts per token. The table
states total and active parameters and their ratio. A tensor- or
pipeline-split model builds the Parts one rank holds.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from dtlab.models.config import ConfigError, as_dict
from dtlab.models.parts import FLOAT_BYTES, Part
from dtlab.models.zoo import MODELS

TOKENS_PER_PARAM = 20  # Hoffmann et al. 2022

# precision -> (bytes per weight, per fp32 master weight, per gradient, per activation float)
PRECISIONS = {"fp32": (4, 0, 4, 4), "bf16": (2, 4, 2, 2), "fp16": (2, 4, 2, 2)}
# optimizer -> fp32 state buffers per parameter
OPTIMIZER_STATES = {"sgd": 0, "sgd-momentum": 1, "adam": 2, "adamw": 2}
ZERO_STAGES = (0, 1, 2, 3)


@dataclass(frozen=True)
class Memory:
    """Bytes held during a step at one precision."""

    weights: int  # the copy forward and backward read
    master: int  # fp32 master weights (mixed precision)
    grads: int
    optimizer: int  # fp32 optimizer states
    activations: int

    @property
    def total(self) -> int:
        return self.weights + self.master + self.grads + self.optimizer + self.activations


@dataclass(frozen=True)
class Cost:
    """The cost of one training step of `batch_size` samples; see the module docstring."""

    model: str
    batch_size: int
    optimizer: str
    tokens_per_step: int
    parts: tuple[Part, ...]
    params_total: int
    params_active: int
    params_embedding: int
    flops_forward: int
    flops_backward: int
    flops_recompute: int
    flops_step: int  # forward + backward + recompute: the matmul FLOPs executed
    flops_per_token_palm: int
    activation_bytes: int  # fp32, as measured by models.memory
    memory: dict[str, Memory]  # precision -> bytes
    optimal_tokens: int
    config: dict

    @property
    def flops_model(self) -> int:
        """Forward + backward without recomputation: the FLOPs MFU divides by."""
        return self.flops_forward + self.flops_backward

    @property
    def flops_palm_step(self) -> int:
        return self.flops_per_token_palm * self.tokens_per_step

    def as_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["parts"] = [dataclasses.asdict(p) for p in self.parts]
        out["memory"] = {k: {**dataclasses.asdict(m), "total": m.total}
                         for k, m in self.memory.items()}
        out.update(flops_model=self.flops_model, flops_palm_step=self.flops_palm_step)
        return out

    def table(self) -> str:
        cfg = " ".join(f"{k}={v}" for k, v in self.config.items())
        per = self.tokens_per_step // self.batch_size
        shape = f"{self.batch_size} x {per} = {self.tokens_per_step:,} tokens" if per > 1 \
            else f"{self.batch_size} samples"
        lines = [
            f"{self.model}: {cfg}",
            f"batch {shape} per step, optimizer {self.optimizer}",
            "",
            f"{'part':<16}{'count':>6}{'params':>10}{'fwd GFLOP':>12}{'bwd GFLOP':>12}"
            f"{'recomp GFLOP':>14}{'act MB':>10}",
        ]
        for p in self.parts:
            lines.append(
                f"{p.name:<16}{p.count:>6}{_si(p.params):>10}{_fmt(p.flops_forward / 1e9):>12}"
                f"{_fmt(p.flops_backward / 1e9):>12}{_fmt(p.flops_recompute / 1e9):>14}"
                f"{_fmt(p.act_bytes() / 1e6):>10}")
        lines += [
            f"{'total':<22}{_si(self.params_total):>10}{_fmt(self.flops_forward / 1e9):>12}"
            f"{_fmt(self.flops_backward / 1e9):>12}{_fmt(self.flops_recompute / 1e9):>14}"
            f"{_fmt(self.activation_bytes / 1e6):>10}",
            "(figures per copy, totals over all copies; matmul FLOPs; act = fp32 bytes kept)",
            "",
            f"parameters       {self.params_total:,} total, {self.params_active:,} active "
            f"({self.params_active / self.params_total:.1%} of the total), "
            f"{self.params_embedding:,} in gathered embedding tables",
            f"FLOPs per step   {_si(self.flops_step)}FLOP executed, "
            f"{_si(self.flops_model)}FLOP model (forward + backward, for MFU)",
            f"PaLM 6N + 12LHQT {_si(self.flops_per_token_palm)}FLOP per token x "
            f"{self.tokens_per_step:,} = {_si(self.flops_palm_step)}FLOP per step",
            f"compute-optimal  {_si(self.optimal_tokens)} tokens "
            f"({TOKENS_PER_PARAM} per parameter, Hoffmann et al. 2022)",
            "",
            f"{'memory (GB)':<12}{'weights':>9}{'master':>9}{'grads':>9}"
            f"{'optim':>9}{'activ':>9}{'total':>9}",
        ]
        for name, m in self.memory.items():
            lines.append(f"{name:<12}" + "".join(
                f"{_fmt(v / 1e9):>9}" for v in (m.weights, m.master, m.grads, m.optimizer,
                                             m.activations, m.total)))
        return "\n".join(lines)


def _fmt(x: float) -> str:
    """A table cell: thousands separated, else 4 significant digits."""
    return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.4g}"


def _si(n: float) -> str:
    """4 significant digits and a decimal prefix: 406.3 M, 19.85 T."""
    for unit, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.4g} {unit}"
    return f"{int(n)} "


def estimate(model_name: str, model_cfg, batch_size: int, optimizer: str = "adamw") -> Cost:
    """The cost of one training step of `batch_size` samples of `model_name`."""
    if model_name not in MODELS:
        raise ConfigError(f"--model must be one of {', '.join(MODELS)}, got {model_name!r}")
    if batch_size <= 0:
        raise ConfigError(f"--batch-size must be positive (got {batch_size})")
    if optimizer not in OPTIMIZER_STATES:
        raise ConfigError(
            f"--optimizer must be one of {', '.join(OPTIMIZER_STATES)}, got {optimizer!r}")
    model_cfg.validate()
    recipe = MODELS[model_name].cost
    parts = tuple(recipe.parts(model_cfg, batch_size))

    def total(attr: str, parts=parts) -> int:
        return sum(p.count * getattr(p, attr) for p in parts)

    params = total("params")
    params_embedding = sum(p.count * p.params for p in parts if p.embedding)
    act_floats, act_other = total("act_floats"), total("act_other_bytes")
    memory = {}
    for name, (w, master, g, a) in PRECISIONS.items():
        memory[name] = Memory(weights=w * params, master=master * params, grads=g * params,
                              optimizer=4 * OPTIMIZER_STATES[optimizer] * params,
                              activations=a * act_floats + act_other)
    fwd, bwd, rec = total("flops_forward"), total("flops_backward"), total("flops_recompute")
    return Cost(
        model=model_name, batch_size=batch_size, optimizer=optimizer,
        tokens_per_step=batch_size * recipe.tokens_per_sample(model_cfg), parts=parts,
        params_total=params, params_active=total("active"), params_embedding=params_embedding,
        flops_forward=fwd, flops_backward=bwd, flops_recompute=rec, flops_step=fwd + bwd + rec,
        flops_per_token_palm=recipe.palm_flops_per_token(model_cfg, params - params_embedding),
        activation_bytes=FLOAT_BYTES * act_floats + act_other, memory=memory,
        optimal_tokens=TOKENS_PER_PARAM * params, config=as_dict(model_cfg),
    )


def zero_memory(params: int, stage: int, dp: int, precision: str = "fp32",
                optimizer: str = "adamw", itemsize: int = 4) -> dict[str, float]:
    """Bytes per rank of ZeRO `stage` over `dp` ranks (the module docstring's table):
    {"weights", "grads", "optimizer", "total"}. fp32 keeps weights, gradients and states in
    `itemsize` bytes (8: --dtype float64); fp16 and bf16 keep 2-byte weights and
    gradients, a 4-byte master copy and 4-byte states (the master counted in
    "optimizer", the paper's K)."""
    _check_zero(stage, dp, precision, optimizer)
    states = OPTIMIZER_STATES[optimizer]
    if precision == "fp32":
        w = g = itemsize
        k = states * itemsize
    else:
        w, master, g, _ = PRECISIONS[precision]
        k = master + 4 * states
    weights = params * w / (dp if stage == 3 else 1)
    grads = params * g / (dp if stage >= 2 else 1)
    opt = params * k / (dp if stage >= 1 else 1)
    return {"weights": weights, "grads": grads, "optimizer": opt,
            "total": weights + grads + opt}


def zero_traffic(params: int, stage: int, dp: int, precision: str = "fp32",
                 micro_batches: int = 1, reshard: bool = True, itemsize: int = 4) -> float:
    """Bytes each rank sends per step under ZeRO `stage` over a ring of `dp` ranks (the
    module docstring): (N - 1)/N times 2 g Psi (stage 0), g Psi + w Psi (stage 1),
    k g Psi + w Psi (stage 2), k (2 w + g) Psi (stage 3; k (w + g) Psi when the gathered
    parameters are kept from forward to backward, `reshard=False`)."""
    _check_zero(stage, dp, precision, "adamw")
    w = g = itemsize if precision == "fp32" else PRECISIONS[precision][0]
    k = micro_batches
    per = {0: 2 * g, 1: g + w, 2: k * g + w, 3: k * ((2 if reshard else 1) * w + g)}[stage]
    return params * per * (dp - 1) / dp


def _check_zero(stage: int, dp: int, precision: str, optimizer: str) -> None:
    if stage not in ZERO_STAGES:
        raise ConfigError(f"--zero must be one of {ZERO_STAGES} (got {stage})")
    if dp < 1:
        raise ConfigError(f"--dp must be a positive integer (got {dp})")
    if precision not in PRECISIONS:
        raise ConfigError(f"--precision must be one of {', '.join(PRECISIONS)}, "
                          f"got {precision!r}")
    if optimizer not in OPTIMIZER_STATES:
        raise ConfigError(
            f"--optimizer must be one of {', '.join(OPTIMIZER_STATES)}, got {optimizer!r}")


PAPER_EXAMPLE = (7_500_000_000, 64, "fp16")  # Rajbhandari et al. 2020, Figure 1: Psi, N, K = 12


def zero_table(params: int, dp: int, optimizer: str = "adamw", stages=ZERO_STAGES) -> str:
    """Per-rank memory and bytes sent per step of each stage at each precision (GB, or MB
    for a model under a GB), then the paper's own example row (7.5B parameters, N = 64,
    mixed-precision Adam)."""
    unit, scale = ("GB", 1e9) if params * 16 >= 1e9 else ("MB", 1e6)
    lines = [f"ZeRO at dp {dp}: bytes per rank ({unit}) and sent per step over the ring "
             f"({unit}); {params:,} parameters, optimizer {optimizer}",
             f"{'precision':<10}{'stage':>6}{'weights':>11}{'grads':>11}{'optim':>11}"
             f"{'total':>11}{'sent':>11}"]
    for precision in PRECISIONS:
        for stage in stages:
            m = zero_memory(params, stage, dp, precision, optimizer)
            sent = zero_traffic(params, stage, dp, precision)
            lines.append(f"{precision:<10}{stage:>6}" + "".join(
                f"{_fmt(v / scale):>11}" for v in (m["weights"], m["grads"], m["optimizer"],
                                                   m["total"], sent)))
    psi, n, precision = PAPER_EXAMPLE
    totals = [zero_memory(psi, s, n, precision, "adam")["total"] / 1e9 for s in ZERO_STAGES]
    lines += ["", f"the paper's example (7.5B parameters, N = {n}, {precision} Adam, K = 12), "
              "total GB per rank, stages 0-3: " + ", ".join(f"{t:.3g}" for t in totals)]
    return "\n".join(lines)
