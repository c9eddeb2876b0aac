"""Run one parameter-server shard daemon.

    python -m dtlab.pserver serve --config run.json --shard 0 --num-shards 2 --port 50051 \\
        --consistency ssp --staleness 2 --num-workers 2
    python -m dtlab.pserver serve --model mlp --data digits --shard 0 --port 50051 \\
        --optimizer adam --lr 1e-3

The server reads the run config the way every trainer does (models.session):
`--config FILE` and the model, data and optimizer flags. The data flags only
fix the model fields the data implies (--data digits: d_in 64, 10 classes);
the daemon never loads the data. From the file's run section it takes the
seed and dtype (the workers' initial weights) and, unless --schedule-steps
is given, the span of the lr schedule: --steps updates under BSP (one per
round), --steps x --num-workers otherwise (one per push). Register refuses a
worker whose model or parameter layout differs. The server's own flags are
pserver.common.config.ServerConfig; see `python -m dtlab.pserver serve --help`. SIGTERM or
SIGINT shuts down cleanly (pserver.server.daemon.Daemon.shutdown) and exits 0.
`--apply-log 'runs/apply.s{shard}.jsonl'` records every update the shard applies,
for `python -m dtlab.pserver.replay` (pserver.server.applylog). Log
lines name the shard ("shard 1: ..."); a port already in use is one error
line (the daemon tries the bind itself before gRPC does).

One launch with the workers (pserver.common.rendezvous):

    mpiexec -n 2 python -m dtlab.pserver serve --config C --rendezvous auto \\
        : -n 4 python -m dtlab.pserver.worker --config C --servers auto
    python -m dtlab.pserver serve --config C --rendezvous /shared/rv --num-shards 2 ...

With --rendezvous the shard, --num-shards and --num-workers come from the job
(auto: the MPI world; DIR: the launcher's environment, flags given winning),
the address to listen on by rule unless --bind is given, and the server ends
(its checkpoint written) once its --num-workers workers registered and left.
A program of the job that fails ends the job (pserver.common.rendezvous.end_job):
under mpiexec by MPI_Abort, in a folder through DIR/failed-<rank>.json, which
ends this server with that program's line (exit 1).
With `--rendezvous auto --replicas 2` the job's 2S servers keep S shards, the
two replicas of each on different hosts (REPLICA_RULE, in --help), each backup
started with its primary's address as --replica-of.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
import sys
import threading

from dtlab.models.config import ConfigError, add_flags, from_namespace
from dtlab.models.data.factory import implied_model
from dtlab.models.optim import OptimConfig
from dtlab.models.run.allocator import keep_freed_memory
from dtlab.models.run.checkpoint import CheckpointError
from dtlab.models.run.cli import command_name, run_cli
from dtlab.models.run.session import Setup, parse
from dtlab.models.run.threads import share_cores
from dtlab.pserver.common import rendezvous
from dtlab.pserver.common.config import WILDCARDS, ServerConfig, refuse_unused_optim_flags
from dtlab.pserver.server.daemon import Daemon, build_store, config_record, host_port

# The workers clip their own gradients: --clip has no effect on a server.
SERVER_OPTIM_FLAGS = tuple(f.name for f in dataclasses.fields(OptimConfig) if f.name != "clip")
COMMANDS = {"serve": "run one parameter-server shard (python -m dtlab.pserver serve --help)"}


JOB_FIELDS = ("shard", "num_shards", "num_workers")
REPLICA_RULE = ("With --rendezvous auto --replicas 2 the job's 2S servers keep S shards, "
                "the two replicas of a shard on different hosts (the hosts MPI reports): "
                "the servers sorted by host (hosts in the order of their first server "
                "rank), the j-th keeps shard j mod S, as primary when j < S, else as "
                "backup; refused when one host of several runs more than half the "
                "servers (pserver/common/rendezvous.py).")
# how often a job-launched server looks whether its workers are done
JOB_POLL_S = 0.2


def server_config(setup: Setup, place: rendezvous.Place | None = None) -> ServerConfig:
    """ServerConfig from the flags, with seed, dtype and schedule from the run config and,
    launched with its workers, shard, --num-shards and --num-workers from `place`."""
    ns = setup.extra
    base = {"seed": setup.run.seed, "dtype": setup.run.dtype}
    if place is not None:
        base.update(shard=place.index, num_shards=place.servers, num_workers=place.workers)
    cfg = from_namespace(ServerConfig, ns, base)
    if ns.schedule_steps is None and setup.config_file:
        per_step = 1 if cfg.consistency == "bsp" else max(1, cfg.num_workers)
        cfg = dataclasses.replace(cfg, schedule_steps=setup.run.steps * per_step)
    return cfg


def serve(argv: list[str]) -> int:
    prog = command_name("dtlab.pserver") + " serve"
    setup = parse(argv, prog=prog, description=f"One gRPC parameter-server shard. {REPLICA_RULE}",
                  flags={"data": None, "optim": SERVER_OPTIM_FLAGS},
                  why="a server takes the model, data and optimizer flags; the workers take "
                      "--clip and the run flags (--steps, --batch-size, ...)",
                  add_extra=lambda p: add_flags(p, ServerConfig, "server"))
    setup.model = implied_model(setup.data, setup.model_name, setup.model)
    place, job = join(setup.extra)
    cfg = server_config(setup, place)
    refuse_unused_optim_flags(cfg, setup.extra, SERVER_OPTIM_FLAGS)
    if cfg.rendezvous:
        cfg = dataclasses.replace(cfg, bind=rendezvous.bind_address(
            setup.extra.bind, cfg.bind_interface, job.other_hosts() if job else None))
    if place is not None and place.replica:  # a backup: its primary's address from the job
        cfg = dataclasses.replace(cfg, replica_of=job.primaries(None)[place.index])
    # every line names the shard: several daemons often share one console
    logging.basicConfig(level=cfg.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s shard {cfg.shard}: %(name)s: "
                               "%(message)s")
    keep_freed_memory()
    # The daemon's work is the optimizer on its own thread pool (--apply-threads), no matmul.
    logging.getLogger(__name__).info("%s", share_cores(threads=1).describe())
    signalled, rejoined = threading.Event(), False
    while True:  # again, as a backup, each time this replica rejoins the other (Daemon.rejoin)
        store = build_store(cfg, setup.model_name, setup.model, setup.optim)
        daemon = Daemon(cfg, store, config_record(cfg, setup.model_name, setup.model,
                                                  setup.optim, setup.data), shm=cfg.shm)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_, d=daemon: (signalled.set(), d.stopping.set()))
        daemon.start()
        if cfg.rendezvous and not rejoined:
            publish(cfg, job, host_port(cfg.bind, daemon.port))
        failed = serve_the_job(daemon, cfg)
        daemon.shutdown()
        if not daemon.rejoin or signalled.is_set() or failed:
            break
        cfg, rejoined = dataclasses.replace(cfg, replica_of=daemon.rejoin, port=daemon.port), True
    if cfg.rendezvous and cfg.rendezvous != "auto":  # no later job may read it as live
        rendezvous.shard_file(cfg.rendezvous, cfg.shard).unlink(missing_ok=True)
    if failed:
        raise rendezvous.JobFailed(f"--rendezvous {cfg.rendezvous}: the job ended: {failed}")
    return 1 if daemon.failure else 0


def serve_the_job(daemon: Daemon, cfg: ServerConfig) -> str | None:
    """Serve until stopped or, launched with its workers, until its --num-workers
    registered and left; in a rendezvous folder, until another program of the job wrote
    its failure there (returned: its line)."""
    folder = cfg.rendezvous not in ("", "auto")
    done = bool(cfg.rendezvous and cfg.num_workers)
    if not (folder or done):
        daemon.stopping.wait()
        return None
    while not daemon.stopping.wait(JOB_POLL_S):
        if done and workers_done(daemon.store, cfg.num_workers):
            logging.getLogger(__name__).info("the job's %d workers registered and left: "
                                             "ending", cfg.num_workers)
            return None
        failed = rendezvous.peer_failure(cfg.rendezvous) if folder else None
        if failed:
            return failed
    return None


def join(ns) -> tuple[rendezvous.Place | None, rendezvous.MPIJob | None]:
    """This server's place in the job (--rendezvous), and the MPI job for `auto`."""
    if not ns.rendezvous:
        return None, None
    if ns.rendezvous == "auto":
        given = [f"--{f.replace('_', '-')}" for f in JOB_FIELDS if getattr(ns, f) is not None]
        if given:
            raise ConfigError(f"--rendezvous auto takes {', '.join(given)} from the job: "
                              "leave it out")
        job = rendezvous.MPIJob("server", replicas=ns.replicas or 1)
        if job.place.role != "server":
            raise ConfigError("a server rank was placed as a worker")
        return job.place, job
    return rendezvous.place_from_env("server", ns.num_shards), None


