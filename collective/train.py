"""Synchronous data-parallel training over MPI, optionally tensor-split and pipelined.

    mpiexec -n 4 python -m dtlab.collective.train --model transformer --steps 600 --seed 0 \
        --metrics runs/sync.jsonl [--allreduce ring|naive|mpi] [--bucket-mb 25] [--no-overlap]
    mpiexec -n 4 python -m dtlab.collective.train --dp 2 --tp 2 --model transformer
    mpiexec -n 8 python -m dtlab.collective.train --dp 2 --pp 2 --tp 2 --grad-accum 4 \
        --pp-schedule zb-h1 --model transformer
    mpiexec -n 4 python -m dtlab.collective.train --model transformer --moe-experts 8 \
        --dp 2 --ep 2 [--moe-alltoall ours|mpi] [--moe-chunks 2]
    mpiexec -n 4 python -m dtlab.collective.train --model transformer --zero 1|2|3 \
        [--no-zero-reshard-after-forward]
    python -m dtlab.collective.train --explain-hang ./dtlab-flight-12345   # after a hang

The world is a dp x pp x ep x tp grid (collective/grid.py, tp fastest). With --tp 1
every rank holds a full replica; with --tp b each group of b consecutive
ranks holds one replica split Megatron-style (models/tensor_parallel.py:
heads, FFN columns / rows, vocabulary), each rank only its shard. With --pp c
the model's layers are cut into c stages (models/pipeline.py; balanced by
FLOPs or --stages), the --grad-accum micro-batches of a step run through them
by --pp-schedule. All ranks of one replica (its tp x pp ranks) read the same
data. Everything below happens within the dp communicator, among the ranks
holding the same shard.

Every data-parallel rank holds the same parameters. Rank 0's initial parameters are broadcast
and every rank checks a checksum; each rank reads its own shard of every
global batch; after backward the gradient buffer is averaged across ranks
in buckets (our ring all-reduce by default, started for each bucket as soon
as backward has produced it unless --no-overlap), so every replica takes
the same optimizer step. With N ranks of per-rank batch B this is the same
computation as one process with batch N*B (Goyal et al. 2017), up to the
order of floating-point sums.

With --ep e (a transformer with --moe-experts N, N divisible by e) each group of e ranks
holds the N experts of every MoE layer split e ways (models/moe_ep.py) and everything
else whole; the e ranks read their own data (data rank dp_rank * e + ep_rank of dp * e)
and exchange the routed tokens by all-to-all(v), ours (every exchange posted at once,
then one wait) or MPI's Alltoallv (--moe-alltoall), in --moe-chunks chunks that overlap
the exchange with the experts' compute. With --pp as well, each of the e pipelines runs
its stages' MoE layers over its stage's ep group (the e ranks holding the same stage), so
the exchanges of one micro-batch's layer meet stage by stage. The parameters are laid out
dense first, experts after (models/model.py), and reduced in two groups:
the dense range averaged over the dp x ep ranks (dp_ep_comm), the expert range over the
dp ranks holding the same experts (dp_comm) and divided by e, since each expert's
gradient already sums the e ranks' tokens: both are then the gradient of the mean loss of
all dp x e ranks, that of one process on the global batch with the same token groups.

With --zero S the dp ranks shard the model instead of replicating it (ZeRO,
Rajbhandari et al. 2020; collective/zero/sharding.py): stage 1 the optimizer state, stage 2 also
the gradients, stage 3 also the parameters, over our ring reduce-scatter and all-gather
within each (pp, tp) shard's dp communicator (Megatron-LM's distributed optimizer with
--tp and --pp; stage 3 with --tp, not --pp; no --ep: the flags it cannot honour are
refused by name). Each dp rank checkpoints its own slice, and --resume at another dp
size cuts the slices again (collective/zero/checkpoint.py).

With --local-steps H (local SGD, DiLoCo: collective/reducers/local_sgd.py) every rank takes H
steps of its own optimizer and the ranks all-reduce their parameter change once per
round; with --compress topk:F|randk:F|sign|powersgd:R (collective/reducers/compress.py)
each step's gradients travel compressed, with error feedback. Both run on dp alone
(collective/reducers/methods.py names what they refuse) and record sent_bytes and comm_rounds.

Rank 0 writes the metrics (per-step time split into compute, communication
and waiting) and checkpoints. An exception on any rank aborts the whole job.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import time

from mpi4py import MPI

from dtlab.collective.comm import Communicator
from dtlab.collective.flags import SyncConfig
from dtlab.collective.grid import GridError, ProcessGrid
from dtlab.collective.reducers.data_parallel import DataParallelReducer, plan_words
from dtlab.collective.reducers.exchange import step_scalars
from dtlab.collective.reducers.methods import (
    METHOD_CONFIGS,
    Methods,
    agreement,
    method_configs,
    method_parts,
)
from dtlab.collective.transport import flight
from dtlab.collective.transport.failure import FORWARD_S
from dtlab.collective.zero.quantized import ZeroQuantConfig, zero_quant_config
from dtlab.collective.zero.trainer import ZeroTrainer, shard_session, zero_bytes
from dtlab.models.config import ConfigError, add_flags
from dtlab.models.data.dataset import in_words
from dtlab.models.moe_ep import ExpertParallel
from dtlab.models.partition import check_pipeline
from dtlab.models.pipedream import (
    PipeDreamConfig,
    VersionedReplica,
    from_setup,
    header_fields,
    windowed,
)
from dtlab.models.run.allocator import keep_freed_memory
from dtlab.models.run.checkpoint import CheckpointError
from dtlab.models.run.cli import command_name, run_cli
from dtlab.models.run.grid_flags import GridConfig
from dtlab.models.run.metrics import MetricsLog, run_header
from dtlab.models.run.session import (
    PipelineSpec,
    Session,
    Setup,
    build_session,
    dense_param_count,
    parse,
    replica_cost,
)
from dtlab.models.run.threads import share_cores
from dtlab.models.run.trainer import Summary, Trainer

INTERRUPTED = 130
# dtlab-sync's config classes, each (class, --help title); the rules between their flags
# are declared on them (collective/flags.py, each method's config) and on `Methods`
SYNC_CONFIGS = ((GridConfig, "process grid (dp x pp x ep x tp = the ranks of mpiexec -n)"),
                (SyncConfig, "sync data parallelism"), *METHOD_CONFIGS)


def add_sync_flags(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, ZeroQuantConfig, "ZeRO++'s quantized gathers and reduce-scatters "
                                       "(collective/zero/quantized.py)")
    add_flags(parser, PipeDreamConfig, "asynchronous pipeline (models/pipedream.py)",
              only=("pipedream", "pipedream_window"))


def check_replicas_agree(comm: Communicator, params, when: str) -> None:
    """Every rank's parameter checksum equals rank 0's, or an error naming the ranks."""
    sums = comm.mpi.allgather(params.checksum())
    bad = [r for r, s in enumerate(sums) if s != sums[0]]
    if bad:
        raise RuntimeError(f"replicas disagree {when}: ranks {bad} differ from rank 0 "
                           f"(checksums {[hex(s) for s in sums]})")


def memory_split(session: Session, grid: ProcessGrid) -> dict:
    """This rank's parameter, gradient and optimizer bytes, and the whole dense model's
    (gradients: the buffer backward writes and the all-reduce moves, half under
    --precision fp16/bf16)."""
    params, grad = session.params, session.replica.compute_params.grad
    slots = [v for k, v in session.optimizer.state_dict().items() if k != "steps"]
    count = dense_param_count(session.setup)
    dense = count * params.dtype.itemsize  # bytes of one copy
    return {"tp": grid.tp_size, "pp": grid.pp_size, "ep": grid.ep_size,
            "param_bytes": params.nbytes,
            "grad_bytes": grad.nbytes,
            "optimizer_bytes": sum(v.nbytes for v in slots), "dense_param_bytes": dense,
            "dense_grad_bytes": count * grad.itemsize, "dense_optimizer_bytes": len(slots) * dense}


def parse_args(argv: list[str]) -> Setup:
    setup = parse(argv, prog=command_name("dtlab.collective.train"),
                  description=__doc__.split("\n\n")[0], add_extra=add_sync_flags,
                  configs=SYNC_CONFIGS, rules=Methods.RULES)
    opts = setup.extra
    check_pipeline(opts.pp, setup.run.grad_accum, opts.pp_schedule, opts.virtual_stages)
    check_experts(setup)
    opts.zero_quant = zero_quant_config(setup)  # both flags named where they clash
    opts.methods = method_configs(setup)
    opts.pipedream_config = from_setup(setup)  # models/pipedream.py
    return setup


def optimizer_kind(setup: Setup) -> str:
    """The optimizer as models/cost.py counts its state: sgd, sgd-momentum, adam, adamw."""
    optim = setup.optim
    return "sgd-momentum" if optim.optimizer == "sgd" and optim.momentum > 0 else optim.optimizer


def check_experts(setup: Setup) -> None:
    """ConfigError when --ep does not divide the experts (GridConfig's rules name the
    flags --ep cannot go with)."""
    ep = setup.extra.ep
    if ep > 1 and setup.model.moe_experts % ep:
        raise ConfigError(f"--moe-experts {setup.model.moe_experts} is not divisible by "
                          f"--ep {ep}")


def make_grid(opts: argparse.Namespace) -> ProcessGrid:
    """The dp x pp x ep x tp grid the flags ask for, or a ConfigError naming them."""
    try:
        return ProcessGrid(dp=opts.dp, pp=opts.pp, tp=opts.tp, ep=opts.ep,
                           timeout=opts.collective_timeout)
    except GridError as e:
        ep = f" --ep {opts.ep}" if opts.ep > 1 else ""
        raise ConfigError(f"--dp {opts.dp} --pp {opts.pp} --tp {opts.tp}{ep}: {e}") from None


def explain_hang(argv: list[str]) -> str | None:
    """DIR of --explain-hang DIR (None without it); a ConfigError when other flags come
    with it: it trains nothing, so they would have no effect."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--explain-hang", default=None)
    known, rest = pre.parse_known_args(argv)
    if known.explain_hang is not None and rest:
        raise ConfigError(f"--explain-hang {known.explain_hang} trains nothing: not with "
                          f"{' '.join(rest)}")
    return known.explain_hang


