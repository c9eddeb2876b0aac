"""From command-line flags to everything one training process needs.

All trainers (single-process, sync data-parallel, async worker) and the
parameter-server daemon read one run config the same way:

    --config run.json           the model, data, optimizer and run sections
                                (or a metrics file: its header holds them)
    --model {mlp,transformer}   then that model's config fields (--d-model ...)
    data flags (--data, --path, --label-noise ...), optimizer flags
    (--optimizer, --lr, --warmup ...), run flags (--steps, --batch-size ...)

Flags override the file. Each program takes as flags only the fields that
act in it (a worker takes no optimizer flags but --clip: the servers run the
optimizer), and reads the rest of the file without complaint, so one file
serves every process of a run.

`parse()` returns a Setup (the validated configs); `build_session()` turns it
into a Session: dataset, model, FlatParams, Replica, optimizer, schedule and
this rank's data loader. Building is deterministic in (seed, rank, world).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import numpy as np

from dtlab.models import backend, flag_rules
from dtlab.models.comm import Comm
from dtlab.models.config import (
    ConfigError,
    add_flags,
    check_values,
    choice,
    described,
    from_namespace,
    positive,
)
from dtlab.models.cost import estimate
from dtlab.models.data import DataConfig, ShardedLoader, make_dataset, make_heldout
from dtlab.models.flag_rules import ABSENT, Flag, Rule, rules_of
from dtlab.models.model import Model, Replica
from dtlab.models.moe_ep import ExpertParallel
from dtlab.models.optim import OptimConfig, Optimizer, Schedule, make_optimizer
from dtlab.models.params import FlatParams
from dtlab.models.partition import pipeline_bounds
from dtlab.models.pipeline import PipelineReplica, PipelineStage
from dtlab.models.precision import MixedReplica, make_scaler
from dtlab.models.run.grid_flags import GridConfig
from dtlab.models.run.straggler import parse_straggler
from dtlab.models.schedule import layout
from dtlab.models.zoo import MODELS, build_model


@dataclass
class RunConfig:
    steps: int = described(800, "optimizer steps to run (in all, counting resumed ones)")
    batch_size: int = described(32, "examples per micro-batch on each rank or worker")
    grad_accum: int = described(1, "micro-batches accumulated per optimizer step")
    seed: int = described(0, "initial weights and data order (the data itself: --data-seed)")
    dtype: str = choice("float32", "float32", "float64", help="parameter and compute dtype")
    precision: str = choice("fp32", "fp32", "fp16", "bf16",
                            help="fp16 / bf16: activations and gradients in half precision, "
                                 "float32 master weights and optimizer state (fp16 with "
                                 "dynamic loss scaling; models/precision.py)")
    loss_scale: float = described(65536.0, "fp16: the initial loss scale (2^16)")
    loss_scale_window: int = described(2000, "fp16: grow the loss scale after this many "
                                             "finite steps in a row")
    loss_scale_growth: float = described(2.0, "fp16: factor the loss scale grows by")
    loss_scale_backoff: float = described(0.5, "fp16: factor the loss scale shrinks by when a "
                                               "step's gradients overflow (the step is skipped)")
    log_every: int = described(50, "print a progress line every N steps (off a terminal)")
    metrics: str = described("", "JSON-lines metrics file")
    checkpoint_dir: str = described("", "directory of step-NNNNNN checkpoints")
    checkpoint_every: int = described(0, "write a checkpoint every N steps (0: never)")
    resume: bool = described(False, "go on from the newest checkpoint in --checkpoint-dir "
                                    "that verifies (damaged newer ones are named and skipped)")
    keep: int = described(0, "keep only the newest K checkpoints that verify (0: keep all)")
    eval_every: int = described(0, "held-out loss every N steps and at the end (0: never)")
    straggler: str = described("", "RANK:FACTOR[,RANK:FACTOR...]: that rank (async: worker) "
                                    "computes FACTOR times slower, sleeping the difference "
                                    "each step; lognormal:SIGMA: every rank's FACTOR drawn, "
                                    "exp(|z|) with z ~ N(0, SIGMA^2) seeded by (seed, rank)")
    delay_ms: float = described(0.0, "a random extra delay per step and rank, exponential "
                                     "with this mean in ms, seeded by (seed, rank, step)")
    trace: str = described("", "write a Chrome trace (JSON, opens in Perfetto) here; {rank} "
                               "becomes the process's rank")
    eval_samples: int = described(1024, "held-out examples (fresh draws of the data source, "
                                        "the same for every run of one data config)")

    def validate(self):
        positive(self, "steps", "batch_size", "grad_accum", "log_every")
        if self.checkpoint_every < 0:
            raise ConfigError(
                f"--checkpoint-every must not be negative (got {self.checkpoint_every})")
        positive(self, "eval_samples")
        parse_straggler(self.straggler)
        if self.delay_ms < 0:
            raise ConfigError(f"--delay-ms must not be negative (got {self.delay_ms})")
        if self.eval_every < 0:
            raise ConfigError(f"--eval-every must not be negative (got {self.eval_every})")
        if self.keep < 0:
            raise ConfigError(f"--keep must be 0 (keep all) or a positive count (got {self.keep})")
        positive(self, "loss_scale", "loss_scale_window")
        if self.loss_scale_growth < 1 or not 0 < self.loss_scale_backoff < 1:
            raise ConfigError(f"--loss-scale-growth must be >= 1 and --loss-scale-backoff in "
                              f"(0, 1) (got {self.loss_scale_growth}, "
                              f"{self.loss_scale_backoff})")
        if self.precision != "fp32" and self.dtype != "float32":
            raise ConfigError(f"--precision {self.precision} keeps float32 master weights: "
                              f"give --dtype float32, not {self.dtype}")
        if (self.checkpoint_every or self.resume or self.keep) and not self.checkpoint_dir:
            raise ConfigError("--checkpoint-every, --resume and --keep need --checkpoint-dir")


@dataclass
class Setup:
    """The validated configuration of a run, plus entry-specific flags in `extra`."""

    model_name: str
    model: object
    data: DataConfig
    optim: OptimConfig
    run: RunConfig
    extra: argparse.Namespace
    config_file: str = ""
    defaults: dict = dataclasses.field(default_factory=dict)  # every flag's, by its dest
    configs: tuple = ()  # the program's own configs (parse's `configs`), also in `extra`

    def given(self, dest: str) -> bool:
        """Whether flag `dest` (of a config or of `extra`) differs from its declared default."""
        for part in (self.model, self.data, self.optim, self.run, self.extra):
            if hasattr(part, dest):
                return getattr(part, dest) != self.defaults[dest]
        raise KeyError(dest)

    def config(self, cls: type):
        """This run's config of class `cls`, or None (an MLP run has no TransformerConfig)."""
        return next((part for part in (self.model, self.data, self.optim, self.run,
                                       *self.configs) if isinstance(part, cls)), None)

    def value(self, f: Flag):
        """The run's value of flag `f`, or ABSENT where the run has no config of its class."""
        cfg = self.config(f.owner)
        return ABSENT if cfg is None else getattr(cfg, f.name)

    def check(self, declared: tuple[Rule, ...]) -> None:
        """A Refusal (ConfigError) naming the flags of the first rule the run breaks
        (models/flag_rules.py)."""
        flag_rules.check(declared, self.value)

    def as_dict(self) -> dict:
        parts = ("model", "data", "optim", "run")
        return {"model_name": self.model_name,
                **{k: dataclasses.asdict(getattr(self, k)) for k in parts}}


