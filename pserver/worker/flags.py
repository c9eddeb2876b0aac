"""dtlab-worker's flags: the worker's own (`WorkerConfig`), the compressed push's, the
client's and a model-parallel group's, read into a Setup (`parse_args`); every combination
it refuses is a rule (models/flag_rules.py) declared on the config class holding the flags,
or in GROUP_RULES, and kept by `parse`.

Flags are those of dtlab.models.run.train (models.session) plus the client's
(pserver.common.config.ClientConfig), the compressed push's (models.compress.CompressConfig),
--worker-id / --num-workers / --local-steps / --dylu / --fragments / --moe-sparse-push and
the group's --tp, --pp, --pp-schedule, --stages (models.run.grid_flags.GridConfig's).
Without --local-steps the worker never runs the optimizer:
of the optimizer flags it takes --clip only (the servers take --optimizer, --lr, ...; a
--config file's optimizer section is read by the servers and left alone here); with it
they are its inner optimizer's. The servers keep the checkpoints: the worker takes no
--checkpoint-every or --resume.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from dtlab.models.compress import CompressConfig
from dtlab.models.config import ConfigError, described
from dtlab.models.flag_rules import (
    Conflicts,
    Flag,
    MultipleOf,
    NoEffectWithout,
    Requires,
    at,
    rules,
)
from dtlab.models.run.cli import command_name
from dtlab.models.run.grid_flags import GridConfig
from dtlab.models.run.launcher_env import launcher_rank, launcher_size
from dtlab.models.run.session import RunConfig, Setup, parse
from dtlab.models.transformer import TransformerConfig
from dtlab.protos import dtlab_ps_pb2 as pb
from dtlab.pserver.common.config import ClientConfig

DESCRIPTION = "The asynchronous SGD worker: pull from every shard, compute on its own data, push."
GROUP_FLAGS = ("tp", "pp", "pp_schedule", "stages")  # the worker takes these of GridConfig's
WORKER_GROUP = (Flag("tp", GridConfig), Flag("pp", GridConfig))  # either above 1: a group
LOCAL_STEPS_H = Flag("local_steps", words="--local-steps H")


@rules(
    Requires("dylu", LOCAL_STEPS_H, why="it scales each round's local steps to this "
                                        "worker's speed (H: the fastest worker's)"),
    Requires("fragments", LOCAL_STEPS_H, why="it cuts the outer gradient of local SGD / "
                                             "DiLoCo into F pushes a round"),
    MultipleOf("local_steps", "fragments", why="one fragment is pushed every H / F steps"),
    Conflicts("fragments", "dylu", why="Streaming DiLoCo's schedule is fixed by H; speed-aware "
                                       "rounds would change it: choose one"),
    Conflicts("moe_sparse_push", "local_steps",
              why="it leaves experts out of a step's gradient; --local-steps pushes every "
                  "parameter's change"),
    Requires("moe_sparse_push", Flag("moe_experts", TransformerConfig,
                                     words="a Mixture-of-Experts model (--model transformer "
                                           "--moe-experts N)")),
    Conflicts("moe_sparse_push", WORKER_GROUP, why="a model-parallel worker group pushes every "
                                                   "parameter"),
    Conflicts("local_steps", WORKER_GROUP, why="a model-parallel worker group takes no inner "
                                               "steps yet"),
    MultipleOf(Flag("eval_every", RunConfig), "local_steps",
               why="the held-out loss is of the servers' parameters, which change once per "
                   "outer round"),
    Conflicts(Flag("compress", CompressConfig),
              ("local_steps", "moe_sparse_push", Flag("wire", ClientConfig), *WORKER_GROUP),
              why="not supported (a dense worker's every-step gradient, compressed in the "
                  "model's dtype)"),
)
@dataclass
class WorkerConfig:
    worker_id: int = described(-1, "this worker's id, which picks its data shard "
                                   "(-1: the launcher's rank, else one the servers assign)")
    num_workers: int = described(0, "workers sharing the data (0: the launcher's size, else "
                                    "the servers' --num-workers, else 1)")
    local_steps: int = described(
        0, "local SGD / DiLoCo: take H inner steps with this worker's own optimizer (the "
           "optimizer flags, here) between pushes of the outer gradient, parameters pulled - "
           "local; the servers run --outer-optimizer (0: push every step's gradient)")
    dylu: bool = described(
        False, "speed-aware local steps (DyLU, Liu et al. 2024; pserver.worker.dylu): each "
               "round's steps H_i = max(1, round(H * t_fast / t_i)), t_i this worker's median "
               "inner step time over its last H steps, t_fast the fastest worker's as the "
               "servers answer it; needs --local-steps H")
    fragments: int = described(
        0, "Streaming DiLoCo (Douillard et al. 2025; pserver.worker.streaming): the parameters "
           "in F fragments of whole tensors, each pushed as its outer gradient in its turn "
           "(one every H / F inner steps, a ranged push) to the servers' outer optimizer; "
           "needs --local-steps H (0: off; 1: one fragment, DiLoCo)")
    moe_sparse_push: bool = described(
        False, "Mixture-of-Experts models: push no gradient for the experts that received no "
               "token this step; the servers leave them and their optimizer state as they are "
               "(a lazy update: for SGD without momentum or decay the same as the dense push)")

    def given_id(self) -> int | None:
        """The id from the flag or the launcher; None: the servers assign one."""
        if self.worker_id >= 0:
            return self.worker_id
        return launcher_rank()

    def given_world(self) -> int | None:
        return self.num_workers or launcher_size()

    def data_shard(self, wid: int, servers_world: int) -> tuple[int, int]:
        """(rank, world) of worker `wid`'s data shard; ConfigError where it cannot be told
        apart from another worker's."""
        world = self.given_world() or servers_world
        given = self.given_id() is not None
        if given and world and not wid < world:
            raise ConfigError(f"--worker-id {wid} must be in [0, --num-workers={world})")
        if not world:
            if wid:
                whose = (f"--worker-id {wid}" if given
                         else f"the servers assigned this worker id {wid}, but")
                raise ConfigError(
                    f"{whose} nothing tells how many workers share the data (no --num-workers "
                    f"here or on the servers, no launcher): worker {wid} would read worker 0's "
                    "data. Give --num-workers")
            world = 1
        return wid % world, world

    def validate(self):
        if self.worker_id < -1 or self.num_workers < 0:
            raise ConfigError("--worker-id must be >= -1 and --num-workers >= 0")
        if self.local_steps < 0:
            raise ConfigError(f"--local-steps must not be negative (got {self.local_steps})")
        if self.fragments < 0:
            raise ConfigError(f"--fragments must not be negative (got {self.fragments})")

    def check_metrics(self, metrics: str, launched: bool) -> None:
        """--metrics of a worker the launcher (or the job) started among others."""
        if launched and "{worker}" not in metrics and metrics:
            raise ConfigError(f"--metrics {metrics}: {self.given_world()} launcher ranks "
                              "would share it; put {worker} in the path")

    def check_model(self, model_name: str, model) -> None:
        """This config against the model built."""
        tensors = len(model.specs())
        if self.fragments > tensors:
            raise ConfigError(f"--fragments {self.fragments}: {model_name} has {tensors} "
                              "tensors, and a fragment is at least one whole tensor")


