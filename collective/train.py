"""Synchronous data-parallel training over MPI.

    mpiexec -n 4 python -m dtlab.collective.train --model transformer --steps 600 --seed 0 \
        --metrics runs/sync.jsonl [--allreduce ring|naive|mpi] [--bucket-mb 25] [--no-overlap]

Every rank holds a full replica. Rank 0's initial parameters are broadcast
and every rank checks a checksum; each rank reads its own shard of every
global batch; after backward the gradient buffer is averaged across ranks
in buckets (our ring all-reduce by default, started for each bucket as soon
as backward has produced it unless --no-overlap), so every replica takes
the same optimizer step. With N ranks of per-rank batch B this is the same
computation as one process with batch N*B (Goyal et al. 2017), up to the
order of floating-point sums.

Rank 0 writes the metrics (per-step time split into compute, communication
and waiting) and checkpoints. An exception on any rank aborts the whole job.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
from dtlab.collective.buckets import BucketReducer
from dtlab.collective.comm import ALGOS, Communicator
from dtlab.collective.failure import FORWARD_S
from dtlab.collective.grid import ProcessGrid
from dtlab.models.config import ConfigError
from dtlab.models.data.dataset import in_words
from dtlab.models.run.checkpoint import CheckpointError
from dtlab.models.run.cli import command_name, run_cli
from dtlab.models.run.metrics import MetricsLog, run_header
from dtlab.models.run.session import build_session, parse, replica_cost
from dtlab.models.run.threads import share_cores
from dtlab.models.run.trainer import Trainer
from mpi4py import MPI

INTERRUPTED = 130


def add_sync_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sync data parallelism")
    group.add_argument("--allreduce", choices=ALGOS, default="ring",
                       help="gradient all-reduce: ours (ring), reduce+bcast (naive), MPI's own")
    group.add_argument("--bucket-mb", type=float, default=25.0,
                       help="gradient bucket size in MB (1e6 bytes)")
    group.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=True,
                       help="start a bucket's all-reduce as soon as backward has produced it")
    group.add_argument("--collective-timeout", type=float, default=None,
                       help="seconds before a stalled collective aborts the job "
                            "(default: DTLAB_COLLECTIVE_TIMEOUT or 600; 0 disables)")


class DataParallelReducer:
    """Adapts BucketReducer to the trainer: averages gradients and logged scalars."""

    def __init__(self, comm: Communicator, grad, bucket_bytes: int, algo: str, overlap: bool):
        self.comm = comm
        self.buckets = BucketReducer(comm, grad, bucket_bytes=bucket_bytes, algo=algo,
                                     overlap=overlap)
        self.ready = self.buckets.ready
        self._scalar = np.zeros(1)

    def wait(self) -> dict:
        t = self.buckets.wait()
        return {"comm_s": t.comm_s, "wait_s": t.wait_s}

    def average(self, value: float) -> float:
        self._scalar[0] = value
        return float(self.comm.allreduce(self._scalar, average=True, algo="mpi")[0])

    def close(self) -> None:
        self.buckets.close()


def check_replicas_agree(comm: Communicator, params, when: str) -> None:
    """Every rank's parameter checksum equals rank 0's, or an error naming the ranks."""
    sums = comm.mpi.allgather(params.checksum())
    bad = [r for r, s in enumerate(sums) if s != sums[0]]
    if bad:
        raise RuntimeError(f"replicas disagree {when}: ranks {bad} differ from rank 0 "
                           f"(checksums {[hex(s) for s in sums]})")


def main(argv: list[str]) -> int:
    setup = parse(argv, prog=command_name("dtlab.collective.train"),
                  description=__doc__.split("\n\n")[0], add_extra=add_sync_flags)
    opts = setup.extra
    if opts.bucket_mb <= 0:
        raise ConfigError(f"--bucket-mb must be positive (got {opts.bucket_mb})")
    threads = share_cores()
    grid = ProcessGrid(timeout=opts.collective_timeout)
    grid.select_device()
    comm, rank = grid.dp_comm, grid.dp_rank
    session = build_session(setup, rank=rank, world=grid.dp_size)
    params = session.params

    flops_per_step = replica_cost(setup).flops_step * grid.dp_size
    reducer = DataParallelReducer(comm, params.grad, int(opts.bucket_mb * 1e6),
                                  opts.allreduce, opts.overlap)
    header = run_header(session, "sync", flops_per_step=flops_per_step,
                        allreduce=opts.allreduce, bucket_mb=opts.bucket_mb,
                        overlap=reducer.buckets.overlap, threads=threads.as_dict())
    log = MetricsLog(setup.run.metrics if rank == 0 else "", header, append=setup.run.resume)
    trainer = Trainer(session, log, reducer, is_main=rank == 0)  # loads a checkpoint on --resume
    comm.broadcast(params.data, root=0)
    check_replicas_agree(comm, params, "after the initial broadcast")
    if rank == 0:
        print(f"{setup.model_name}: {params.size:,} parameters on {grid.dp_size} ranks, "
              f"allreduce {opts.allreduce}, {len(reducer.buckets.buckets)} bucket(s); data "
              f"{in_words(header['dataset'])}; {threads.describe()} per rank", file=sys.stderr)
    try:
        summary = trainer.run()
    finally:
        log.close()
        reducer.close()
    check_replicas_agree(comm, params, "after training")
    if rank == 0:
        for line in summary.lines(flops_per_step):
            print(line)
    return 0


def cli() -> int:
    """Errors and Ctrl-C are printed by run_cli; then the whole job is ended, not just
    this rank: a peer may be blocked in a collective this rank will never join."""
    rc = run_cli(main, command_name("dtlab.collective.train"),
                 user_errors=(CheckpointError, FloatingPointError))
    if rc and MPI.COMM_WORLD.Get_size() > 1:
        time.sleep(FORWARD_S)  # the other ranks' own lines get out before the abort
        if rc == INTERRUPTED:  # "interrupted" says it all: no MPI_Abort banner after it
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stderr.fileno())
        MPI.COMM_WORLD.Abort(rc)
    return rc


if __name__ == "__main__":
    sys.exit(cli())
