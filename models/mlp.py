"""MLP classifier of configurable depth and width.

    x (B, d_in) -> [Linear -> act] x n_layers -> Linear -> logits (B, n_classes)

Split over a tensor-parallel communicator `tp` (Shoeybi et al. 2019), the
layers alternate column- and row-parallel (models/tensor_parallel.py), so
every other activation is split across the ranks. The output layer is
column-parallel with the vocabulary-parallel cross-entropy when its input is
whole (an even number of hidden layers), row-parallel with the plain
cross-entropy when it comes in split.

    python -m dtlab.models.run.train --model mlp --d-hidden 256 --n-layers 3
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dtlab.models.comm import Comm
from dtlab.models.config import ConfigError, choice, described, positive
from dtlab.models.layers import GELU, Linear, ReLU, Sequential
from dtlab.models.loss import softmax_cross_entropy
from dtlab.models.model import Model
from dtlab.models.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelCrossEntropy,
)


@dataclass
class MLPConfig:
    d_in: int = described(32, "input features (set by --data digits)")
    d_hidden: int = described(256, "width of each hidden layer")
    n_layers: int = described(2, "hidden layers")
    n_classes: int = described(8, "output classes (set by --data digits)")
    activation: str = choice("gelu", "gelu", "relu", help="hidden activation")

    def validate(self):
        positive(self, "d_in", "d_hidden", "n_classes")
        if self.n_layers < 0:
            raise ConfigError(f"--n-layers must not be negative (got {self.n_layers})")


class MLP(Model):
    name = "mlp"

    def __init__(self, config: MLPConfig, tp: Comm | None = None):
        c = config
        act = {"gelu": GELU, "relu": ReLU}[c.activation]
        widths = [c.d_in] + [c.d_hidden] * c.n_layers + [c.n_classes]
        stds = [math.sqrt(2.0 / w) for w in widths[:-2]] + [1.0 / math.sqrt(widths[-2])]
        names = [f"l{i}" for i in range(c.n_layers)] + ["out"]
        if tp is not None:
            return self._split(c, act, widths, stds, names, tp)
        modules = []
        for i, name in enumerate(names):  # He-style init keeps activations O(1) through depth
            modules.append(Linear(name, widths[i], widths[i + 1], std=stds[i],
                                  input_grad=i > 0))  # the input is data: no dx
            if name != "out":
                modules.append(act())
        super().__init__(config, Sequential(modules))

    @staticmethod
    def check_grid(c: MLPConfig, tp: int = 1, ep: int = 1) -> None:
        """ConfigError naming the flag a tp-way split of this config does not fit (an MLP
        has no experts to spread over ep)."""
        if ep > 1:
            raise ConfigError(f"--ep {ep} needs a model with experts (--model transformer "
                              "--moe-experts N), not --model mlp")
        if tp > 1 and c.d_hidden % tp:
            raise ConfigError(f"--d-hidden {c.d_hidden} is not divisible by --tp {tp}")
        if tp > 1 and c.n_layers % 2 == 0 and c.n_classes % tp:
            raise ConfigError(f"--n-classes {c.n_classes} is not divisible by --tp {tp} "
                              f"(the output layer of {c.n_layers} hidden layers is "
                              "column-parallel)")

    def _split(self, c: MLPConfig, act, widths, stds, names, tp: Comm) -> None:
        self.check_grid(c, tp.size)
        modules = []
        for i, name in enumerate(names):  # even layers split by columns, odd ones by rows
            split = ColumnParallelLinear if i % 2 == 0 else RowParallelLinear
            modules.append(split(name, widths[i], widths[i + 1], tp, std=stds[i]))
            if name != "out":
                modules.append(act())
        whole = c.n_layers % 2 == 0  # the output layer's input is whole: its logits are split
        loss = VocabParallelCrossEntropy(tp, c.n_classes) if whole else softmax_cross_entropy
        super().__init__(c, Sequential(modules), loss, tp)
