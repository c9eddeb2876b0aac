"""MLP classifier of configurable depth and width.

    x (B, d_in) -> [Linear -> act] x n_layers -> Linear -> logits (B, n_classes)

    python -m dtlab.models.run.train --model mlp --d-hidden 256 --n-layers 3
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dtlab.models.config import ConfigError, choice, described, positive
from dtlab.models.layers import GELU, Linear, ReLU, Sequential
from dtlab.models.model import Model


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

    def __init__(self, config: MLPConfig):
        c = config
        act = {"gelu": GELU, "relu": ReLU}[c.activation]
        widths = [c.d_in] + [c.d_hidden] * c.n_layers
        modules = []
        for i in range(c.n_layers):
            # He-style init keeps activations O(1) through depth
            modules += [Linear(f"l{i}", widths[i], widths[i + 1], std=math.sqrt(2.0 / widths[i])),
                        act()]
        modules.append(Linear("out", widths[-1], c.n_classes, std=1.0 / math.sqrt(widths[-1])))
        super().__init__(config, Sequential(modules))
