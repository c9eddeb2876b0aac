"""The asynchronous SGD worker: pull from every shard, compute on its own data, push.

    python -m dtlab.pserver.worker --servers 127.0.0.1:50051,127.0.0.1:50052 --model mlp \\
        --steps 300 --batch-size 32 --seed 0 --num-workers 2 --metrics 'runs/w{worker}.jsonl'
    mpiexec -n 4 python -m dtlab.pserver.worker --servers ... --model mlp --steps 300 \
        --metrics 'runs/w{worker}.jsonl'

`--servers auto` takes every shard's address, the worker's id and the number of
workers from the job (pserver.common.rendezvous): an mpiexec MPMD job with the
servers (`mpiexec -n 2 python -m dtlab.pserver serve ... --rendezvous auto : -n 4
python -m dtlab.pserver.worker ... --servers auto`), or with `--rendezvous DIR`
the files the servers wrote there.

One step (Dean et al. 2012, Downpour SGD; Li et al. 2014, ps-lite):

    pull   every shard in parallel, into the flat parameter buffer; a shard
           whose version the worker already holds answers "not modified".
           Under SSP/BSP the server holds the pull until the worker may read.
    grads  Replica.compute_grads on this worker's slice of the global batch
           (ShardedLoader with rank = worker id mod W, world = W workers, so
           W workers with batch B see what one process with batch W*B sees)
    clip   --clip on this worker's gradient (its global norm)
    push   every shard its slice of params.grad in parallel, each with the
           version it was read at; the servers run the optimizer. The next
           step's pull rides on the push (PSClient.push_pull): each shard
           serves it once the push is applied, by the same read rules, and
           answers both at once, so a step costs one round trip per shard;
           the last step pushes alone

Local SGD / DiLoCo (--local-steps H; models.outer): the worker takes H inner
steps with its own optimizer (the optimizer flags, given here, and --clip) and
lr schedule on its own data, from the parameters it pulled, then pushes its
outer gradient, parameters pulled - local ones, and pulls the servers' new
parameters (the next round's start); the servers apply their outer optimizer
(python -m dtlab.pserver serve --outer-optimizer sgd|nesterov --outer-lr L
--outer-momentum M) per push, or under BSP to the round's mean (synchronous
local SGD / DiLoCo). Staleness and versions count outer rounds; steps, losses,
--steps and --eval-every (a multiple of H) count inner steps; a round's
record carries its push's staleness, version, outer_round, push_bytes and
pull_bytes, the other records none. With one worker, H = 1 and outer SGD lr 1
this is plain training bit for bit (models.outer, Exactness).

    python -m dtlab.pserver serve --model mlp --shard 0 --port 50051 \
        --outer-optimizer nesterov --outer-lr 0.7 --outer-momentum 0.9
    python -m dtlab.pserver.worker --servers 127.0.0.1:50051 --model mlp --steps 500 \
        --local-steps 50 --optimizer adamw --lr 1e-3 --worker-id 0 --num-workers 1

With --tp and/or --pp above 1 the worker is a model-parallel group of MPI
ranks, one worker to the servers, each rank pulling and pushing only its own
partition (pserver.worker.group_worker; `mpiexec -n 8 ... --tp 2 --pp 2` makes 2
groups); the rest of this text is about dense workers.

The worker's id: --worker-id, else the launcher's rank (PMI_RANK,
OMPI_COMM_WORLD_RANK, SLURM_PROCID; MPI itself is not used), else one the
servers assign at Register (pserver.server.store: a fresh id, never one that ran
before, and the same on every shard). Two workers never share an id: the
servers refuse a second live registration of one. W, the number of workers
the data is split among: --num-workers, else the launcher's size, else the
servers' --num-workers; with none of them W is 1, and a worker whose id is
not 0 stops with an error rather than read worker 0's data. The data shard
is id mod W (an assigned id past W wraps around, and says so).

Without --local-steps the worker never runs the optimizer: of the optimizer
flags it takes --clip only (the servers take --optimizer, --lr, ...; a
--config file's optimizer section is read by the servers and left alone here). Register checks the
worker's model, data, seed and dtype against the servers' (pserver.common.runconfig)
and answers with the optimizer, schedule and consistency the servers run;
the metrics header records those (config.optim is the servers' optimizer
with this worker's --clip), so it is true and can be rerun with --config.
Flags are those of dtlab.models.run.train (models.session) plus the client's
(pserver.common.config.ClientConfig) and --worker-id / --num-workers. Metrics are
the trainer's JSON lines (header, then step, loss, lr, grad_norm, step_s,
compute_s, elapsed_s) plus pull_s, push_s, and the staleness and version of
each shard's push; push_s includes the next step's pull where it rode on the
push (whose own pull_s is then 0); push_bytes and pull_bytes, the tensor bytes
the step moved (halved by --wire fp16 / bf16: gradients pushed and parameters
pulled rounded to that dtype, the servers keeping float32), and with
--moe-sparse-push expert_push_fraction, the fraction of the experts'
parameters pushed (pserver.worker.expert_push: those no token reached are left out).
With --precision fp16 / bf16 the step runs models.precision's MixedReplica; a
step whose gradients overflow pushes nothing (under BSP, whose round waits for
every worker, a zero gradient), records skipped, and the loss scale shrinks.
Log lines name the worker ("worker 3: ...").
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import time
from dataclasses import dataclass

import grpc
import numpy as np

from dtlab.models import backend
from dtlab.models.compress import CompressConfig
from dtlab.models.config import (
    ConfigError,
    add_flags,
    build,
    described,
    from_namespace,
)
from dtlab.models.data import ShardedLoader
from dtlab.models.optim import OptimConfig
from dtlab.models.outer import outer_gradient, round_ends
from dtlab.models.run import loop as training_loop
from dtlab.models.run.allocator import keep_freed_memory
from dtlab.models.run.cli import command_name, run_cli
from dtlab.models.run.launcher import launcher_rank, launcher_size
from dtlab.models.run.loop import Summary
from dtlab.models.run.metrics import MetricsLog, run_header
from dtlab.models.run.progress import Progress
from dtlab.models.run.session import Session, Setup, build_session, parse
from dtlab.models.run.straggler import Straggler
from dtlab.models.run.threads import share_cores
from dtlab.models.run.trace import Trace
from dtlab.models.schedule import SCHEDULES
from dtlab.protos import dtlab_ps_pb2 as pb
from dtlab.pserver.common import codec as wire
from dtlab.pserver.common import rendezvous, runconfig
from dtlab.pserver.common.config import ClientConfig
from dtlab.pserver.common.errors import PSError
from dtlab.pserver.common.ranges import Ranges
from dtlab.pserver.worker.client import PSClient
from dtlab.pserver.worker.compressed_push import CompressedPush
from dtlab.pserver.worker.expert_push import ExpertPush

log = logging.getLogger(__name__)

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
        if self.local_steps and self.moe_sparse_push:
            raise ConfigError("--moe-sparse-push leaves experts out of a step's gradient; "
                              "--local-steps pushes every parameter's change: leave it out")


def local_steps_given(argv: list[str]) -> int:
    """--local-steps in `argv` (0 when absent): it decides which optimizer flags the
    worker takes."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--local-steps", type=int, default=0)
    return pre.parse_known_args(argv)[0].local_steps


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


