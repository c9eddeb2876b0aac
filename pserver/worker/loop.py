"""dtlab-worker: an asynchronous SGD worker, the trainer's step with the parameter servers
as its exchange (pserver.worker.exchange: pull, compute on its own data, push).

    python -m dtlab.pserver.worker --servers 127.0.0.1:50051,127.0.0.1:50052 --model mlp \\
        --steps 300 --batch-size 32 --seed 0 --num-workers 2 --metrics 'runs/w{worker}.jsonl'
    mpiexec -n 4 python -m dtlab.pserver.worker --servers ... --model mlp --steps 300 \\
        --metrics 'runs/w{worker}.jsonl'

`--servers auto` takes every shard's address, the worker's id and the number of
workers from the job (pserver.common.rendezvous): an mpiexec MPMD job with the
servers (`mpiexec -n 2 python -m dtlab.pserver serve ... --rendezvous auto : -n 4
python -m dtlab.pserver.worker ... --servers auto`), or with `--rendezvous DIR`
the files the servers wrote there.

The worker's data: Replica.compute_grads on its slice of the global batch
(ShardedLoader with rank = worker id mod W, world = W workers, so W workers with
batch B see what one process with batch W*B sees). Its step is the trainer's
(models/run/trainer.py) with `PushPull` as the exchange, or with --local-steps H
`OuterPushPull` (local SGD / DiLoCo: H inner steps with its own optimizer, then the
outer gradient pushed to servers running --outer-optimizer, under BSP synchronous
local SGD / DiLoCo; staleness and versions count outer rounds, steps, losses,
--steps and --eval-every (a multiple of H) inner steps; with one worker, H = 1 and
outer SGD lr 1 this is plain training bit for bit, models.outer, Exactness):

    python -m dtlab.pserver serve --model mlp --shard 0 --port 50051 \\
        --outer-optimizer nesterov --outer-lr 0.7 --outer-momentum 0.9
    python -m dtlab.pserver.worker --servers 127.0.0.1:50051 --model mlp --steps 500 \\
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
is id mod W (an assigned id past W wraps around, and says so). A worker that
registers again goes on from the step the servers hold for its id.

Register checks the worker's model, data, seed and dtype against the servers'
(pserver.common.runconfig) and answers with the optimizer, schedule and
consistency the servers run; the metrics header records those (config.optim is
the servers' optimizer with this worker's --clip), so it is true and can be
rerun with --config. Metrics are the trainer's JSON lines (header, then step,
loss, lr, grad_norm, step_s, compute_s, elapsed_s) plus the exchange's fields
(pserver.worker.exchange) and, when they change, the shards' paths. With
--precision fp16 / bf16 the step runs models.precision's MixedReplica; a step
whose gradients overflow records skipped, and the loss scale shrinks. Flags:
pserver.worker.flags. Log lines name the worker ("worker 3: ...",
pserver.worker.log_names).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys

import grpc

from dtlab.models.compress import CompressConfig
from dtlab.models.config import build, from_namespace
from dtlab.models.data import ShardedLoader
from dtlab.models.optim import OptimConfig
from dtlab.models.run.allocator import keep_freed_memory
from dtlab.models.run.cli import command_name, run_cli
from dtlab.models.run.loop import Summary
from dtlab.models.run.metrics import MetricsLog, run_header
from dtlab.models.run.progress import Progress
from dtlab.models.run.session import Session, Setup, build_session
from dtlab.models.run.threads import share_cores
from dtlab.models.run.trace import Trace
from dtlab.models.run.trainer import Trainer
from dtlab.protos import dtlab_ps_pb2 as pb
from dtlab.pserver.common import codec as wire
from dtlab.pserver.common import rendezvous, runconfig
from dtlab.pserver.common.config import ClientConfig
from dtlab.pserver.common.errors import PSError
from dtlab.pserver.worker.client import PSClient
from dtlab.pserver.worker.compressed_push import CompressedPush
from dtlab.pserver.worker.exchange import OuterPushPull, PushPull
from dtlab.pserver.worker.flags import (
    WorkerConfig,
    check_outer,
    check_speed_aware,
    is_group,
    parse_args,
    worker_configs,
)
from dtlab.pserver.worker.log_names import start_logging
from dtlab.pserver.worker.streaming import StreamingPushPull

log = logging.getLogger(__name__)


class Worker(Trainer):
    """A registered worker's run: the trainer's loop and step with a push/pull exchange
    from `first_step` on. What differs from a trainer's run is said here: the progress
    and summary are this worker's (its own samples, the late BSP pushes), its records name
    the shards' paths when they change, and a stop leaves the state to the servers."""

    def __init__(self, session: Session, metrics: MetricsLog, exchange: PushPull,
                 client: PSClient, wid: int, trace: Trace, first_step: int = 0,
                 is_main: bool = True, agree=None):
        super().__init__(session, metrics, exchange, is_main=is_main, saves=False,
                         agree=agree, rank=wid, trace=trace)
        run = session.setup.run
        self.client, self.wid, self.start_step = client, wid, first_step
        self.progress = Progress(run.steps, run.log_every, prefix=f"worker {wid}: ",
                                 enabled=is_main)
        self.samples_per_step = run.batch_size * run.grad_accum  # this worker's own
        self.paths = None  # the shards' paths (PSClient.paths) as last recorded

    def run(self) -> Summary:
        """Steps to --steps, or until SIGTERM / SIGINT: the step in progress is finished
        (its push applied), then the worker leaves; the servers keep the state."""
        summary = super().run()
        if self.exchange.late:
            summary.extra_lines.append(f"{self.exchange.late} pushes to a shard arrived after "
                                       "their BSP round closed and were dropped (backup "
                                       "workers)")
        return summary

    def report(self, step: int, record: dict) -> list[dict]:
        if (now := self.client.paths()) != self.paths:  # the first step's, then changes
            record["paths"] = self.paths = now
        settled = self.exchange.settled(record)
        for done in settled:
            self.log.write(done)
            self.progress.update(done["step"] - 1, done["loss"],
                                 f"staleness {max(done['staleness'], default=0)}  "
                                 f"{done['step_s'] * 1e3:6.1f} ms/step")
        return settled

    def stopped(self, signal_name: str, step: int, saved: bool) -> None:
        if self.is_main:
            log.info("stopped by %s after step %d; the servers keep the parameters",
                     signal_name, step + 1)


