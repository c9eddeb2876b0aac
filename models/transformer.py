"""Decoder-only, pre-norm, GPT-style language model (Radford et al. 2019).

    tokens (B, T) -> Embedding + learned positions (B, T, d)
      -> n_layers x Block:  x = x + Attn(Norm(x));  x = x + FFN(Norm(x))
      -> Norm -> Linear head (no bias) -> logits (B, T, vocab)

FFN is GELU (d -> d_ff -> d) or SwiGLU, or with --moe-experts N a
Mixture-of-Experts FFN of N such experts (models/moe.py) in every
--moe-every-th block; Norm is LayerNorm or RMSNorm. The output projections
of each block start with std 0.02 / sqrt(2 n_layers), as in GPT-2. The head
is not tied to the embedding, so parameters are laid out in the order
backward finishes them (see Sequential.grad_ready).

Split over a tensor-parallel communicator `tp` (Shoeybi et al. 2019), each
rank holds the vocabulary slice of the embedding and of the head (whose
logits go to the vocabulary-parallel cross-entropy), its heads of every
attention layer and its columns / rows of every FFN (models/
tensor_parallel.py); the norms are replicated. Parameter names and initial
values are the dense model's, sliced.

With an expert-parallel group `ep` (models/moe_ep.py) each rank holds its
--moe-experts / ep experts of every MoE layer and everything else whole. Its
parameters are laid out dense first, in forward order, then the held experts
(split "ep") in forward order: the dense gradients and the expert gradients
are each one contiguous range, averaged over different communicators
(dense over dp x ep, experts over dp), and a bucket reducer's readiness
offsets (the lowest dense offset of each finished module) stay valid for
the dense range. Initial values depend on (seed, name) only, so they are
the single-process model's whatever the layout.

    python -m dtlab.models.run.train --model transformer --d-model 128 --n-heads 4 --n-layers 2
    mpiexec -n 4 python -m dtlab.collective.train --dp 2 --tp 2 --model transformer
    mpiexec -n 4 python -m dtlab.collective.train --dp 2 --ep 2 --moe-experts 8
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from dtlab.models.attention import CausalSelfAttention
from dtlab.models.comm import Comm
from dtlab.models.config import ConfigError, choice, described, non_negative, positive
from dtlab.models.config import flag as flag_of
from dtlab.models.layers import (
    GELU,
    Embedding,
    LayerNorm,
    Linear,
    Module,
    Recompute,
    Residual,
    RMSNorm,
    Sequential,
    SwiGLU,
)
from dtlab.models.model import Model
from dtlab.models.moe import MoE
from dtlab.models.moe_ep import ExpertParallel
from dtlab.models.moe_stats import MoEStats
from dtlab.models.router import RouterOptions
from dtlab.models.tensor_parallel import (
    ColumnParallelLinear,
    ParallelSwiGLU,
    RowParallelLinear,
    VocabParallelCrossEntropy,
    VocabParallelEmbedding,
)


@dataclass
class TransformerConfig:
    vocab: int = described(16, "vocabulary size (set to 256 by --data text)")
    seq_len: int = described(32, "context length in tokens")
    d_model: int = described(64, "residual stream width")
    n_heads: int = described(4, "attention heads (must divide --d-model)")
    n_layers: int = described(2, "transformer blocks")
    d_ff: int = described(256, "feed-forward hidden width")
    ffn: str = choice("gelu", "gelu", "swiglu", help="feed-forward type")
    norm: str = choice("layernorm", "layernorm", "rmsnorm", help="normalisation")
    recompute: bool = described(False, "recompute each block's activations in backward")
    selective_recompute: bool = described(
        False, "keep the linear layers' outputs, recompute attention scores and softmax in "
               "backward (Korthikanti et al. 2022); --recompute recomputes the whole block")
    moe_experts: int = described(0, "experts per Mixture-of-Experts FFN (0: dense FFN)")
    moe_top_k: int = described(2, "experts each token uses (1..--moe-experts)")
    moe_every: int = described(1, "MoE FFN in every k-th block (blocks k, 2k, ...; 1: all)")
    moe_capacity_factor: float = described(
        1.25, "expert capacity = factor x chosen pairs / experts; beyond it pairs are dropped")
    moe_dropless: bool = described(False, "no capacity limit: no pair is dropped")
    moe_dynamic_p: float = described(
        0.0, "dynamic k: the fewest experts whose probability reaches this (0: top-k)")
    moe_k_max: int = described(0, "most experts per token with --moe-dynamic-p (0: --moe-top-k)")
    moe_noise: str = choice("none", "none", "jitter", "gumbel",
                            help="router logit noise in training")
    moe_noise_temperature: float = described(1.0, "scale of the router noise")
    moe_aux_coef: float = described(0.01, "Switch load-balancing loss coefficient")
    moe_z_coef: float = described(0.001, "router z-loss coefficient")
    moe_bias_rate: float = described(
        0.0, "auxiliary-loss-free balancing: selection-bias step per backward (0: off)")
    moe_shared_experts: int = described(0, "always-on shared experts per MoE FFN")
    moe_groups: int = described(
        1, "token groups per micro-batch, capacity and balancing loss per group (one "
           "process's twin of that many data ranks, each a group)")

    def validate(self):
        positive(self, "vocab", "seq_len", "d_model", "n_heads", "n_layers", "d_ff")
        if self.d_model % self.n_heads:
            raise ConfigError(
                f"--d-model {self.d_model} is not divisible by --n-heads {self.n_heads}")
        if self.recompute and self.selective_recompute:
            raise ConfigError("--selective-recompute has no effect with --recompute (the whole "
                              "block is recomputed)")
        self.validate_moe()

    def validate_moe(self):
        non_negative(self, "moe_experts", "moe_k_max", "moe_aux_coef", "moe_z_coef",
                     "moe_bias_rate", "moe_shared_experts")
        positive(self, "moe_every", "moe_capacity_factor", "moe_noise_temperature",
                 "moe_groups")
        if not self.moe_experts:
            changed = [f.name for f in dataclasses.fields(self) if f.name.startswith("moe_")
                       and getattr(self, f.name) != f.default]
            if changed:
                raise ConfigError(f"{flag_of(changed[0])} needs --moe-experts (0: dense FFN)")
            return
        N = self.moe_experts
        if not 1 <= self.moe_top_k <= N:
            raise ConfigError(f"--moe-top-k {self.moe_top_k} must be in 1..--moe-experts {N}")
        if self.moe_every > self.n_layers:
            raise ConfigError(f"--moe-every {self.moe_every} leaves no MoE block among "
                              f"--n-layers {self.n_layers}")
        if not 0 <= self.moe_dynamic_p <= 1:
            raise ConfigError(f"--moe-dynamic-p must be in [0, 1] (got {self.moe_dynamic_p})")
        if self.moe_k_max > N:
            raise ConfigError(f"--moe-k-max {self.moe_k_max} exceeds --moe-experts {N}")
        if self.moe_k_max and not self.moe_dynamic_p:
            raise ConfigError("--moe-k-max needs --moe-dynamic-p")
        default = {f.name: f.default for f in dataclasses.fields(self)}
        if self.moe_dropless and self.moe_capacity_factor != default["moe_capacity_factor"]:
            raise ConfigError("--moe-capacity-factor has no effect with --moe-dropless")
        if self.moe_noise == "none" and \
                self.moe_noise_temperature != default["moe_noise_temperature"]:
            raise ConfigError("--moe-noise-temperature needs --moe-noise jitter or gumbel")

    def is_moe(self, i: int) -> bool:
        """Whether block i (0-based) has the MoE FFN: blocks k-1, 2k-1, ... for --moe-every k."""
        return self.moe_experts > 0 and (i + 1) % self.moe_every == 0

    def router_options(self) -> RouterOptions:
        return RouterOptions(
            n_experts=self.moe_experts, top_k=self.moe_top_k, dynamic_p=self.moe_dynamic_p,
            k_max=self.moe_k_max, noise=self.moe_noise, temperature=self.moe_noise_temperature,
            aux_coef=self.moe_aux_coef, z_coef=self.moe_z_coef, bias_rate=self.moe_bias_rate)


def norm_layer(c: TransformerConfig, name: str) -> Module:
    return LayerNorm(name, c.d_model) if c.norm == "layernorm" else RMSNorm(name, c.d_model)


def moe_layer(c: TransformerConfig, name: str, out_std: float,
              ep: ExpertParallel | None = None, tp: Comm | None = None) -> MoE:
    return MoE(name, c.d_model, c.d_ff, c.router_options(), kind=c.ffn,
               capacity_factor=None if c.moe_dropless else c.moe_capacity_factor,
               shared=c.moe_shared_experts, out_std=out_std, stats=MoEStats(),
               comm=None if ep is None else ep.loads, ep=ep, groups=c.moe_groups, tp=tp)


def ffn_layer(c: TransformerConfig, name: str, out_std: float, tp: Comm | None = None) -> Module:
    if tp is not None:
        if c.ffn == "swiglu":
            return ParallelSwiGLU(name, c.d_model, c.d_ff, tp, out_std=out_std)
        return Sequential([ColumnParallelLinear(f"{name}.fc", c.d_model, c.d_ff, tp), GELU(),
                           RowParallelLinear(f"{name}.proj", c.d_ff, c.d_model, tp,
                                             std=out_std)])
    if c.ffn == "swiglu":
        return SwiGLU(name, c.d_model, c.d_ff, out_std=out_std)
    return Sequential([Linear(f"{name}.fc", c.d_model, c.d_ff), GELU(),
                       Linear(f"{name}.proj", c.d_ff, c.d_model, std=out_std)])


def block(c: TransformerConfig, i: int, tp: Comm | None = None,
          ep: ExpertParallel | None = None) -> Module:
    out_std = 0.02 / math.sqrt(2 * c.n_layers)
    attn = Sequential([norm_layer(c, f"h{i}.ln1"),
                       CausalSelfAttention(f"h{i}.attn", c.d_model, c.n_heads, out_std=out_std,
                                           tp=tp, recompute_scores=c.selective_recompute)])
    ffn = moe_layer(c, f"h{i}.moe", out_std, ep, tp) if c.is_moe(i) \
        else ffn_layer(c, f"h{i}.ffn", out_std, tp)
    ffn = Sequential([norm_layer(c, f"h{i}.ln2"), ffn])
    b = Sequential([Residual(attn), Residual(ffn)])
    return Recompute(b) if c.recompute else b


def check_split(c: TransformerConfig, tp: int) -> None:
    """ConfigError naming the flag whose size the tensor-parallel size does not divide."""
    for flag, value in (("--n-heads", c.n_heads), ("--d-ff", c.d_ff), ("--vocab", c.vocab)):
        if value % tp:
            raise ConfigError(f"{flag} {value} is not divisible by --tp {tp}")


def check_ep(c: TransformerConfig, ep: int) -> None:
    """ConfigError naming the flags when --ep cannot spread this model's experts."""
    if not c.moe_experts:
        raise ConfigError(f"--ep {ep} needs --moe-experts (a dense model has no experts to "
                          "spread)")
    if c.moe_experts % ep:
        raise ConfigError(f"--moe-experts {c.moe_experts} is not divisible by --ep {ep}")