class WorkerName(logging.Filter):
    """Puts `who` ("worker 3", or "worker" before the servers assigned the id) on every
    log record, so that the lines of several workers on one console tell who said them."""

    def __init__(self):
        super().__init__()
        self.who = "worker"

    def filter(self, record: logging.LogRecord) -> bool:
        record.who = self.who
        return True


def start_logging() -> WorkerName:
    handler = logging.StreamHandler()
    name = WorkerName()
    handler.addFilter(name)
    handler.setFormatter(logging.Formatter(
        "%(asctime)s %(levelname)s %(who)s: %(name)s: %(message)s"))
    logging.basicConfig(level=logging.INFO, handlers=[handler])
    return name


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


def skip_to(session: Session, step: int) -> None:
    """Put the loader where it would be after `step` steps (a restarted worker)."""
    per_epoch = session.loader.steps_per_epoch
    session.loader.load_state_dict({"epoch": step // per_epoch,
                                    "position": (step % per_epoch) * session.loader.W})


class Worker:
    """One worker's steps. Subclasses (pserver.worker.group_worker) say who reports
    (`main`), whether the last step pulls too (`pull_at_end`) and how ranks agree on
    a stop (`agree`)."""

    main = True  # this process prints progress and the stop line
    pull_at_end = False  # the last step pushes alone: no next step to pull for
    agree = None  # sums stop requests over the ranks that must stop together

    def __init__(self, session: Session, client: PSClient, wid: int, metrics: MetricsLog,
                 sparse_push: bool = False):
        self.s, self.client, self.wid, self.metrics = session, client, wid, metrics
        # --moe-sparse-push: which experts the step's tokens reached (pserver.worker.expert_push)
        self.experts = ExpertPush(session.model.moe, session.params.specs) if sparse_push else None
        params = session.params
        self.on_device = not isinstance(params.data, np.ndarray)
        self.host = np.empty(params.size, params.dtype) if self.on_device else params.data
        self.pulled = False  # whether the parameters came with the last push
        self.last_compute_s = 0.0
        self.late = 0  # BSP with backup workers: pushes some shard dropped as late

    def loaded(self, changed: int) -> None:
        """The pulled host parameters onto the device, if they changed."""
        if changed and self.on_device:
            self.s.params.load(self.host)

    def compute_and_push(self, step: int, last: bool = False,
                         trace: Trace | None = None) -> dict:
        """One step; `last`: push alone (no next step to pull for)."""
        s = self.s
        t0 = time.perf_counter()
        if not self.pulled:
            self.loaded(self.client.pull(self.host))
        t1 = time.perf_counter()
        if self.experts is not None:
            self.experts.begin()
        loss = s.replica.compute_grads(s.loader.next())
        training_loop.check_finite(loss, f"step {step}")
        apply, scaling = s.replica.finish_grads()  # mixed precision: unscaled, overflow checked
        grad_norm = None
        if apply:
            grad_norm = s.model.clip_grad_norm(s.params, s.setup.optim.clip)  # a group's: global
        elif self.client.server.consistency == pb.BSP:
            s.params.grad.fill(0)  # the round waits for every worker's push: this one adds 0
        t2 = time.perf_counter()
        grad = backend.to_host(s.params.grad)
        ranges, pushed = self.pushed()
        self.pulled = False
        sent = (self.client.pushed_bytes, self.client.pulled_bytes)
        if not apply and self.client.server.consistency != pb.BSP:
            replies = []  # an overflowed step pushes nothing; the next step pulls
        elif last:
            replies = self.client.push(grad, step, ranges)
        else:
            replies, changed = self.client.push_pull(grad, step, self.host, ranges)
            self.loaded(changed)
            self.pulled = True
        t3 = time.perf_counter()
        self.last_compute_s = t2 - t1
        if trace is not None:
            trace.span("pull", t0, t1, "comm")
            trace.span("compute", t1, t2, step=step + 1)
            trace.span("push + next pull" if not last else "push", t2, t3, "comm")
        return {"step": step + 1, "loss": loss, "lr": replies[0].lr if replies else None,
                "grad_norm": grad_norm,
                "step_s": t3 - t0, "compute_s": t2 - t1, "pull_s": t1 - t0, "push_s": t3 - t2,
                **self.replied(replies),
                "push_bytes": self.client.pushed_bytes - sent[0],
                "pull_bytes": self.client.pulled_bytes - sent[1], **scaling, **pushed}

    def replied(self, replies: list) -> dict:
        """Each shard's staleness and version of the push; under BSP also `late`, the shards
        that dropped it as late (backup workers: an accepted BSP push has staleness 0)."""
        out = {"staleness": [r.staleness for r in replies],
               "version": [r.version for r in replies]}
        if self.client.server.consistency == pb.BSP:
            out["late"] = sum(r.staleness > 0 and not r.duplicate for r in replies)
            self.late += out["late"]
        return out

    def pushed(self) -> tuple[Ranges | None, dict]:
        """The model's ranges this step pushes (None: all of it) and, with
        --moe-sparse-push, the fraction of the expert parameters among them for the
        step's record."""
        if self.experts is None:
            return None, {}
        ranges, fraction = self.experts.ranges()
        return ranges, {"expert_push_fraction": fraction}

    def run(self, first_step: int) -> Summary:
        """Steps to --steps, or until SIGTERM / SIGINT: the step in progress is finished
        (its push applied), then the worker leaves; the servers keep the state."""
        run = self.s.setup.run
        self.progress = Progress(run.steps, run.log_every, prefix=f"worker {self.wid}: ",
                                 enabled=self.main)
        self.tracer = self.trace()
        self.straggler = Straggler(run.straggler, run.delay_ms, run.seed, self.wid)
        self.paths = None  # the shards' paths (PSClient.paths) as last recorded
        summary = training_loop.train(self, range(first_step, run.steps),
                                      self.s.dataset.floor, run.batch_size * run.grad_accum,
                                      self.agree)
        self.tracer.close()
        if hasattr(self.s.replica, "summary_line"):
            summary.extra_lines.append(self.s.replica.summary_line())
        if self.late:
            summary.extra_lines.append(f"{self.late} pushes to a shard arrived after their "
                                       "BSP round closed and were dropped (backup workers)")
        return summary

    def step(self, step: int) -> dict:
        """The loop's step: the straggler's wait (--straggler), then `compute_and_push`;
        the last step pushes alone unless a subclass pulls at the end too."""
        run, extra = self.s.setup.run, {}
        if self.straggler.active:
            t = time.perf_counter()
            extra["straggle_s"] = self.straggler.wait(step, self.last_compute_s)
            self.tracer.span("straggle", t, time.perf_counter(), "wait")
        last = step == run.steps - 1 and not self.pull_at_end
        return {**self.compute_and_push(step, last, self.tracer), **extra}

    def eval_due(self, step: int) -> bool:
        run = self.s.setup.run
        return training_loop.eval_due(step + 1, run.eval_every, run.steps)

    def report(self, step: int, record: dict) -> list[dict]:
        if (now := self.client.paths()) != self.paths:  # the first step's, then changes
            record["paths"] = self.paths = now
        self.metrics.write(record)
        self.progress.update(step, record["loss"],
                             f"staleness {max(record['staleness'], default=0)}  "
                             f"{record['step_s'] * 1e3:6.1f} ms/step")
        return [record]

    def checkpoint(self, step: int) -> bool:
        return False  # the servers hold the state and checkpoint it

    def stopped(self, signal_name: str, step: int, saved: bool) -> None:
        if self.main:
            log.info("stopped by %s after step %d; the servers keep the parameters",
                     signal_name, step + 1)

    def trace(self) -> Trace:
        """This process's trace (--trace), pid = the worker number."""
        return Trace(self.s.setup.run.trace, pid=self.wid, process=f"async worker {self.wid}")

    def evaluate(self) -> float:
        """The held-out loss of the parameters the servers hold now (after this step's
        push: the ones the next step would read)."""
        t = time.perf_counter()
        if not self.pulled:  # the last step pushed alone
            self.loaded(self.client.pull(self.host))
            self.pulled = True
        loss = self.s.replica.evaluate(self.s.heldout)
        self.tracer.span("eval", t, time.perf_counter())
        return loss


