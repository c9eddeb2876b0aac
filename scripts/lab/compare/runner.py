"""The processes of one run, and how they are started, watched and stopped.

A run's name says its method (compare/registry.py: one entry per method, `dtlab-compare
--list-methods`); the spec it stands for becomes these commands:

    sync-ring | sync-naive | sync-mpi
        mpiexec -n N dtlab-sync --config CFG --allreduce ALGO --metrics OUT/NAME.jsonl
    sync-localH | sync-dilocoH                      (collective/reducers/local_sgd.py)
        ... dtlab-sync ... --local-steps H [--outer-optimizer nesterov --outer-lr 0.7
            --outer-momentum 0.9]    (local SGD: outer SGD lr 1; DiLoCo: Douillard et al.;
            --tune outer_lr / outer_momentum: the tuned values, local SGD's flags then given)
    sync-topkP | sync-randkP | sync-sign | sync-powersgdR, each optionally with -noef
        ... dtlab-sync ... --compress topk:P/100 | randk:P/100 | sign | powersgd:R
            [--no-error-feedback]    (P: percent of the elements; R: the rank)
    async-bsp | async-sspS | async-asp, each optionally with -div
        S x dtlab-pserver serve --config CFG --shard k --num-shards S --port 0 --num-workers N
              --consistency C [--staleness S] --staleness-lr none|divide --ready-file ...
        mpiexec -n N dtlab-worker --config CFG --servers ... --metrics OUT/NAME.w{worker}.jsonl
    async-localH | async-dilocoH                    (async local SGD, ASP servers; DiLoCo:
                                                     Delayed Nesterov, Liu et al. 2024)
        ... dtlab-pserver serve ... --consistency asp --outer-optimizer sgd --outer-lr 1
              [delayed-nesterov --outer-lr 0.7 --outer-momentum 0.9 --outer-period N]
        ... dtlab-worker ... --local-steps H
    async-bsp-topkP | async-asp-randkP | async-bsp-sign ..., each optionally with -noef
        ... dtlab-worker ... --compress topk:P/100 | randk:P/100 | sign  (compressed pushes)
    async-bsp-backupB                               (Chen et al. 2016)
        ... dtlab-pserver serve ... --consistency bsp --num-workers N+B --backup-workers B
        mpiexec -n N+B dtlab-worker ...   (--ranks is N: a round applies N gradients)

A local SGD run's held-out loss is of the averaged parameters, which exist once per
round: its --eval-every is the comparison's rounded up to a multiple of H (the last step
is always evaluated); give a multiple of every H to evaluate all runs at the same steps.

With --trace, every rank adds --trace OUT/NAME.trace.{rank}.json, every shard
OUT/NAME.trace.sK.json, every worker --trace OUT/NAME.trace.w{worker}.json,
every rank of a worker group OUT/NAME.trace.{rank}.json (compare/traces.py
merges them). --tp/--pp/--ep
(Grid) are passed through: N x tp x pp processes per launch.

The processes are started, tracked and stopped by processes.Processes.
The servers of an async run are fresh for every run (port 0: each picks a
free loopback port and writes it to its ready file).

On an emulated cluster (compare/cluster.py) the placement rule is: rank
or worker r on host r mod H, with --tp T blocks of T consecutive ranks (a
tensor-parallel group) instead of single ranks (mpiexec through the namespace launcher), shard
k on host k mod H listening on that host's address; shared memory is off
between workers and servers (--no-shm: the hosts share one kernel), and each
run records the bytes its hosts' shaped links sent. On real hosts (--launcher
mpiexec | srun, compare/placement.py) the same rule places every rank, and an
async run is one job of servers and workers (`run_job`):

    mpiexec -launcher ssh -hosts a,b -rankmap 0,1,0,1 \
        -n S dtlab-pserver serve --config CFG --rendezvous auto --port 0 --consistency C ... \
      : -n N dtlab-worker --config CFG --servers auto --metrics OUT/NAME.w{worker}.jsonl
    srun -n S+N --distribution=arbitrary ... --multi-prog OUT/NAME.conf
        (the servers with --rendezvous OUT/NAME.rv --num-shards S, the workers with
         --servers auto --rendezvous OUT/NAME.rv)
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from dtlab.lab.compare.cluster import EmulatedCluster
from dtlab.lab.compare.placement import Hosts, async_hosts, rank_hosts
from dtlab.lab.compare.processes import Processes
from dtlab.lab.compare.registry import RunSpec
from dtlab.lab.programs import program
from dtlab.models.config import ConfigError
from dtlab.models.run.launcher_env import mpiexec_path
from dtlab.models.run.metrics import read_metrics

POLL_S = 0.2
SERVER_START_S = 60.0
TAIL_LINES = 20


@dataclass(frozen=True)
class Grid:
    """The model parallelism of every run's replica (dtlab-compare --tp/--pp/--ep)."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    pp_schedule: str = "1f1b"

    @property
    def model_parallel(self) -> bool:
        return self.tp * self.pp * self.ep > 1

    def describe(self) -> str:
        parts = [f"tp {self.tp}"] if self.tp > 1 else []
        if self.pp > 1:
            parts.append(f"pp {self.pp} ({self.pp_schedule})")
        if self.ep > 1:
            parts.append(f"ep {self.ep} (sync runs; async workers hold every expert)")
        return " x ".join(parts) or "one rank"

    def flags(self, sync: bool) -> list[str]:
        """The trainer's grid flags (dp is the launch's ranks over the rest)."""
        out = []
        for flag, value in (("--tp", self.tp), ("--pp", self.pp)) + (
                (("--ep", self.ep),) if sync else ()):
            if value > 1:
                out += [flag, str(value)]
        if self.pp > 1:
            out += ["--pp-schedule", self.pp_schedule]
        return out


