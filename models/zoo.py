"""The one registry of models: name -> config class, model class and cost recipe.

    from dtlab.models.zoo import MODELS, build_model
    model = build_model("transformer", TransformerConfig(d_model=128))
    model = build_model("transformer", config, tp=grid.tp_comm)     # tensor-split
    model = build_model("transformer", config, ep=ExpertParallel(grid.ep_comm))  # experts split

A new model kind registers here once; every trainer, the parameter server
and the cost estimator (models/cost.py) find it by name.
"""

from __future__ import annotations

from typing import NamedTuple

from dtlab.models.comm import Comm
from dtlab.models.config import ConfigError
from dtlab.models.mlp import MLP, MLPConfig
from dtlab.models.model import Model
from dtlab.models.moe_ep import ExpertParallel
from dtlab.models.parts import (
    Recipe,
    mlp_modules,
    mlp_palm_flops,
    mlp_parts,
    transformer_modules,
    transformer_palm_flops,
    transformer_parts,
)
from dtlab.models.transformer import Transformer, TransformerConfig


class ModelKind(NamedTuple):
    config: type
    build: type[Model]
    cost: Recipe


MODELS = {
    "mlp": ModelKind(MLPConfig, MLP, Recipe(mlp_parts, lambda c: 1, mlp_palm_flops,
                                            mlp_modules)),
    "transformer": ModelKind(TransformerConfig, Transformer,
                             Recipe(transformer_parts, lambda c: c.seq_len,
                                    transformer_palm_flops, transformer_modules)),
}


def config_class(name: str):
    return MODELS[name].config


def check_grid(name: str, config, tp: int = 1, ep: int = 1) -> None:
    """ConfigError naming the flag where a tp-way tensor split or an ep-way expert split
    does not fit model `name`'s config (before any process starts)."""
    MODELS[name].build.check_grid(config, tp, ep)


def build_model(name: str, config, tp: Comm | None = None, ep: ExpertParallel | None = None
                ) -> Model:
    """The dense model, or with `tp` this rank's tensor-split shard of it, or with `ep`
    this rank's experts of it (a model without experts: ConfigError)."""
    if ep is not None:
        if name != "transformer":
            raise ConfigError(f"--ep {ep.comm.size} needs a model with experts "
                              f"(--model transformer --moe-experts N), not --model {name}")
        return MODELS[name].build(config, tp=tp, ep=ep)
    return MODELS[name].build(config) if tp is None else MODELS[name].build(config, tp=tp)