class LocalWorker(Worker):
    """--local-steps H: each step an inner step on this worker's parameters; a round's
    last also pushes the outer gradient and pulls the next round's start. The pulled
    parameters stay in `host` (never the buffer the inner steps change), so a shard that
    answers "not modified" leaves the right values there."""

    def __init__(self, session: Session, client: PSClient, wid: int, metrics: MetricsLog,
                 local_steps: int):
        super().__init__(session, client, wid, metrics)
        params = session.params
        self.H, self.rounds = local_steps, 0
        if not self.on_device:
            self.host = np.empty(params.size, params.dtype)  # (n,) the pulled global
        self.outer_grad = np.empty_like(self.host)  # (n,) pulled - local

    def loaded(self, changed: int) -> None:
        """The pulled global parameters into the (locally changed) ones, always."""
        self.s.params.load(self.host)

    def compute_and_push(self, step: int, last: bool = False,
                         trace: Trace | None = None) -> dict:
        s = self.s
        t0 = time.perf_counter()
        if not self.pulled:  # a round's start that no push brought: the first, a rejoin
            self.loaded(self.client.pull(self.host))
            self.pulled = True
        t1 = time.perf_counter()
        loss = s.replica.compute_grads(s.loader.next())
        training_loop.check_finite(loss, f"step {step}")
        lr = s.schedule(step)
        apply, scaling = s.replica.finish_grads()  # mixed precision: unscaled, overflow checked
        grad_norm = None
        if apply:
            grad_norm = s.model.clip_grad_norm(s.params, s.setup.optim.clip)
            s.optimizer.step(s.params.data, s.params.grad, lr)
        t2 = time.perf_counter()
        self.last_compute_s = t2 - t1
        replies, record = [], {}
        sent = (self.client.pushed_bytes, self.client.pulled_bytes)
        if round_ends(step, self.H, s.setup.run.steps):
            outer_gradient(self.host, backend.to_host(s.params.data), out=self.outer_grad)
            if last:
                replies, self.pulled = self.client.push(self.outer_grad, step), False
            else:
                replies, changed = self.client.push_pull(self.outer_grad, step, self.host)
                self.loaded(changed)
            self.rounds += 1
            record = {"outer_round": self.rounds, "outer_lr": replies[0].lr}
        t3 = time.perf_counter()
        if trace is not None:
            trace.span("pull", t0, t1, "comm")
            trace.span("compute", t1, t2, step=step + 1)
            if replies:
                trace.span("outer push + next pull" if not last else "outer push", t2, t3,
                           "comm")
        return {"step": step + 1, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                "step_s": t3 - t0, "compute_s": t2 - t1, "pull_s": t1 - t0, "push_s": t3 - t2,
                **self.replied(replies), **record,
                "push_bytes": self.client.pushed_bytes - sent[0],
                "pull_bytes": self.client.pulled_bytes - sent[1], **scaling}


