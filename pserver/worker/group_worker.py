"""A model-parallel replica as one parameter-server worker: a group of tp x pp MPI ranks.

    mpiexec -n 8 dtlab-worker --tp 2 --pp 2 --servers 127.0.0.1:50051,127.0.0.1:50052 \\
        --model transformer --steps 300 --grad-accum 4 --metrics 'runs/w{worker}.jsonl'

The world is a dp x pp x tp grid (collective.grid.ProcessGrid, tp fastest):
each of its dp groups of tp x pp consecutive ranks holds one replica
(Megatron-LM tensor split, pipeline stages by --pp-schedule over the
--grad-accum micro-batches, exactly as the sync trainer builds them:
models.run.session.build_session) and is one worker to the servers, with
worker id = its dp rank (--worker-id for a launch of one group). The ranks
of a group read the same data: data shard id mod W of W = --num-workers,
else the launch's dp groups (so W groups of batch B x m micro-batches see
what one process with batch W x B x m sees).

Each rank is partition k = pp_rank * tp + tp_rank of its group: it
registers its partition (id, tp x pp, its FlatParams' specs) with every
shard and pulls and pushes only its own flat buffer (pserver.server.partitions
holds one store per partition on every shard). One step, on every rank:

    pull   its partition from every shard (or the values the last push
           brought back); under SSP/BSP the servers hold it until the group
           may read (clocks count groups)
    grads  Replica.compute_grads: the pipeline schedule and tp collectives,
           within the group only
    clip   --clip on the global norm of the group's whole gradient (tp
           shards and pp stages: Model / PipelineStage.clip_grad_norm)
    push   its partition's gradient to every shard, the next pull riding on
           it (PSClient.push_pull). The last step's pull too: a group ends
           holding the servers' parameters after its last push.

Partition 0 of each group writes the metrics ({worker} in --metrics) and the
progress lines. The worker never runs the optimizer (servers do). An error
on any rank ends the whole job (the grid's abort handler). --eval-every
evaluates the held-out loss through the group (every rank, the same steps);
--trace writes one trace per rank ({rank} in the path: the rank in the
launch); --straggler slows a whole group (its seed is the worker's). SIGTERM
or SIGINT (mpiexec forwards it to every rank) lets each group finish the
step in progress (its push applied), agreed among the group's ranks; the
group then deregisters and exits 0 (SIGTERM) or 130 (SIGINT).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import time

import numpy as np
from mpi4py import MPI

from dtlab.collective.grid import GridError, ProcessGrid
from dtlab.collective.transport.failure import FORWARD_S
from dtlab.models.config import ConfigError, build, from_namespace
from dtlab.models.optim import OptimConfig
from dtlab.models.run.loop import Summary
from dtlab.models.run.metrics import MetricsLog, run_header
from dtlab.models.run.session import PipelineSpec, Session, Setup, build_session
from dtlab.models.run.threads import share_cores
from dtlab.models.run.trace import Trace
from dtlab.protos import dtlab_ps_pb2 as pb
from dtlab.pserver.common.config import ClientConfig
from dtlab.pserver.common.partition_specs import specs_json
from dtlab.pserver.worker.client import PSClient
from dtlab.pserver.worker.exchange import PushPull
from dtlab.pserver.worker.flags import WorkerConfig
from dtlab.pserver.worker.loop import Worker, connect, leave, skip_to

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Group:
    """This rank's place: the grid, its worker (group) id, its partition and data shard."""

    grid: ProcessGrid
    wid: int
    partition: int
    count: int
    data_rank: int
    data_world: int


def place(setup: Setup, wcfg: WorkerConfig) -> Group:
    """The grid and this rank's group, or a ConfigError naming the flags."""
    opts = setup.extra
    try:
        grid = ProcessGrid(dp=None, pp=opts.pp, tp=opts.tp)
    except GridError as e:
        raise ConfigError(f"--pp {opts.pp} --tp {opts.tp}: {e}") from None
    groups = grid.dp_size
    if wcfg.worker_id >= 0 and groups > 1:
        raise ConfigError(f"--worker-id {wcfg.worker_id}: this launch holds {groups} worker "
                          "groups, whose ids are their dp ranks; give --worker-id only to a "
                          "launch of one group")
    if groups > 1 and setup.run.metrics and "{worker}" not in setup.run.metrics:
        raise ConfigError(f"--metrics {setup.run.metrics}: {groups} worker groups would share "
                          "it; put {worker} in the path")
    if grid.world.size > 1 and setup.run.trace and "{rank}" not in setup.run.trace:
        raise ConfigError(f"--trace {setup.run.trace}: the launch's {grid.world.size} ranks "
                          "would share it; put {rank} (the rank in the launch) in the path")
    wid = wcfg.worker_id if wcfg.worker_id >= 0 else grid.dp_rank
    world = wcfg.num_workers or groups
    if wid >= world:
        raise ConfigError(f"worker group {wid} must be below --num-workers {world}")
    return Group(grid, wid, grid.pp_rank * opts.tp + grid.tp_rank, opts.tp * opts.pp,
                 wid, world)