class Transformer(Model):
    name = "transformer"

    @staticmethod
    def check_grid(c: TransformerConfig, tp: int = 1, ep: int = 1) -> None:
        """ConfigError naming the flag a tp- or ep-way split of this config does not fit."""
        if tp > 1:
            check_split(c, tp)
        if ep > 1:
            check_ep(c, ep)

    def __init__(self, config: TransformerConfig, tp: Comm | None = None,
                 ep: ExpertParallel | None = None):
        c = config
        if ep is not None:
            check_ep(c, ep.comm.size)
            self.ep = ep.comm  # a model-parallel dimension: checkpoints per ep rank
        if tp is None:
            modules = [Embedding("wte", c.vocab, c.d_model, max_len=c.seq_len)]
            modules += [block(c, i, ep=ep) for i in range(c.n_layers)]
            modules += [norm_layer(c, "ln_f"), Linear("head", c.d_model, c.vocab, bias=False)]
            super().__init__(config, Sequential(modules))
            return
        check_split(c, tp.size)
        modules = [VocabParallelEmbedding("wte", c.vocab, c.d_model, tp, max_len=c.seq_len)]
        modules += [block(c, i, tp, ep) for i in range(c.n_layers)]
        modules += [norm_layer(c, "ln_f"),
                    ColumnParallelLinear("head", c.d_model, c.vocab, tp, bias=False)]
        super().__init__(config, Sequential(modules), VocabParallelCrossEntropy(tp, c.vocab),
                         tp)