def parse_args(argv: list[str]):
    """The worker's flags (a group's too) as a Setup; ConfigError where they do not fit."""
    local = local_steps_given(argv) > 0  # then the inner optimizer's flags are this worker's
    setup = parse(argv, prog=command_name("dtlab.pserver.worker"),
                  description=__doc__.split("\n\n")[0], add_extra=add_worker_flags,
                  flags={"data": None, "run": None, "optim": None if local else ("clip",)},
                  why="the servers run the optimizer (give it to python -m dtlab.pserver serve; "
                      "with --local-steps the worker takes its inner optimizer's)")
    if setup.run.checkpoint_every or setup.run.resume:
        raise ConfigError("the servers keep the checkpoints (pserver --checkpoint-dir); the "
                          "worker takes no --checkpoint-every or --resume")
    return setup


def main(argv: list[str]) -> int:
    setup = parse_args(argv)
    wcfg = from_namespace(WorkerConfig, setup.extra)
    if setup.extra.tp < 1 or setup.extra.pp < 1:
        raise ConfigError(f"--tp {setup.extra.tp} and --pp {setup.extra.pp} must be positive")
    if is_group(setup) and wcfg.moe_sparse_push:
        raise ConfigError("--moe-sparse-push: a model-parallel worker group (--tp/--pp) "
                          "pushes every parameter; leave it out there")
    if is_group(setup) and wcfg.local_steps:
        raise ConfigError("--local-steps: a model-parallel worker group (--tp/--pp) takes no "
                          "inner steps yet; leave it out there")
    compress = compress_config(setup, wcfg)
    if wcfg.local_steps and setup.run.eval_every % wcfg.local_steps:
        raise ConfigError(f"--eval-every {setup.run.eval_every} must be a multiple of "
                          f"--local-steps {wcfg.local_steps}: the held-out loss is of the "
                          "servers' parameters, which change once per outer round")
    if is_group(setup) and setup.extra.servers == "auto":
        raise ConfigError("--servers auto launches dense workers; a model-parallel group "
                          "(--tp/--pp) takes --servers HOST:PORT,...")
    if is_group(setup):  # an MPI program: imports mpi4py only here
        from dtlab.pserver.worker import group_worker

        client_cfg = from_namespace(ClientConfig, setup.extra)
        name = start_logging()
        keep_freed_memory()
        return group_worker.main(setup, client_cfg,
                                 on_name=lambda who: setattr(name, "who", who))
    for flag, value in (("--stages", setup.extra.stages),
                        ("--pp-schedule", setup.extra.pp_schedule)):
        if value:
            raise ConfigError(f"{flag} {value} has no effect without --pp")
    launched = wcfg.worker_id < 0 and (wcfg.given_world() or 1) > 1
    if setup.extra.servers == "auto":
        wcfg, placed = join_servers(setup.extra, wcfg)
        launched = launched or (placed and (wcfg.given_world() or 1) > 1)
    if launched and "{worker}" not in setup.run.metrics and setup.run.metrics:
        raise ConfigError(f"--metrics {setup.run.metrics}: {wcfg.given_world()} launcher ranks "
                          "would share it; put {worker} in the path")
    client_cfg = from_namespace(ClientConfig, setup.extra)
    name = start_logging()
    given = wcfg.given_id()
    if given is not None:
        name.who = f"worker {given}"
    keep_freed_memory()
    threads = share_cores()
    log.info("%s", threads.describe())
    session = build_session(setup)
    if wcfg.moe_sparse_push and not session.model.moe:
        raise ConfigError(f"--moe-sparse-push needs a Mixture-of-Experts model (--moe-experts "
                          f"above 0); {setup.model_name} has no experts")
    pusher = None if compress is None else CompressedPush(compress, session.params.size,
                                                          session.params.dtype)
    client = PSClient(client_cfg, transport=client_cfg.transport, shm=client_cfg.shm,
                      wire_dtype=client_cfg.wire, compress=pusher)
    try:
        first = connect(client, setup, given, session.params)
        wid = client.worker
        name.who = f"worker {wid}"
        if pusher is not None:
            pusher.seed(setup.run.seed, wid)
        try:
            summary = train(session, client, wcfg, first, client_cfg, threads, compress)
        finally:
            leave(client)
    finally:
        client.close()
    for line in summary.lines():
        print(f"worker {wid}: {line}")
    return summary.exit_code


