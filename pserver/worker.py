"""The asynchronous SGD worker: pull from every shard, compute on its own data, push.

    python -m pserver.worker --servers 127.0.0.1:50051,127.0.0.1:50052 --model mlp \\
        --steps 300 --batch-size 32 --seed 0 --worker-id 0 --num-workers 2 --metrics runs/w0.jsonl
    mpiexec -n 4 python -m pserver.worker --servers ... --model mlp --steps 300 \
        --metrics 'runs/w{worker}.jsonl'

One step (Dean et al. 2012, Downpour SGD; Li et al. 2014, ps-lite):

    pull   every shard in parallel, into the flat parameter buffer; a shard
           whose version the worker already holds answers "not modified".
           Under SSP/BSP the server holds the pull until the worker may read.
    grads  Replica.compute_grads on this worker's slice of the global batch
           (ShardedLoader with rank = worker id, world = number of workers,
           so W workers with batch B see what one process with batch W*B sees)
    clip   --clip on this worker's gradient (its global norm)
    push   every shard its slice of params.grad in parallel, each with the
           version it was read at; the servers run the optimizer

The worker never runs the optimizer: of the optimizer flags it takes --clip
only (the servers take --optimizer, --lr, ...; a --config file's optimizer
section is read by the servers and left alone here), and its metrics header
records the optimizer the servers report at Register. Flags are those of
models.train (models.session) plus the client's (pserver.config.ClientConfig)
and --worker-id / --num-workers, which default to the launcher's rank and
size (PMI_RANK/PMI_SIZE, OMPI_COMM_WORLD_*, SLURM_PROCID/SLURM_NTASKS), else
0 and 1; MPI itself is not used. Metrics are the trainer's JSON lines (header,
then step, loss, lr, grad_norm, step_s, compute_s, elapsed_s) plus pull_s,
push_s, and the staleness and version of each shard's push.
"""

from __future__ import annotations

import argparse
import logging
import math
import sys
import time
from dataclasses import dataclass

import grpc
import numpy as np

from models import backend
from models.config import (
    ConfigError,
    add_flags,
    command_name,
    described,
    from_namespace,
    run_cli,
)
from models.launcher import launcher_rank, launcher_size
from models.metrics import MetricsLog, run_header
from models.optim import clip_grad_norm
from models.progress import Progress
from models.session import Session, build_session, parse
from models.threads import share_cores
from models.trainer import Summary
from protos import dtlab_ps_pb2 as pb
from pserver import wire
from pserver.allocator import keep_freed_memory
from pserver.client import PSClient
from pserver.config import ClientConfig
from pserver.errors import PSError

log = logging.getLogger(__name__)

@dataclass
class WorkerConfig:
    worker_id: int = described(-1, "this worker's id, which picks its data shard "
                                   "(-1: the launcher's rank, else 0)")
    num_workers: int = described(0, "workers sharing the data (0: the launcher's size, else 1)")

    def resolve(self) -> tuple[int, int]:
        """(worker id, number of workers), filled in from the launcher's environment."""
        wid = self.worker_id if self.worker_id >= 0 else (launcher_rank() or 0)
        world = self.num_workers or launcher_size() or 1
        if not 0 <= wid < world:
            raise ConfigError(f"--worker-id {wid} must be in [0, --num-workers={world})")
        return wid, world

    def validate(self):
        if self.worker_id < -1 or self.num_workers < 0:
            raise ConfigError("--worker-id must be >= -1 and --num-workers >= 0")


def add_worker_flags(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, WorkerConfig, "worker")
    add_flags(parser, ClientConfig, "parameter servers")


def skip_to(session: Session, step: int) -> None:
    """Put the loader where it would be after `step` steps (a restarted worker)."""
    per_epoch = session.loader.steps_per_epoch
    session.loader.load_state_dict({"epoch": step // per_epoch,
                                    "position": (step % per_epoch) * session.loader.W})