def group_min(group: Group, value: int) -> int:
    """The smallest `value` over the group's ranks (over tp, then over pp)."""
    g = group.grid
    return g.pp_comm.mpi.allreduce(g.tp_comm.mpi.allreduce(value, op=MPI.MIN), op=MPI.MIN)


class GroupWorker(Worker):
    """One rank's steps (Worker's): pull its partition, compute with the group, clip by
    the group's global norm, push its partition with the next pull riding on it. The
    last step pulls too, so every rank ends holding the servers' values; only the
    group's rank 0 reports; the group's ranks stop after the same step. Its trace: pid =
    its rank in the launch, {worker} = its group."""

    def __init__(self, session: Session, client: PSClient, group: Group, metrics: MetricsLog,
                 first_step: int):
        self.group = group
        trace = Trace(session.setup.run.trace, pid=group.grid.rank, worker=group.wid,
                      process=f"async worker {group.wid} partition {group.partition}")
        super().__init__(session, metrics, PushPull(session, client, trace, pull_at_end=True),
                         client, group.wid, trace, first_step, is_main=group.partition == 0,
                         agree=self.agree)

    def agree(self, counts: np.ndarray) -> np.ndarray:
        """`counts` summed over the group's ranks (not the other groups': no step of one
        group waits on another's)."""
        g = self.group.grid
        return g.pp_comm.mpi.allreduce(g.tp_comm.mpi.allreduce(counts, op=MPI.SUM), op=MPI.SUM)


def run_group(setup: Setup, wcfg: WorkerConfig, client_cfg: ClientConfig,
              on_name=None) -> tuple[Session, Group, Summary]:
    """Train this rank's partition of its group to --steps; returns its session (holding
    the servers' parameters after the last step), its place and its summary."""
    group = place(setup, wcfg)
    if on_name is not None:
        on_name(f"worker {group.wid} partition {group.partition}")
    threads = share_cores()
    grid, opts = group.grid, setup.extra
    grid.select_device()
    pipeline = PipelineSpec(grid.pp_comm, opts.pp_schedule, opts.stages) \
        if opts.pp > 1 else None
    session = build_session(setup, rank=group.data_rank, world=group.data_world,
                            tp=grid.tp_comm if opts.tp > 1 else None, pipeline=pipeline)
    params = session.params
    layout = pb.PartitionLayout(id=group.partition, count=group.count,
                                specs=specs_json(params.specs))
    client = PSClient(client_cfg, transport=client_cfg.transport, shm=client_cfg.shm,
                      partition=layout, wire_dtype=client_cfg.wire)
    try:
        first = connect(client, setup, group.wid, params)
        try:
            summary = _train(session, client, group, first, client_cfg, threads)
        finally:
            leave(client)
    finally:
        client.close()
    return session, group, summary


def _train(session: Session, client: PSClient, group: Group, first: int,
           client_cfg: ClientConfig, threads) -> Summary:
    first = group_min(group, first)  # a group goes on from the step all its ranks accept
    setup, server, run = session.setup, client.server, session.setup.run
    if first:
        log.info("rejoins at step %d", first)
        skip_to(session, first)
    setup.optim = build(OptimConfig, {**json.loads(server.optim_config or "{}"),
                                      "clip": setup.optim.clip})
    header = run_header(session, "async", worker=group.wid, servers=client_cfg.addresses(),
                        consistency=pb.Consistency.Name(server.consistency).lower(),
                        staleness_bound=server.staleness_bound,
                        schedule_steps=server.schedule_steps, staleness_lr=server.staleness_lr,
                        tp=setup.extra.tp, pp=setup.extra.pp,
                        pp_schedule=setup.extra.pp_schedule if setup.extra.pp > 1 else None,
                        threads=threads.as_dict())
    path = run.metrics.replace("{worker}", str(group.wid)) if group.partition == 0 else ""
    metrics = MetricsLog(path, header, append=first > 0)
    try:
        return GroupWorker(session, client, group, metrics, first).run()
    finally:
        metrics.close()


def main(setup: Setup, client_cfg: ClientConfig, on_name=None) -> int:
    """dtlab-worker --tp/--pp: train this rank's partition; print the group's summary."""
    wcfg = from_namespace(WorkerConfig, setup.extra)
    _, group, summary = run_group(setup, wcfg, client_cfg, on_name)
    if group.partition == 0:
        for line in summary.lines():
            print(f"worker {group.wid}: {line}")
    return summary.exit_code


def end_job(rc: int) -> None:
    """After this rank failed (its line printed): end every rank of the launch, whose
    groups may wait on this one in a collective or on the servers."""
    if MPI.Is_initialized() and MPI.COMM_WORLD.Get_size() > 1:
        time.sleep(FORWARD_S)  # the other ranks' own lines get out before the abort
        if rc == 130:  # "interrupted" says it all: no MPI_Abort banner after it
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stderr.fileno())
        MPI.COMM_WORLD.Abort(rc)