def main(argv: list[str]) -> int:
    global _stopped_cleanly
    hang = explain_hang(argv)
    if hang is not None:
        return flight.main([hang])
    _, _, summary = train(parse_args(argv))
    _stopped_cleanly = bool(summary.stopped_by)
    return summary.exit_code


_stopped_cleanly = False  # every rank agreed to stop on a signal: no abort needed


def train(setup: Setup) -> tuple[Session, ProcessGrid, Summary]:
    """Run the training `setup` describes on this rank; return its session, grid and
    summary."""
    opts = setup.extra
    keep_freed_memory()
    threads = share_cores()
    grid = make_grid(opts)
    grid.select_device()
    comm, rank = grid.dp_comm, grid.rank
    pipeline = PipelineSpec(grid.pp_comm, opts.pp_schedule, opts.stages,
                            opts.virtual_stages) if grid.pp_size > 1 else None
    ep = expert_parallel(grid, opts)
    session = build_session(setup, rank=grid.dp_rank * grid.ep_size + grid.ep_rank,
                            world=grid.dp_size * grid.ep_size,
                            tp=grid.tp_comm if grid.tp_size > 1 else None, pipeline=pipeline,
                            ep=ep)
    pipedream = opts.pipedream_config
    if pipedream.pipedream != "off" and not pipedream.windowed:  # on past weight versions
        session.replica = VersionedReplica.for_stage(session.replica, opts.pipedream_config,
                                                     grid.pp_rank)
    flops_per_step = replica_cost(setup).flops_step * grid.dp_size * grid.ep_size
    zero = None
    if opts.zero:
        session, reducer, zero = shard_session(session, comm, opts.zero,
                                               opts.zero_reshard_after_forward is not False,
                                               opts.overlap, opts.wire, opts.zero_quant)
        memory = zero_bytes(zero, session.optimizer, optimizer_kind(setup),
                            zero.params.size)  # this (pp, tp) shard's, sharded over dp
        fields = {"zero_units": reducer.plan(), "zero_bytes": memory, "wire": opts.wire,
                  "zero_reshard_after_forward": zero.reshard if opts.zero == 3 else None,
                  **opts.zero_quant.fields()}
        words = (f"ZeRO stage {opts.zero} over dp {grid.dp_size}"
                 + (" (as stage 1: a pipeline stage's gradient is whole until the step's "
                    "last backward)" if zero.runs_as != zero.stage else "")
                 + f", {opts.wire} on the wire, {zero_words(memory)}; "
                 f"{len(reducer.plan())} units{opts.zero_quant.describe()}")
        replicas = zero  # its checksum is the whole parameters' (collective)
    elif opts.methods.enabled:  # --local-steps, --compress, --onebit-adam (methods.py)
        def plain() -> DataParallelReducer:
            return DataParallelReducer(comm, session.replica.compute_params.grad,
                                       int(opts.bucket_mb * 1e6), opts.allreduce,
                                       opts.overlap, opts.wire)
        session, reducer, fields, method = method_parts(session, comm, opts.methods,
                                                        setup.run.seed, plain)
        split = memory_split(session, grid)
        fields.update(split)
        words = f"{shard_words(split)}; {method}"
        replicas = session.params
    else:
        split = memory_split(session, grid)
        # the buffer backward writes: params.grad, or its half copy under --precision fp16/bf16
        reducer = DataParallelReducer(grid.dp_ep_comm, session.replica.compute_params.grad,
                                      int(opts.bucket_mb * 1e6),
                                      opts.allreduce, opts.overlap, opts.wire,
                                      experts=expert_group(grid, session.params))
        fields = {"allreduce": opts.allreduce, "allreduce_buckets": reducer.plan(),
                  "bucket_mb": opts.bucket_mb, "wire": opts.wire, **split}
        words = (f"{shard_words(split)}; allreduce {opts.allreduce} ({opts.wire} on the "
                 f"wire), {len(reducer.buckets.buckets)} bucket(s) running "
                 f"{plan_words(fields['allreduce_buckets'])}")
        replicas = session.params
    if pipedream.windowed:  # 2BW's steps K at a time as one list, no flush (pipedream.py)
        session.replica, reducer = windowed(session, pipedream, reducer)
    processes = grid.world.mpi.allgather(f"{os.getpid()}@{socket.gethostname()}")
    header = run_header(session, "sync", flops_per_step=flops_per_step, zero=opts.zero,
                        **fields, overlap=reducer.overlap, threads=threads.as_dict(),
                        dp=grid.dp_size,
                        **({"moe_alltoall": opts.moe_alltoall, "moe_chunks": opts.moe_chunks}
                           if grid.ep_size > 1 else {}),
                        processes=processes,
                        **header_fields(session.replica, opts.pipedream_config,
                                        grid.pp_comm.mpi.allgather))
    log = MetricsLog(setup.run.metrics if rank == 0 else "", header, append=setup.run.resume)
    # loads a checkpoint on --resume; dp rank 0 of every (pp, ep, tp) rank saves its shard,
    # under --zero every dp rank its own
    kind = ZeroTrainer if zero else Trainer
    trainer = kind(session, log, reducer, is_main=rank == 0,
                   saves=zero is not None or grid.dp_rank == 0,
                   agree=agreement(session, grid.world),  # collective/reducers/methods.py
                   scalars=step_scalars(reducer, grid.world),  # the loss and agreement in one
                   rank=rank, role="sync",
                   stages=grid.pp_comm.mpi.allgather if grid.pp_size > 1 else None)
    if zero is None:
        comm.broadcast(session.params.data, root=0)
    check_replicas_agree(comm, replicas, "at the start")
    if rank == 0:
        print(f"{setup.model_name}: {dense_param_count(setup):,} parameters on dp "
              f"{grid.dp_size} x {pipe_words(session, opts)}{ep_words(opts)}tp {grid.tp_size} "
              f"ranks, {words}; data {in_words(header['dataset'])}; "
              f"{threads.describe()} per rank", file=sys.stderr)
        # a rank killed outright is named by the launcher only by its pid: say whose it is
        print(f"ranks (pid@host): {rank_table(processes)}", file=sys.stderr)
    try:
        summary = trainer.run()
    finally:
        log.close()
        reducer.close()
    check_replicas_agree(comm, replicas, "after training")
    if rank == 0:
        for line in summary.lines(flops_per_step):
            print(line)
    return session, grid, summary