def placement(grid: Grid) -> str:
    """The rule that puts a run's processes on emulated hosts, in words."""
    if grid.tp == 1:
        return "rank, worker or shard i on host i mod H"
    return (f"ranks in blocks of {grid.tp} (a tensor-parallel group stays on one host), "
            "block i on host i mod H; shard i on host i mod H")


@dataclass
class RunContext:
    """What every run shares: where things go, the shared config, the sizes, the limits."""

    out: Path
    config: Path
    ranks: int
    shards: int
    steps: int
    timeout_s: float
    mpiexec: str
    cluster: EmulatedCluster | None = None
    trace: bool = False  # every process writes a Chrome trace into `out`
    grid: Grid = field(default_factory=Grid)
    hosts: Hosts | None = None  # real hosts (--launcher mpiexec | srun)

    @property
    def eval_every(self) -> int:
        """The shared config's --eval-every (0: no held-out loss)."""
        return json.loads(self.config.read_text())["run"].get("eval_every", 0)

    def processes(self, backups: int = 0) -> int:
        """MPI processes of one launch: N data ranks (workers) and any backup workers,
        each tp x pp ranks."""
        return (self.ranks + backups) * self.grid.tp * self.grid.pp


@dataclass
class Outcome:
    spec: RunSpec
    metrics: list[Path]
    commands: list[list[str]] = field(default_factory=list)
    error: str = ""  # empty: the run finished with every step in its metrics
    tail: str = ""  # the end of the failed run's log(s)
    wall_s: float = 0.0
    link_bytes: list[int] | None = None  # per emulated host, sent during the run
    trace: Path | None = None  # the run's merged Chrome trace (compare/traces.py)


def find_mpiexec() -> str:
    """launcher.mpiexec_path(), its absence a ConfigError (named before anything starts)."""
    try:
        return mpiexec_path()
    except FileNotFoundError as e:
        raise ConfigError(str(e)) from None


def tail(*logs: Path) -> str:
    out = []
    for log in logs:
        lines = log.read_text(errors="replace").splitlines() if log.exists() else []
        out.append(f"--- {log.name} ---\n" + "\n".join(lines[-TAIL_LINES:]))
    return "\n".join(out)


