"""Decoder-only, pre-norm, GPT-style language model (Radford et al. 2019).

    tokens (B, T) -> Embedding + learned positions (B, T, d)
      -> n_layers x Block:  x = x + Attn(Norm(x));  x = x + FFN(Norm(x))
      -> Norm -> Linear head (no bias) -> logits (B, T, vocab)

FFN is GELU (d -> d_ff -> d) or SwiGLU; Norm is LayerNorm or RMSNorm. The
output projections of each block start with std 0.02 / sqrt(2 n_layers), as
in GPT-2. The head is not tied to the embedding, so parameters are laid out
in the order backward finishes them (see Sequential.grad_ready).

Split over a tensor-parallel communicator `tp` (Shoeybi et al. 2019), each
rank holds the vocabulary slice of the embedding and of the head (whose
logits go to the vocabulary-parallel cross-entropy), its heads of every
attention layer and its columns / rows of every FFN (models/
tensor_parallel.py); the norms are replicated. Parameter names and initial
values are the dense model's, sliced.

    python -m dtlab.models.run.train --model transformer --d-model 128 --n-heads 4 --n-layers 2
    mpiexec -n 4 python -m dtlab.collective.train --dp 2 --tp 2 --model transformer
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dtlab.models.attention import CausalSelfAttention
from dtlab.models.comm import Comm
from dtlab.models.config import ConfigError, choice, described, positive
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

    def validate(self):
        positive(self, "vocab", "seq_len", "d_model", "n_heads", "n_layers", "d_ff")
        if self.d_model % self.n_heads:
            raise ConfigError(
                f"--d-model {self.d_model} is not divisible by --n-heads {self.n_heads}")


def norm_layer(c: TransformerConfig, name: str) -> Module:
    return LayerNorm(name, c.d_model) if c.norm == "layernorm" else RMSNorm(name, c.d_model)


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


def block(c: TransformerConfig, i: int, tp: Comm | None = None) -> Module:
    out_std = 0.02 / math.sqrt(2 * c.n_layers)
    attn = Sequential([norm_layer(c, f"h{i}.ln1"),
                       CausalSelfAttention(f"h{i}.attn", c.d_model, c.n_heads, out_std=out_std,
                                           tp=tp)])
    ffn = Sequential([norm_layer(c, f"h{i}.ln2"), ffn_layer(c, f"h{i}.ffn", out_std, tp)])
    b = Sequential([Residual(attn), Residual(ffn)])
    return Recompute(b) if c.recompute else b


def check_split(c: TransformerConfig, tp: Comm) -> None:
    """ConfigError naming the flag whose size the tensor-parallel size does not divide."""
    for flag, value in (("--n-heads", c.n_heads), ("--d-ff", c.d_ff), ("--vocab", c.vocab)):
        if value % tp.size:
            raise ConfigError(f"{flag} {value} is not divisible by --tp {tp.size}")


class Transformer(Model):
    name = "transformer"

    def __init__(self, config: TransformerConfig, tp: Comm | None = None):
        c = config
        if tp is None:
            modules = [Embedding("wte", c.vocab, c.d_model, max_len=c.seq_len)]
            modules += [block(c, i) for i in range(c.n_layers)]
            modules += [norm_layer(c, "ln_f"), Linear("head", c.d_model, c.vocab, bias=False)]
            super().__init__(config, Sequential(modules))
            return
        check_split(c, tp)
        modules = [VocabParallelEmbedding("wte", c.vocab, c.d_model, tp, max_len=c.seq_len)]
        modules += [block(c, i, tp) for i in range(c.n_layers)]
        modules += [norm_layer(c, "ln_f"),
                    ColumnParallelLinear("head", c.d_model, c.vocab, tp, bias=False)]
        super().__init__(config, Sequential(modules), VocabParallelCrossEntropy(tp, c.vocab),
                         tp)