def expert_parallel(grid: ProcessGrid, opts: argparse.Namespace) -> ExpertParallel | None:
    """The MoE layers' expert-parallel group (None without --ep): the exchange --moe-alltoall
    names, --moe-chunks, the bias balancing's loads summed over dp x ep, this rank's data
    group."""
    if grid.ep_size == 1:
        return None
    comm = grid.ep_comm
    exchange = comm.mpi_alltoallv if opts.moe_alltoall == "mpi" else posted_alltoallv(comm)
    return ExpertParallel(comm, exchange, chunks=opts.moe_chunks, loads=grid.dp_ep_comm,
                          group=grid.dp_rank * grid.ep_size + grid.ep_rank)


def posted_alltoallv(comm: Communicator):
    """Our all-to-all(v) as the MoE layers call it: every exchange posted at once and
    completed by one wait (Communicator.ialltoallv), which beats the step-by-step pairwise
    exchange when ranks outnumber cores (dtlab.lab.bench.moe)."""
    def alltoallv(x, send_counts, out=None, recv_counts=None):
        return comm.ialltoallv(x, send_counts, out, recv_counts).wait()
    return alltoallv


def expert_group(grid: ProcessGrid, params) -> tuple[Communicator, int, int] | None:
    """(dp_comm, first expert offset, ep) for the reducer's expert group, None without ep
    or on a pipeline stage without MoE layers (all of its gradients are dense). The
    experts must be the buffer's last contiguous range (models/model.py, Model.specs)."""
    ranges = sorted(params.ranges("ep", "ep+tp"))
    if grid.ep_size == 1 or not ranges:
        return None
    lo = ranges[0][0]
    if ranges[-1][1] != params.size or sum(hi - a for a, hi in ranges) != params.size - lo:
        raise RuntimeError("the expert parameters are not the end of the flat buffer")
    return grid.dp_comm, lo, grid.ep_size


