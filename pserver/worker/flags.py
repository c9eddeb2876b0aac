"""dtlab-worker's flags: the worker's own (`WorkerConfig`), the compressed push's, the
client's and a model-parallel group's, read into a Setup (`parse_args`), and every refusal
of a combination, next to the flags it concerns.

Flags are those of dtlab.models.run.train (models.session) plus the client's
(pserver.common.config.ClientConfig), the compressed push's (models.compress.CompressConfig),
--worker-id / --num-workers / --local-steps / --dylu / --fragments / --moe-sparse-push and
the group's --tp,
--pp, --pp-schedule, --stages. Without --local-steps the worker never runs the optimizer:
of the optimizer flags it takes --clip only (the servers take --optimizer, --lr, ...; a
--config file's optimizer section is read by the servers and left alone here); with it
they are its inner optimizer's. The servers keep the checkpoints: the worker takes no
--checkpoint-every or --resume.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from dtlab.models.compress import CompressConfig
from dtlab.models.config import ConfigError, add_flags, described, from_namespace
from dtlab.models.run.cli import command_name
from dtlab.models.run.launcher_env import launcher_rank, launcher_size
from dtlab.models.run.session import Setup, parse
from dtlab.models.schedule import SCHEDULES
from dtlab.protos import dtlab_ps_pb2 as pb
from dtlab.pserver.common.config import ClientConfig

DESCRIPTION = "The asynchronous SGD worker: pull from every shard, compute on its own data, push."


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
        if self.dylu and not self.local_steps:
            raise ConfigError("--dylu scales the local steps of each round to this worker's "
                              "speed: give --local-steps H (the fastest worker's H)")
        if self.fragments < 0:
            raise ConfigError(f"--fragments must not be negative (got {self.fragments})")
        if self.fragments and not self.local_steps:
            raise ConfigError("--fragments cuts the outer gradient of local SGD / DiLoCo into "
                              "F pushes a round: give --local-steps H")
        if self.fragments and self.local_steps % self.fragments:
            raise ConfigError(f"--fragments {self.fragments} must divide --local-steps "
                              f"{self.local_steps}: one fragment is pushed every H / F steps")
        if self.fragments and self.dylu:
            raise ConfigError("--fragments with --dylu: Streaming DiLoCo's schedule is fixed "
                              "by H; speed-aware rounds would change it: choose one")
        if self.local_steps and self.moe_sparse_push:
            raise ConfigError("--moe-sparse-push leaves experts out of a step's gradient; "
                              "--local-steps pushes every parameter's change: leave it out")

    def check_with(self, setup: Setup) -> None:
        """This config against the run's other flags: a ConfigError naming both."""
        if is_group(setup) and self.moe_sparse_push:
            raise ConfigError("--moe-sparse-push: a model-parallel worker group (--tp/--pp) "
                              "pushes every parameter; leave it out there")
        if is_group(setup) and self.local_steps:
            raise ConfigError("--local-steps: a model-parallel worker group (--tp/--pp) takes no "
                              "inner steps yet; leave it out there")
        if self.local_steps and setup.run.eval_every % self.local_steps:
            raise ConfigError(f"--eval-every {setup.run.eval_every} must be a multiple of "
                              f"--local-steps {self.local_steps}: the held-out loss is of the "
                              "servers' parameters, which change once per outer round")

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
        if self.moe_sparse_push and not model.moe:
            raise ConfigError(f"--moe-sparse-push needs a Mixture-of-Experts model (--moe-experts "
                              f"above 0); {model_name} has no experts")


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


def add_worker_flags(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, WorkerConfig, "worker")
    add_flags(parser, CompressConfig, "compressed push (pserver.worker.compressed_push)")
    add_flags(parser, ClientConfig, "parameter servers")
    add_group_flags(parser)


def add_group_flags(parser: argparse.ArgumentParser) -> None:
    """--tp, --pp, --pp-schedule, --stages: the worker is a model-parallel group of
    ranks (pserver.worker.group_worker)."""
    grid = parser.add_argument_group("model-parallel worker group (mpiexec; tp x pp ranks "
                                     "per worker)")
    grid.add_argument("--tp", type=int, default=1,
                      help="tensor-parallel ranks per worker group (Megatron-LM split)")
    grid.add_argument("--pp", type=int, default=1,
                      help="pipeline stages per worker group; a step's micro-batches are "
                           "--grad-accum")
    grid.add_argument("--pp-schedule", choices=sorted(SCHEDULES), default=None,
                      help="pipeline schedule: GPipe, 1F1B (PipeDream-Flush, the default) "
                           "or ZB-H1")
    grid.add_argument("--stages", default="",
                      help="modules per stage, e.g. 3,2 (default: balanced by FLOPs)")


def is_group(setup) -> bool:
    """Whether the worker is a model-parallel group (--tp or --pp above 1)."""
    return setup.extra.tp * setup.extra.pp > 1


def check_group_flags(setup: Setup) -> None:
    """--tp and --pp, and the flags that only a group (or only a dense worker) takes."""
    opts = setup.extra
    if opts.tp < 1 or opts.pp < 1:
        raise ConfigError(f"--tp {opts.tp} and --pp {opts.pp} must be positive")
    if is_group(setup) and opts.servers == "auto":
        raise ConfigError("--servers auto launches dense workers; a model-parallel group "
                          "(--tp/--pp) takes --servers HOST:PORT,...")
    if not is_group(setup):
        for flag, value in (("--stages", opts.stages), ("--pp-schedule", opts.pp_schedule)):
            if value:
                raise ConfigError(f"{flag} {value} has no effect without --pp")


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
                  add_extra=add_worker_flags,
                  flags={"data": None, "run": None, "optim": None if local else ("clip",)},
                  why="the servers run the optimizer (give it to python -m dtlab.pserver serve; "
                      "with --local-steps the worker takes its inner optimizer's)")
    if setup.run.checkpoint_every or setup.run.resume:
        raise ConfigError("the servers keep the checkpoints (pserver --checkpoint-dir); the "
                          "worker takes no --checkpoint-every or --resume")
    return setup


def worker_configs(setup: Setup) -> tuple[WorkerConfig, CompressConfig | None]:
    """The worker's config and its compressed push's (None: off), every combination of
    the flags checked; a ConfigError naming the flags that do not go together."""
    wcfg = from_namespace(WorkerConfig, setup.extra)
    check_group_flags(setup)
    wcfg.check_with(setup)
    return wcfg, compress_config(setup)


def compress_config(setup: Setup) -> CompressConfig | None:
    """--compress (None: off); a ConfigError naming what it does not go with."""
    cfg = from_namespace(CompressConfig, setup.extra)
    if not cfg.compress:
        return None
    for dest in ("local_steps", "moe_sparse_push", "wire", "tp", "pp"):
        value = getattr(setup.extra, dest)
        if value is not None and setup.given(dest):
            raise ConfigError(
                f"--compress {cfg.compress} with --{dest.replace('_', '-')} {value}: not "
                "supported (a dense worker's every-step gradient, compressed in the model's "
                "dtype)")
    return cfg