def join_servers(ns, wcfg: WorkerConfig) -> tuple[WorkerConfig, bool]:
    """--servers auto: every shard's address from the job (pserver.common.rendezvous: the
    MPI allgather, or the files of --rendezvous DIR) into `ns.servers`; the worker's id and
    the number of workers from its place in the job, unless given; and whether the job
    placed it (False: launched by hand)."""
    where = ns.rendezvous or ClientConfig.rendezvous
    timeout_s = ns.rendezvous_timeout_s or ClientConfig.rendezvous_timeout_s
    if where == "auto":
        job = rendezvous.MPIJob("worker", timeout_s)
        addresses, place = job.addresses(None), job.place
    else:
        addresses = rendezvous.read_addresses(where, timeout_s)
        place = rendezvous.place_from_env("worker", len(addresses))
    ns.servers = ",".join(addresses)
    if place is None:  # launched by hand: --worker-id / --num-workers, or the servers'
        return wcfg, False
    return dataclasses.replace(
        wcfg, worker_id=place.index if wcfg.worker_id < 0 else wcfg.worker_id,
        num_workers=wcfg.num_workers or place.workers), True


def compress_config(setup: Setup, wcfg: WorkerConfig) -> CompressConfig | None:
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


def train(session: Session, client: PSClient, wcfg: WorkerConfig, first: int,
          client_cfg: ClientConfig, threads, compress: CompressConfig | None = None) -> Summary:
    """Run a registered worker from step `first`: its data shard, header and steps."""
    setup, server, wid = session.setup, client.server, client.worker
    rank, world = wcfg.data_shard(wid, server.num_workers)
    if rank != wid:
        log.info("reads data shard %d of %d (ids past the number of workers wrap around)",
                 rank, world)
    run = setup.run
    session = dataclasses.replace(session, rank=rank, world=world, loader=ShardedLoader(
        session.dataset, run.batch_size, rank=rank, world=world, seed=run.seed,
        micro_batches=run.grad_accum))
    if first:
        log.info("rejoins at step %d", first)
        skip_to(session, first)
    servers_optim = json.loads(server.optim_config or "{}")
    local = {}
    if wcfg.local_steps:  # setup.optim is this worker's inner optimizer
        check_outer(servers_optim)
        local = {"local_steps": wcfg.local_steps, "outer_optim": servers_optim,
                 "outer": json.loads(server.outer_config or "{}")}  # what the servers run
    else:
        setup.optim = build(OptimConfig, {**servers_optim, "clip": setup.optim.clip})
    header = run_header(session, "async", worker=wid, servers=client_cfg.addresses(),
                        consistency=pb.Consistency.Name(server.consistency).lower(),
                        staleness_bound=server.staleness_bound,
                        schedule_steps=server.schedule_steps, staleness_lr=server.staleness_lr,
                        wire=client_cfg.wire, threads=threads.as_dict(), **local,
                        **({"compress": compress.compress,
                            "error_feedback": compress.error_feedback} if compress else {}))
    metrics = MetricsLog(run.metrics.replace("{worker}", str(wid)), header, append=first > 0)
    try:
        if wcfg.local_steps:
            return LocalWorker(session, client, wid, metrics, wcfg.local_steps).run(first)
        return Worker(session, client, wid, metrics, wcfg.moe_sparse_push).run(first)
    finally:
        metrics.close()