def rank_table(processes: list[str], most: int = 32) -> str:
    """'0 2853@vm, 1 2854@vm, ...' (the first `most`; the metrics header keeps all)."""
    shown = ", ".join(f"{r} {p}" for r, p in enumerate(processes[:most]))
    more = len(processes) - most
    return shown + (f", ... ({more} more in the metrics header)" if more > 0 else "")


def pipe_words(session: Session, opts: argparse.Namespace) -> str:
    """'pp 2 (1f1b, 4 micro-batches, modules [0, 3, 6]) x ', or '' without a pipeline."""
    if opts.pp == 1:
        return ""
    return (f"pp {opts.pp} ({opts.pp_schedule}, {session.setup.run.grad_accum} micro-batches, "
            f"modules {session.model.bounds}) x ")


def ep_words(opts: argparse.Namespace) -> str:
    """'ep 2 (all-to-all ours, 1 chunk) x ', or '' without expert parallelism."""
    if opts.ep == 1:
        return ""
    return (f"ep {opts.ep} (all-to-all {opts.moe_alltoall}, {opts.moe_chunks} "
            f"chunk{'s' if opts.moe_chunks > 1 else ''}) x ")


def zero_words(memory: dict) -> str:
    """'per rank 0.42 MB (params 0.1, grads 0.1, optimizer 0.2; formula 0.4 MB)'."""
    f = memory["formula"]
    return (f"per rank {memory['total_bytes'] / 1e6:.3g} MB (params "
            f"{memory['weight_bytes'] / 1e6:.3g}, grads {memory['grad_bytes'] / 1e6:.3g}, "
            f"optimizer {memory['optimizer_bytes'] / 1e6:.3g}; the paper's formula "
            f"{f['total'] / 1e6:.3g} MB)")