GROUPS = {"data": DataConfig, "optim": OptimConfig, "run": RunConfig}
# Run fields that name this run's own files: a rerun from a metrics header leaves them out,
# so that it never overwrites the run it was read from.
OWN_FILES = ("metrics", "checkpoint_dir", "checkpoint_every", "resume", "keep", "trace")


def read_config_file(path: str) -> dict:
    """A run config {"model_name", "model", "data", "optim", "run"} (Setup.as_dict()) from a
    JSON file, or from the header line of a metrics file (so a past run can be rerun)."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise ConfigError(f"--config {path}: {e.strerror}") from None
    try:
        record = json.loads(text)
    except json.JSONDecodeError:
        first = text.lstrip().split("\n", 1)[0]
        try:
            record = json.loads(first)
        except json.JSONDecodeError as e:
            raise ConfigError(f"--config {path}: neither a JSON object nor a metrics file "
                              f"({e})") from None
    from_header = isinstance(record, dict) and record.get("type") == "header"
    if from_header:
        record = record.get("config")
    if not isinstance(record, dict):
        raise ConfigError(f"--config {path}: expected a JSON object with the sections "
                          f"model_name, model, {', '.join(GROUPS)}")
    unknown = sorted(set(record) - {"model_name", "model", *GROUPS})
    if unknown:
        raise ConfigError(f"--config {path}: unknown section(s) {', '.join(unknown)} "
                          f"(known: model_name, model, {', '.join(GROUPS)})")
    for name in ("model", *GROUPS):
        if not isinstance(record.get(name, {}), dict):
            raise ConfigError(f"--config {path}: section {name!r} must be an object")
    if from_header:
        record["run"] = {k: v for k, v in record.get("run", {}).items() if k not in OWN_FILES}
    return record


def refuse_inert_flags(parser: argparse.ArgumentParser, rest: list[str],
                       flags: dict[str, tuple[str, ...] | None], why: str = "") -> None:
    """Flags left over by the parser: a config field this program does not take is a
    ConfigError that says so; anything else is argparse's unrecognized-arguments error."""
    for arg in rest:
        name = arg.split("=", 1)[0].removeprefix("--").removeprefix("no-").replace("-", "_")
        for group, cls in GROUPS.items():
            fields = {f.name for f in dataclasses.fields(cls)}
            taken = fields if flags.get(group, ()) is None else set(flags.get(group, ()))
            if arg.startswith("--") and name in fields - taken:
                raise ConfigError(f"{arg.split('=', 1)[0]} has no effect in {parser.prog}"
                                  + (f": {why}" if why else "; see --help"))
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")