def connect(client: PSClient, setup: Setup, worker: int | None, params) -> int:
    """Register `worker` (None: an id assigned by shard 0) with every shard, bringing the
    model's size and layout of `params` and the run config the servers check; the step
    this worker goes on from."""
    return client.connect(worker, setup.model_name, params.size, wire.layout_crc(params.specs),
                          runconfig.run_config(setup.model_name, setup.model, setup.data,
                                               setup.run.seed, setup.run.dtype,
                                               setup.run.steps))


def leave(client: PSClient) -> None:
    """Deregister, also after a failure, so that SSP/BSP peers stop waiting for us."""
    try:
        client.leave()
    except grpc.RpcError as e:
        log.warning("could not deregister: %s %s", e.code().name, e.details())


def cli() -> int:
    rc = run_cli(main, command_name("dtlab.pserver.worker"),
                 user_errors=(FloatingPointError, TimeoutError, PSError, grpc.RpcError,
                              rendezvous.JobFailed),
                 describe=describe_error,  # the servers and workers of its job: end them too
                 on_failure=lambda status, line: rendezvous.end_job(status, line, "worker"))
    group = sys.modules.get("dtlab.pserver.worker.group_worker")  # imported by a group's ranks only
    if rc and group is not None:
        group.end_job(rc)  # the other ranks of the job may wait on this one: end them too
    return rc


def describe_error(error: BaseException) -> str:
    """A server's refusal as its status and message, not the RPC error's repr."""
    if isinstance(error, grpc.RpcError) and callable(getattr(error, "code", None)):
        return f"{error.code().name}: {error.details()}"
    if isinstance(error, PSError):
        return f"{error.status}: {error}"
    return str(error)