def publish(cfg: ServerConfig, job: rendezvous.MPIJob | None, address: str) -> None:
    """Tell the job's workers this shard's address: the allgather, or DIR/shard-K.json."""
    if not cfg.tls_cert and not (cfg.token_file or cfg.token_env) and \
            cfg.bind in WILDCARDS:
        logging.getLogger(__name__).warning("listening on every network (--bind %s) with "
                                            "neither a token nor TLS", cfg.bind)
    if job is not None:
        if job.replicas > 1 and job.place.replica == 0:
            job.primaries(address)
        job.addresses(address)
        logging.getLogger(__name__).info("address %s given to the job", address)
    else:
        path = rendezvous.write_address(cfg.rendezvous, cfg.shard, cfg.num_shards, address)
        logging.getLogger(__name__).info("address %s written to %s", address, path)


def workers_done(store, workers: int) -> bool:
    """Whether `workers` workers registered with `store` and none is active now."""
    known = store.stats().workers
    return len(known) >= workers and not any(w.active for w in known.values())


def usage() -> str:
    lines = [f"usage: {command_name('dtlab.pserver')} COMMAND [flags]", "", "commands:"]
    return "\n".join(lines + [f"  {name:<8} {text}" for name, text in COMMANDS.items()])


def main(argv: list[str]) -> int:
    if argv and argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if not argv or argv[0] not in COMMANDS:
        given = f"unknown command {argv[0]!r}" if argv else "no command given"
        print(f"{usage()}\n\n{command_name('dtlab.pserver')}: error: {given}", file=sys.stderr)
        return 2
    return serve(argv[1:])


def cli() -> int:
    # the workers of a --rendezvous job wait on this server: a failure ends them too
    return run_cli(main, command_name("dtlab.pserver"),
                   user_errors=(CheckpointError, TimeoutError, rendezvous.JobFailed),
                   on_failure=lambda status, line: rendezvous.end_job(status, line, "server"))


if __name__ == "__main__":
    sys.exit(cli())