def shard_words(split: dict) -> str:
    """'per rank: params 1.2 MB of 2.4 MB dense, grads ..., optimizer ...'."""
    def mb(n: int) -> str:
        return f"{n / 1e6:.3g} MB"

    parts = [f"{what} {mb(split[f'{key}_bytes'])} of {mb(split[f'dense_{key}_bytes'])} dense"
             for what, key in (("params", "param"), ("grads", "grad"),
                               ("optimizer", "optimizer")) if split[f"dense_{key}_bytes"]]
    return "per rank: " + ", ".join(parts)


def cli() -> int:
    """Errors and Ctrl-C are printed by run_cli; then the whole job is ended, not just
    this rank: a peer may be blocked in a collective this rank will never join."""
    rc = run_cli(main, command_name("dtlab.collective.train"),
                 user_errors=(CheckpointError, FloatingPointError))
    if rc and MPI.COMM_WORLD.Get_size() > 1 and not _stopped_cleanly:
        time.sleep(FORWARD_S)  # the other ranks' own lines get out before the abort
        if rc == INTERRUPTED:  # "interrupted" says it all: no MPI_Abort banner after it
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stderr.fileno())
        MPI.COMM_WORLD.Abort(rc)
    return rc


if __name__ == "__main__":
    sys.exit(cli())