def last_record(path: Path) -> dict:
    """The last step record of a metrics file being written ({} before the first)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 8192))
            lines = f.read().splitlines()
    except FileNotFoundError:
        return {}
    for line in reversed(lines):
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line cut by the seek, or one being written
        if "step" in record:
            return record
    return {}


def progress_of(paths: list[Path]) -> tuple[int, float | None]:
    """(steps every file has reached, the mean of their latest losses)."""
    last = [last_record(p) for p in paths]
    if not all(last):
        return 0, None
    return min(r["step"] for r in last), sum(r["loss"] for r in last) / len(last)


Watch = Callable[[int, float | None], None]


def run(spec: RunSpec, ctx: RunContext, procs: Processes, watch: Watch) -> Outcome:
    """Run `spec` to its end (or failure, or timeout); its processes are gone afterwards."""
    start = time.monotonic()
    sent = ctx.cluster.bytes_sent() if ctx.cluster else None
    launch = {"sync": run_sync, "async": run_async, "simulated": run_simulated}[spec.topology]
    outcome = launch(spec, ctx, procs, watch, start + ctx.timeout_s)
    outcome.wall_s = time.monotonic() - start
    if ctx.cluster:
        outcome.link_bytes = [b - a for a, b in zip(sent, ctx.cluster.bytes_sent(),
                                                    strict=True)]
    if not outcome.error:
        done = min((count_steps(p) for p in outcome.metrics), default=0)
        # a simulated run's records are pushes: N a step
        expected = ctx.steps * (ctx.ranks if spec.topology == "simulated" else 1)
        if done != expected:
            outcome.error = f"the metrics hold {done} of {expected} records"
    return outcome


def count_steps(path: Path) -> int:
    try:
        return len(read_metrics(str(path))[1])
    except (FileNotFoundError, ValueError):
        return 0


def run_sync(spec: RunSpec, ctx: RunContext, procs: Processes, watch: Watch,
             deadline: float) -> Outcome:
    metrics = ctx.out / f"{spec.name}.jsonl"
    log = ctx.out / f"{spec.name}.log"
    prog = [*program("dtlab-sync"), "--config", str(ctx.config),
            *(["--zero", str(spec.zero)] if spec.zero else ["--allreduce", spec.allreduce]),
            *method_flags(spec, ctx), "--metrics", str(metrics),
            *ctx.grid.flags(sync=True)]
    if ctx.trace:
        prog += ["--trace", str(ctx.out / f"{spec.name}.trace.{{rank}}.json")]
    n, env = ctx.processes(), ctx.cluster.env if ctx.cluster else None
    if ctx.hosts:
        cmd, env = ctx.hosts.line([(n, prog)], rank_hosts(n, ctx.grid.tp,
                                                            len(ctx.hosts.names)),
                                    ctx.out, spec.name)
    else:
        cmd = [ctx.mpiexec, *mpiexec_args(ctx), "-n", str(n), *prog]
    return one_process_tree(Outcome(spec, [metrics], [cmd]), ctx, procs, watch, deadline,
                            log, env)


def one_process_tree(outcome: Outcome, ctx: RunContext, procs: Processes, watch: Watch,
                     deadline: float, log: Path, env: dict | None = None) -> Outcome:
    """Start the run's one command (mpiexec, or a single program), wait for its metrics
    until it ends or the deadline, stop what is left; a failure keeps the log's tail."""
    main = procs.start(outcome.commands[0], log, env)
    try:
        outcome.error = _wait(procs, main, [], deadline, ctx.timeout_s, outcome.metrics, watch)
    finally:
        procs.stop([main])
    if outcome.error:
        outcome.tail = tail(log)
    return outcome