def check_outer(servers_optim: dict) -> None:
    """--local-steps pushes outer gradients: the servers must run an outer optimizer,
    which is SGD with no decay or warm-up at a constant lr (models.outer.OuterConfig
    .as_optim); a ConfigError naming what they run otherwise."""
    o = servers_optim
    if (o.get("optimizer"), o.get("warmup"), o.get("schedule"), o.get("weight_decay")) != \
            ("sgd", 0, "constant", 0.0):
        raise ConfigError(
            f"--local-steps pushes outer gradients (parameters pulled - local ones), but the "
            f"servers run {o.get('optimizer')} with warm-up {o.get('warmup')}, "
            f"{o.get('schedule')} lr, decay {o.get('weight_decay')}: start them with "
            "--outer-optimizer sgd or nesterov")


def check_speed_aware(wcfg: WorkerConfig, consistency: int) -> None:
    """--dylu against the servers' consistency: asynchronous local SGD's (a BSP round
    waits for one push of every worker, which speed-aware rounds of different lengths
    would not bring in step)."""
    if wcfg.dylu and consistency == pb.BSP:
        raise ConfigError("--dylu: the servers run BSP, whose rounds take one outer gradient "
                          "of every worker; speed-aware local steps are for asynchronous "
                          "local SGD (servers with --consistency asp or ssp)")


class ClientFlags(ClientConfig):
    """ClientConfig's flags as given, for the rules that name them: `--servers auto` is
    resolved into addresses later (loop.join_servers), and the ClientConfig built then
    checks the values."""

    def validate(self) -> None:
        """Left to the ClientConfig built from these flags once --servers is resolved."""


# dtlab-worker's config classes, each (class, --help title[, the fields it takes]); the
# rules between their flags are declared on them and in GROUP_RULES
WORKER_CONFIGS = ((WorkerConfig, "worker"),
                  (CompressConfig, "compressed push (pserver.worker.compressed_push)"),
                  (ClientFlags, "parameter servers"),
                  (GridConfig, "model-parallel worker group (mpiexec; tp x pp ranks per worker)",
                   GROUP_FLAGS))
GROUP_RULES = (
    NoEffectWithout(Flag("pp_schedule", GridConfig), Flag("pp", GridConfig)),
    Conflicts(at("servers", "auto", ClientConfig), WORKER_GROUP,
              why="it launches dense workers; a model-parallel group takes --servers "
                  "HOST:PORT,..."),
)


def is_group(setup) -> bool:
    """Whether the worker is a model-parallel group (--tp or --pp above 1)."""
    return setup.extra.tp * setup.extra.pp > 1


def local_steps_given(argv: list[str]) -> int:
    """--local-steps in `argv` (0 when absent): it decides which optimizer flags the
    worker takes."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--local-steps", type=int, default=0)
    return pre.parse_known_args(argv)[0].local_steps


def parse_args(argv: list[str]) -> Setup:
    """The worker's flags (a group's too) as a Setup; ConfigError where they do not fit."""
    local = local_steps_given(argv) > 0  # then the inner optimizer's flags are this worker's
    setup = parse(argv, prog=command_name("dtlab.pserver.worker"), description=DESCRIPTION,
                  flags={"data": None, "run": None, "optim": None if local else ("clip",)},
                  why="the servers run the optimizer (give it to python -m dtlab.pserver serve; "
                      "with --local-steps the worker takes its inner optimizer's)",
                  configs=WORKER_CONFIGS, rules=GROUP_RULES)
    if setup.run.checkpoint_every or setup.run.resume:
        raise ConfigError("the servers keep the checkpoints (pserver --checkpoint-dir); the "
                          "worker takes no --checkpoint-every or --resume")
    if setup.extra.tp < 1 or setup.extra.pp < 1:
        raise ConfigError(f"--tp {setup.extra.tp} and --pp {setup.extra.pp} must be positive")
    return setup


def worker_configs(setup: Setup) -> tuple[WorkerConfig, CompressConfig | None]:
    """The worker's config and its compressed push's (None: off); parse_args refused every
    combination of their flags that does not go together."""
    compress = setup.config(CompressConfig)
    return setup.config(WorkerConfig), compress if compress.compress else None
