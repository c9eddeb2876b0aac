"""From command-line flags to everything one training process needs.

All trainers (single-process, sync data-parallel, async worker) and the
parameter-server daemon parse the same flags:

    --model {mlp,transformer}   then that model's config fields (--d-model ...)
    data flags (--data, --path, --label-noise ...), optimizer flags
    (--optimizer, --lr, --warmup ...), run flags (--steps, --batch-size ...)

`parse()` returns a Setup (the validated configs); `build_session()` turns it
into a Session: dataset, model, FlatParams, Replica, optimizer, schedule and
this rank's data loader. Building is deterministic in (seed, rank, world).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

from models import backend
from models.config import ConfigError, add_flags, choice, described, from_namespace, positive
from models.data import DataConfig, ShardedLoader, make_dataset
from models.model import Model, Replica
from models.optim import OptimConfig, Optimizer, Schedule, make_optimizer
from models.params import FlatParams
from models.zoo import MODELS, build_model


@dataclass
class RunConfig:
    steps: int = 800
    batch_size: int = 32
    grad_accum: int = 1
    seed: int = 0
    dtype: str = choice("float32", "float32", "float64", help="parameter and compute dtype")
    log_every: int = 50
    metrics: str = described("", "JSON-lines metrics file")
    checkpoint_dir: str = ""
    checkpoint_every: int = 0
    resume: bool = False

    def validate(self):
        positive(self, "steps", "batch_size", "grad_accum", "log_every")
        if self.checkpoint_every < 0:
            raise ConfigError(
                f"--checkpoint-every must not be negative (got {self.checkpoint_every})")
        if (self.checkpoint_every or self.resume) and not self.checkpoint_dir:
            raise ConfigError("--checkpoint-every and --resume need --checkpoint-dir")


@dataclass
class Setup:
    """The validated configuration of a run, plus entry-specific flags in `extra`."""

    model_name: str
    model: object
    data: DataConfig
    optim: OptimConfig
    run: RunConfig
    extra: argparse.Namespace

    def as_dict(self) -> dict:
        parts = ("model", "data", "optim", "run")
        return {"model_name": self.model_name,
                **{k: dataclasses.asdict(getattr(self, k)) for k in parts}}


def parse(argv: list[str], prog: str, description: str = "",
          add_extra: Callable[[argparse.ArgumentParser], None] | None = None,
          configs: tuple[str, ...] = ("data", "optim", "run")) -> Setup:
    """Parse `argv` into a Setup. Bad values raise ConfigError; unknown flags exit 2.

    `configs` selects which config groups this entry point accepts (the
    parameter-server daemon has no data or run flags, for instance); the
    others keep their defaults.
    """
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--model", choices=sorted(MODELS), default="transformer")
    known, _ = pre.parse_known_args(argv)

    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--model", choices=sorted(MODELS), default="transformer",
                        help="which model to train (its flags follow) (default: transformer)")
    model_cls = MODELS[known.model][0]
    add_flags(parser, model_cls, f"{known.model} model")
    groups = {"data": DataConfig, "optim": OptimConfig, "run": RunConfig}
    for name in configs:
        add_flags(parser, groups[name], f"{name}")
    if add_extra is not None:
        add_extra(parser)
    ns = parser.parse_args(argv)
    built = {name: from_namespace(cls, ns) if name in configs else cls()
             for name, cls in groups.items()}
    return Setup(known.model, from_namespace(model_cls, ns), built["data"], built["optim"],
                 built["run"], ns)


@dataclass
class Session:
    setup: Setup
    dataset: object
    model: Model
    params: FlatParams
    replica: Replica
    optimizer: Optimizer
    schedule: Schedule
    loader: ShardedLoader
    rank: int
    world: int


def build_session(setup: Setup, rank: int = 0, world: int = 1) -> Session:
    """Everything rank `rank` of `world` needs to train; the data fixes some model fields."""
    backend.select()
    dataset, model_cfg = make_dataset(setup.data, setup.model_name, setup.model)
    setup.model = model_cfg
    model = build_model(setup.model_name, model_cfg)
    params = model.init_params(seed=setup.run.seed, dtype=setup.run.dtype)
    optimizer = make_optimizer(setup.optim, params.data, decay_mask=params.decay_mask())
    loader = ShardedLoader(dataset, setup.run.batch_size, rank=rank, world=world,
                           seed=setup.run.seed, micro_batches=setup.run.grad_accum)
    return Session(setup, dataset, model, params, Replica(model, params), optimizer,
                   Schedule(setup.optim, setup.run.steps), loader, rank, world)