def method_flags(spec: RunSpec, ctx: RunContext) -> list[str]:
    """A sync run's or an async worker's flags for local SGD (with the held-out loss
    every multiple of H) or compression."""
    out = []
    if spec.local_steps:
        H = spec.local_steps
        out += ["--local-steps", str(H), "--eval-every", str(-(-ctx.eval_every // H) * H)]
        tuned = spec.outer_lr is not None or spec.outer_momentum is not None
        if spec.topology == "sync" and (spec.outer == "diloco" or tuned):
            name, lr, momentum = spec.outer_optimizer()  # local SGD untuned: the default
            out += ["--outer-optimizer", name, "--outer-lr", str(lr),
                    "--outer-momentum", str(momentum)]
    if spec.compress:
        out += ["--compress", spec.compress] + ([] if spec.error_feedback
                                                else ["--no-error-feedback"])
    return out + list(spec.sync_flags if spec.topology == "sync" else spec.worker_flags)


def server_flags(spec: RunSpec, ctx: RunContext) -> list[str]:
    """An async run's server flags for its workers (backups included) and their method."""
    workers = ctx.ranks + spec.backups
    out = ["--consistency", spec.consistency, "--num-workers", str(workers)]
    if spec.backups:
        out += ["--backup-workers", str(spec.backups)]
    if spec.local_steps:
        outer = spec.outer_optimizer()
        out += ["--outer-optimizer", outer[0], "--outer-lr", str(outer[1]),
                "--outer-momentum", str(outer[2])]
        if spec.outer == "diloco":  # momentum once per N outer gradients: one a worker
            out += ["--outer-period", str(workers)]
    return out + list(spec.server_flags)


def run_simulated(spec: RunSpec, ctx: RunContext, procs: Processes, watch: Watch,
                  deadline: float) -> Outcome:
    """N ASP workers simulated in one process (dtlab-train --simulate-workers N): the
    staleness of an async run without its systems, on this machine (no network)."""
    metrics, log = ctx.out / f"{spec.name}.jsonl", ctx.out / f"{spec.name}.log"
    cmd = [*program("dtlab-train"), "--config", str(ctx.config), "--simulate-workers",
           str(ctx.ranks), "--staleness-lr", spec.staleness_lr, "--metrics", str(metrics)]
    return one_process_tree(Outcome(spec, [metrics], [cmd]), ctx, procs, watch, deadline, log)


def run_job(spec: RunSpec, ctx: RunContext, procs: Processes, watch: Watch,
            deadline: float) -> Outcome:
    """An async run on real hosts: its servers and workers as one job (module docstring),
    which ends by itself once the workers are done (the servers then exit)."""
    name, out, hosts = spec.name, ctx.out, ctx.hosts
    metrics = [out / f"{name}.w{w}.jsonl" for w in range(ctx.ranks + spec.backups)]
    if hosts.kind == "mpiexec":
        meet, find = ["--rendezvous", "auto"], []
    else:
        rv = out / f"{name}.rv"
        meet = ["--rendezvous", str(rv), "--num-shards", str(ctx.shards)]
        find = ["--rendezvous", str(rv)]
    given = server_flags(spec, ctx)
    at = given.index("--num-workers")
    server = [*program("dtlab-pserver"), "serve", "--config", str(ctx.config), *meet,
              "--port", "0", *given[:at], *given[at + 2:], "--staleness-lr", spec.staleness_lr,
              *(["--staleness", str(spec.staleness)] if spec.consistency == "ssp" else [])]
    workers = ctx.processes(spec.backups)
    worker = [*program("dtlab-worker"), "--config", str(ctx.config), "--servers", "auto",
              *find, "--metrics", str(out / f"{name}.w{{worker}}.jsonl"),
              *method_flags(spec, ctx)]
    cmd, env = hosts.line([(ctx.shards, server), (workers, worker)],
                          async_hosts(ctx.shards, workers, ctx.grid.tp, len(hosts.names)),
                          out, name)
    return one_process_tree(Outcome(spec, metrics, [cmd]), ctx, procs, watch, deadline,
                            out / f"{name}.log", env)


def run_async(spec: RunSpec, ctx: RunContext, procs: Processes, watch: Watch,
              deadline: float) -> Outcome:
    if ctx.hosts:
        return run_job(spec, ctx, procs, watch, deadline)
    name, out = spec.name, ctx.out
    metrics = [out / f"{name}.w{w}.jsonl" for w in range(ctx.ranks + spec.backups)]
    outcome = Outcome(spec, metrics)
    servers, logs, ready = [], [], []
    main = None
    try:
        for k in range(ctx.shards):
            ready.append(out / f"{name}.shard{k}.ready")
            logs.append(out / f"{name}.shard{k}.log")
            cmd = [*program("dtlab-pserver"), "serve", "--config", str(ctx.config),
                   "--shard", str(k), "--num-shards", str(ctx.shards), "--port", "0",
                   *server_flags(spec, ctx), "--staleness-lr", spec.staleness_lr,
                   "--ready-file", str(ready[k])]
            if spec.consistency == "ssp":
                cmd += ["--staleness", str(spec.staleness)]
            if ctx.trace:
                cmd += ["--trace", str(out / f"{name}.trace.s{k}.json")]
            if ctx.cluster:
                host = k % ctx.cluster.hosts
                cmd = ctx.cluster.in_host(host, [*cmd, "--bind", ctx.cluster.address(host),
                                                   "--no-shm"])
            outcome.commands.append(cmd)
            servers.append(procs.start(cmd, logs[k]))
        ports = wait_ready(servers, ready, min(SERVER_START_S, deadline - time.monotonic()))
        if isinstance(ports, str):
            outcome.error, outcome.tail = ports, tail(*logs)
            return outcome
        log = out / f"{name}.log"
        hosts = [ctx.cluster.address(k % ctx.cluster.hosts) if ctx.cluster else "127.0.0.1"
                 for k in range(ctx.shards)]
        cmd = [ctx.mpiexec, *mpiexec_args(ctx), "-n", str(ctx.processes(spec.backups)),
               *program("dtlab-worker"), "--config", str(ctx.config),
               "--servers", ",".join(f"{h}:{p}" for h, p in zip(hosts, ports, strict=True)),
               "--metrics", str(out / f"{name}.w{{worker}}.jsonl"),
               *method_flags(spec, ctx), *ctx.grid.flags(sync=False)]
        if ctx.cluster:
            cmd.append("--no-shm")
        if ctx.trace:  # a worker group's ranks trace apart: by their rank in the launch
            each = "{rank}" if ctx.grid.tp * ctx.grid.pp > 1 else "w{worker}"
            cmd += ["--trace", str(out / f"{name}.trace.{each}.json")]
        outcome.commands.append(cmd)
        main = procs.start(cmd, log, ctx.cluster.env if ctx.cluster else None)
        outcome.error = _wait(procs, main, servers, deadline, ctx.timeout_s, metrics, watch)
        if outcome.error:
            outcome.tail = tail(log, *logs)
        return outcome
    finally:
        procs.stop([p for p in (main, *servers) if p is not None])
        for r in ready:
            r.unlink(missing_ok=True)


def mpiexec_args(ctx: RunContext) -> list[str]:
    return ctx.cluster.mpiexec_args(slots=ctx.grid.tp) if ctx.cluster else []


def wait_ready(servers: list[subprocess.Popen], ready: list[Path],
                seconds: float) -> list[int] | str:
    """Every server's port once all wrote their ready files, or why not."""
    deadline = time.monotonic() + seconds
    while not all(r.exists() for r in ready):
        dead = [k for k, s in enumerate(servers) if s.poll() is not None]
        if dead:
            return f"server shard {dead[0]} exited with {servers[dead[0]].returncode} at start"
        if time.monotonic() > deadline:
            return f"the servers were not serving after {seconds:.1f} s"
        time.sleep(0.05)
    return [json.loads(r.read_text())["port"] for r in ready]


def _wait(procs: Processes, main: subprocess.Popen, servers: list[subprocess.Popen],
          deadline: float, timeout_s: float, metrics: list[Path], watch: Watch) -> str:
    """Wait for `main` to exit while the servers live; '' or what went wrong."""
    while main.poll() is None:
        procs.track()
        dead = [k for k, s in enumerate(servers) if s.poll() is not None]
        if dead:
            return f"server shard {dead[0]} exited with {servers[dead[0]].returncode} mid-run"
        if time.monotonic() > deadline:
            return f"timed out after {timeout_s:g} s (--timeout)"
        watch(*progress_of(metrics))
        time.sleep(POLL_S)
    watch(*progress_of(metrics))
    rc = main.returncode
    if rc < 0:
        return f"killed by {signal.Signals(-rc).name}"
    return "" if rc == 0 else f"exited with {rc}"