class Worker:
    def __init__(self, session: Session, client: PSClient, wid: int, metrics: MetricsLog):
        self.s, self.client, self.wid, self.metrics = session, client, wid, metrics
        params = session.params
        self.on_device = not isinstance(params.data, np.ndarray)
        self.host = np.empty(params.size, params.dtype) if self.on_device else params.data

    def pull(self) -> None:
        if self.client.pull(self.host) and self.on_device:
            self.s.params.load(self.host)

    def step(self, step: int) -> dict:
        s = self.s
        t0 = time.perf_counter()
        self.pull()
        t1 = time.perf_counter()
        loss = s.replica.compute_grads(s.loader.next())
        if not math.isfinite(loss):
            raise FloatingPointError(f"loss is {loss} at step {step}; lower --lr or enable --clip")
        grad_norm = clip_grad_norm(s.params.grad, s.setup.optim.clip)
        t2 = time.perf_counter()
        replies = self.client.push(backend.to_host(s.params.grad), step)
        t3 = time.perf_counter()
        return {"step": step + 1, "loss": loss, "lr": replies[0].lr, "grad_norm": grad_norm,
                "step_s": t3 - t0, "compute_s": t2 - t1, "pull_s": t1 - t0, "push_s": t3 - t2,
                "staleness": [r.staleness for r in replies],
                "version": [r.version for r in replies]}

    def run(self, first_step: int) -> Summary:
        run = self.s.setup.run
        progress = Progress(run.steps, run.log_every, prefix=f"worker {self.wid}: ")
        start = time.perf_counter()
        losses = []
        for step in range(first_step, run.steps):
            record = self.step(step)
            record["elapsed_s"] = time.perf_counter() - start
            losses.append(record["loss"])
            self.metrics.write(record)
            progress.update(step, record["loss"],
                            f"staleness {max(record['staleness'])}  "
                            f"{record['step_s'] * 1e3:6.1f} ms/step")
        return Summary.of(losses, time.perf_counter() - start, self.s.dataset.floor,
                          run.batch_size * run.grad_accum)


def main(argv: list[str]) -> int:
    setup = parse(argv, prog=command_name("pserver.worker"),
                  description=__doc__.split("\n\n")[0], add_extra=add_worker_flags,
                  flags={"data": None, "run": None, "optim": ("clip",)},
                  why="the servers run the optimizer (give it to python -m pserver serve)")
    if setup.run.checkpoint_every or setup.run.resume:
        raise ConfigError("the servers keep the checkpoints (pserver --checkpoint-dir); the "
                          "worker takes no --checkpoint-every or --resume")
    wcfg = from_namespace(WorkerConfig, setup.extra)
    wid, world = wcfg.resolve()
    metrics_path = setup.run.metrics.replace("{worker}", str(wid))
    if wcfg.worker_id < 0 and world > 1 and metrics_path == setup.run.metrics != "":
        raise ConfigError(f"--metrics {setup.run.metrics}: {world} launcher ranks would share "
                          "it; put {worker} in the path")
    client_cfg = from_namespace(ClientConfig, setup.extra)
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    keep_freed_memory()
    threads = share_cores()
    log.info("worker %d: %s", wid, threads.describe())
    session = build_session(setup, rank=wid, world=world)
    client = PSClient(client_cfg, transport=client_cfg.transport, shm=client_cfg.shm)
    try:
        first = client.connect(wid, setup.model_name, session.params.size,
                               wire.layout_crc(session.params.specs))
        if first:
            log.info("worker %d rejoins at step %d", wid, first)
            skip_to(session, first)
        info = client.shards[0].info
        header = run_header(session, "async", worker=wid, servers=client_cfg.addresses(),
                            consistency=pb.Consistency.Name(info.consistency).lower(),
                            staleness_bound=info.staleness_bound, threads=threads.as_dict())
        metrics = MetricsLog(metrics_path, header, append=first > 0)
        try:
            summary = Worker(session, client, wid, metrics).run(first)
        finally:
            metrics.close()
            leave(client)
    finally:
        client.close()
    for line in summary.lines():
        print(f"worker {wid}: {line}")
    return 0


def leave(client: PSClient) -> None:
    """Deregister, also after a failure, so that SSP/BSP peers stop waiting for us."""
    try:
        client.leave()
    except grpc.RpcError as e:
        log.warning("could not deregister: %s %s", e.code().name, e.details())


def cli() -> int:
    return run_cli(main, command_name("pserver.worker"),
                   user_errors=(FloatingPointError, TimeoutError, PSError, grpc.RpcError),
                   describe=describe_error)


def describe_error(error: BaseException) -> str:
    """A server's refusal as its status and message, not the RPC error's repr."""
    if isinstance(error, grpc.RpcError) and hasattr(error, "code"):
        return f"{error.code().name}: {error.details()}"
    return str(error)


if __name__ == "__main__":
    sys.exit(cli())
