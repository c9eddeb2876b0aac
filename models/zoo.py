"""The models by name, each with its config class."""

from __future__ import annotations

from models.mlp import MLP, MLPConfig
from models.model import Model
from models.transformer import Transformer, TransformerConfig

MODELS = {
    "mlp": (MLPConfig, MLP),
    "transformer": (TransformerConfig, Transformer),
}


def config_class(name: str):
    return MODELS[name][0]


def build_model(name: str, config) -> Model:
    return MODELS[name][1](config)