def parse(argv: list[str], prog: str, description: str = "",
          add_extra: Callable[[argparse.ArgumentParser], None] | None = None,
          flags: dict[str, tuple[str, ...] | None] | None = None, why: str = "",
          configs: tuple[tuple, ...] = (), rules: tuple[Rule, ...] = ()) -> Setup:
    """Parse `argv` into a Setup. Bad values raise ConfigError; unknown flags exit 2.

    Values come from the defaults, then `--config FILE` (read_config_file),
    then the flags given, each overriding the one before. `flags` maps each
    config group ("data", "optim", "run") to the fields this entry point takes
    as flags (None: all of them); a group left out takes none, and its values
    come from the file or the defaults. Default: every field of every group.
    A flag that would have no effect in this program is refused with `why`.
    `configs` are the program's own config classes, each (class, --help title) or
    (class, title, fields it takes): their flags, their instances in `Setup.configs`
    and their values in `extra`.
    Then the RULES every config class declares, and `rules`, are kept
    (models/flag_rules.py).
    """
    flags = {name: None for name in GROUPS} if flags is None else flags
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--model", choices=sorted(MODELS), default=None)
    pre.add_argument("--config", default="")
    known, _ = pre.parse_known_args(argv)
    file = read_config_file(known.config) if known.config else {}
    model_name = known.model or file.get("model_name", "transformer")
    if model_name not in MODELS:
        raise ConfigError(f"--config {known.config}: unknown model {model_name!r}")
    same_model = model_name == file.get("model_name", model_name)

    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--config", metavar="FILE",
                        help="run config: a JSON object of sections model_name, model, data, "
                             "optim, run, or a metrics file whose header holds one; the flags "
                             "given override it")
    parser.add_argument("--model", choices=sorted(MODELS), default=model_name,
                        help=f"which model to train (its flags follow) (default: {model_name})")
    model_cls = MODELS[model_name].config
    add_flags(parser, model_cls, f"{model_name} model")
    for name, only in flags.items():
        add_flags(parser, GROUPS[name], name, only=only)
    for cls, title, *only in configs:
        add_flags(parser, cls, title, only=only[0] if only else None)
    if add_extra is not None:
        add_extra(parser)
    for name, cls in {"model": model_cls, **GROUPS}.items():
        if name in file and (name != "model" or same_model):
            try:
                check_values(cls, file[name])
            except ConfigError as e:
                raise ConfigError(f"--config {known.config}: section {name}: {e}") from None
    ns, rest = parser.parse_known_args(argv)
    refuse_inert_flags(parser, rest, flags, why)
    model = from_namespace(model_cls, ns, file.get("model") if same_model else None)
    built = {name: from_namespace(cls, ns, file.get(name), only=flags.get(name, ()))
             for name, cls in GROUPS.items()}
    own = []
    for cls, _, *only in configs:  # `extra` holds the values of their flags, defaults too
        taken = only[0] if only else None
        own.append(from_namespace(cls, ns, only=taken))
        vars(ns).update({f.name: getattr(own[-1], f.name) for f in dataclasses.fields(cls)
                         if taken is None or f.name in taken})
    defaults = {a.dest: parser.get_default(a.dest) for a in parser._actions}
    classes = (model_cls, *GROUPS.values(), *(cls for cls, *_ in configs))
    for cls in classes:  # a config's, whatever its flag's default
        defaults.update({f.name: f.default if f.default is not dataclasses.MISSING
                         else f.default_factory() for f in dataclasses.fields(cls)})
    setup = Setup(model_name, model, built["data"], built["optim"], built["run"], ns,
                  known.config, defaults, tuple(own))
    setup.check(rules_of(*classes) + tuple(rules))
    return setup


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
    heldout: list = dataclasses.field(default_factory=list)  # (inputs, targets) batches