def main(argv: list[str]) -> int:
    setup = parse_args(argv)
    wcfg, compress = worker_configs(setup)
    if is_group(setup):  # an MPI program: imports mpi4py only here
        from dtlab.pserver.worker import group_worker

        client_cfg = from_namespace(ClientConfig, setup.extra)
        name = start_logging()
        keep_freed_memory()
        return group_worker.main(setup, client_cfg,
                                 on_name=lambda who: setattr(name, "who", who))
    launched = wcfg.worker_id < 0 and (wcfg.given_world() or 1) > 1
    if setup.extra.servers == "auto":
        wcfg, placed = join_servers(setup.extra, wcfg)
        launched = launched or (placed and (wcfg.given_world() or 1) > 1)
    wcfg.check_metrics(setup.run.metrics, launched)
    client_cfg = from_namespace(ClientConfig, setup.extra)
    name = start_logging()
    given = wcfg.given_id()
    if given is not None:
        name.who = f"worker {given}"
    keep_freed_memory()
    threads = share_cores()
    log.info("%s", threads.describe())
    session = build_session(setup)
    wcfg.check_model(setup.model_name, session.model)
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


def train(session: Session, client: PSClient, wcfg: WorkerConfig, first: int,
          client_cfg: ClientConfig, threads,
          compress: CompressConfig | None = None) -> Summary:
    """Run a registered worker from step `first`: its data shard, header, exchange and
    steps."""
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
        check_speed_aware(wcfg, server.consistency)
        local = {"local_steps": wcfg.local_steps, "dylu": wcfg.dylu, "fragments": wcfg.fragments,
                 "outer_optim": servers_optim,
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
    trace = Trace(run.trace, pid=wid, process=f"async worker {wid}")
    exchange = exchange_of(session, client, trace, wcfg)
    try:
        return Worker(session, metrics, exchange, client, wid, trace, first).run()
    finally:
        metrics.close()


def exchange_of(session: Session, client: PSClient, trace: Trace,
                wcfg: WorkerConfig) -> PushPull:
    """The worker's exchange: every step's gradient pushed; or local SGD / DiLoCo's outer
    gradient every H steps (--dylu: H per worker); or Streaming DiLoCo's fragments."""
    if wcfg.fragments:
        return StreamingPushPull(session, client, trace, wcfg.local_steps, wcfg.fragments)
    if wcfg.local_steps:
        return OuterPushPull(session, client, trace, wcfg.local_steps, wcfg.dylu)
    return PushPull(session, client, trace, sparse_push=wcfg.moe_sparse_push)


def skip_to(session: Session, step: int) -> None:
    """Put the loader where it would be after `step` steps (a restarted worker)."""
    per_epoch = session.loader.steps_per_epoch
    session.loader.load_state_dict({"epoch": step // per_epoch,
                                    "position": (step % per_epoch) * session.loader.W})


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