@dataclass(frozen=True)
class PipelineSpec:
    """How a pipeline-parallel rank runs: its communicator, the schedule, the split."""

    pp: Comm
    schedule: str = GridConfig.pp_schedule
    stages: str = GridConfig.stages  # --stages "a,b,...": modules per stage; "" balances by FLOPs
    virtual: int | None = GridConfig.virtual_stages  # --virtual-stages: model chunks per rank


def build_session(setup: Setup, rank: int = 0, world: int = 1, tp: Comm | None = None,
                  pipeline: PipelineSpec | None = None,
                  ep: ExpertParallel | None = None) -> Session:
    """Everything data-parallel rank `rank` of `world` needs to train; the data fixes some
    model fields. With a `tp` communicator the model, its parameters and the optimizer
    are this rank's tensor-split shard (starting from the dense model's values); with a
    `pipeline` they are this rank's stage (models/pipeline.py), with its micro-batches
    (--grad-accum) run by the pipeline schedule; with `ep` (models/moe_ep.py) the model
    holds this rank's experts of every MoE layer. Expert-parallel ranks read their own
    data: for a dp x ep grid, `rank` is dp_rank * ep + ep_rank of `world` dp * ep."""
    backend.xp()  # the device the caller chose (grid.select_device: by node rank), or the default
    # held-out first: real data has none, refused before its loader imports scikit-learn
    heldout = heldout_batches(setup) if setup.run.eval_every else []
    dataset, model_cfg = make_dataset(setup.data, setup.model_name, setup.model)
    setup.model = model_cfg
    model = build_model(setup.model_name, model_cfg, tp=tp, ep=ep)
    if pipeline is not None:
        model = PipelineStage(model, stage_bounds(setup, pipeline, len(model.body.modules)),
                              pipeline.pp, layout(pipeline.schedule))
    params = model.init_params(seed=setup.run.seed, dtype=setup.run.dtype)
    if setup.run.precision != "fp32":
        runner = None if pipeline is None else \
            partial(PipelineReplica, model, schedule=pipeline.schedule)
        replica = MixedReplica(model, params, setup.run.precision, make_scaler(setup.run),
                               runner)
    elif pipeline is None:
        replica = Replica(model, params)
    else:
        replica = PipelineReplica(model, params, pipeline.schedule)
    optimizer = make_optimizer(setup.optim, params.data, decay_mask=params.decay_mask())
    loader = ShardedLoader(dataset, setup.run.batch_size, rank=rank, world=world,
                           seed=setup.run.seed, micro_batches=setup.run.grad_accum)
    return Session(setup, dataset, model, params, replica, optimizer,
                   Schedule(setup.optim, setup.run.steps), loader, rank, world, heldout)


def heldout_batches(setup: Setup) -> list:
    """--eval-samples held-out examples in batches of --batch-size (the last one may be
    smaller): every rank and every run of one data config sees the same ones."""
    held = make_heldout(setup.data, setup.model_name, setup.model, setup.run.eval_samples)
    B = setup.run.batch_size
    return [held.batch(np.arange(i, min(i + B, held.n))) for i in range(0, held.n, B)]


def stage_bounds(setup: Setup, pipeline: PipelineSpec, n_modules: int) -> list[int]:
    """The body modules of each stage: --stages as given, else balanced by the cost
    model's FLOPs per module (models/partition.py)."""
    return pipeline_bounds(setup.model_name, setup.model, setup.run.batch_size, n_modules,
                           pipeline.pp.size, pipeline.schedule, pipeline.virtual,
                           pipeline.stages)


def dense_param_count(setup: Setup) -> int:
    """Parameters of the whole unsplit model `setup` describes (no arrays made)."""
    return sum(spec.size for spec in build_model(setup.model_name, setup.model).specs())


def replica_cost(setup: Setup):
    """The cost estimate of one replica's step as `setup` configures it (all
    micro-batches; SGD with momentum keeps one state buffer, without none)."""
    optimizer = setup.optim.optimizer
    if optimizer == "sgd" and setup.optim.momentum > 0:
        optimizer = "sgd-momentum"
    return estimate(setup.model_name, setup.model,
                    setup.run.batch_size * setup.run.grad_accum, optimizer=optimizer)
