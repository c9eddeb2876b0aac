"""Run names, the processes of one run, and how they are started, watched and stopped.

    sync-ring | sync-naive | sync-mpi
        mpiexec -n N dtlab-sync --config CFG --allreduce ALGO --metrics OUT/NAME.jsonl
    async-bsp | async-sspS | async-asp, each optionally with -div
        S x dtlab-pserver serve --config CFG --shard k --num-shards S --port 0 --num-workers N
              --consistency C [--staleness S] --staleness-lr none|divide --ready-file ...
        mpiexec -n N dtlab-worker --config CFG --servers ... --metrics OUT/NAME.w{worker}.jsonl

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
run records the bytes its hosts' shaped links sent.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from dtlab.lab.compare.cluster import EmulatedCluster
from dtlab.lab.compare.processes import Processes
from dtlab.lab.programs import program
from dtlab.models.config import ConfigError
from dtlab.models.run.launcher import mpiexec_path
from dtlab.models.run.metrics import read_metrics

RUN_NAME = re.compile(r"sync-(?P<allreduce>ring|auto|naive|mpi)|sync-zero(?P<zero>[123])"
                      r"|async-(?P<consistency>bsp|asp|ssp(?P<bound>\d+))(?P<div>-div)?"
                      r"|sim-asp(?P<sim_div>-div)?")
KNOWN = ("sync-ring, sync-auto, sync-naive, sync-mpi, sync-zero1/2/3, async-bsp, "
         "async-sspS (S: the bound), async-asp, each async one optionally with -div; "
         "sim-asp, sim-asp-div (N workers simulated in one process)")
POLL_S = 0.2
SERVER_START_S = 60.0
TAIL_LINES = 20


@dataclass(frozen=True)
class RunSpec:
    """One run of the comparison, as its name says."""

    name: str
    topology: str  # "sync" or "async"
    allreduce: str = ""
    zero: int = 0  # sync: the ZeRO stage (dtlab-sync --zero)
    consistency: str = ""
    staleness: int = 0  # the SSP bound
    staleness_lr: str = "none"

    @classmethod
    def parse(cls, name: str) -> RunSpec:
        m = RUN_NAME.fullmatch(name)
        if m is None:
            raise ConfigError(f"--runs: unknown run {name!r} (known: {KNOWN})")
        if m["allreduce"]:
            return cls(name, "sync", allreduce=m["allreduce"])
        if m["zero"]:
            return cls(name, "sync", allreduce="ring", zero=int(m["zero"]))
        if name.startswith("sim-"):
            return cls(name, "simulated", consistency="asp",
                       staleness_lr="divide" if m["sim_div"] else "none")
        consistency = "ssp" if m["bound"] is not None else m["consistency"]
        return cls(name, "async", consistency=consistency, staleness=int(m["bound"] or 0),
                   staleness_lr="divide" if m["div"] else "none")

    def describe(self) -> str:
        if self.zero:
            return f"sync, ZeRO stage {self.zero}"
        if self.topology == "sync":
            return {"ring": "sync, our ring", "auto": "sync, ours chosen by size",
                    "naive": "sync, reduce + broadcast", "mpi": "sync, MPI_Allreduce"}[
                self.allreduce]
        div = ", lr / staleness" if self.staleness_lr == "divide" else ""
        if self.topology == "simulated":
            return f"ASP simulated in one process (N - 1 stale){div}"
        rule = f"SSP s={self.staleness}" if self.consistency == "ssp" else self.consistency.upper()
        return f"async, {rule}{div}"


@dataclass(frozen=True)
class Grid:
    """The model parallelism of every run's replica (compare.py --tp/--pp/--ep)."""

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
class Bench:
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

    def processes(self) -> int:
        """MPI processes of one launch: N data ranks (workers), each tp x pp ranks."""
        return self.ranks * self.grid.tp * self.grid.pp


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


def run(spec: RunSpec, bench: Bench, procs: Processes, watch: Watch) -> Outcome:
    """Run `spec` to its end (or failure, or timeout); its processes are gone afterwards."""
    start = time.monotonic()
    sent = bench.cluster.bytes_sent() if bench.cluster else None
    launch = {"sync": run_sync, "async": run_async, "simulated": run_simulated}[spec.topology]
    outcome = launch(spec, bench, procs, watch, start + bench.timeout_s)
    outcome.wall_s = time.monotonic() - start
    if bench.cluster:
        outcome.link_bytes = [b - a for a, b in zip(sent, bench.cluster.bytes_sent(),
                                                    strict=True)]
    if not outcome.error:
        done = min((count_steps(p) for p in outcome.metrics), default=0)
        # a simulated run's records are pushes: N a step
        expected = bench.steps * (bench.ranks if spec.topology == "simulated" else 1)
        if done != expected:
            outcome.error = f"the metrics hold {done} of {expected} records"
    return outcome


def count_steps(path: Path) -> int:
    try:
        return len(read_metrics(str(path))[1])
    except (FileNotFoundError, ValueError):
        return 0


def run_sync(spec: RunSpec, bench: Bench, procs: Processes, watch: Watch,
             deadline: float) -> Outcome:
    metrics = bench.out / f"{spec.name}.jsonl"
    log = bench.out / f"{spec.name}.log"
    cmd = [bench.mpiexec, *mpiexec_args(bench), "-n", str(bench.processes()),
           *program("dtlab-sync"), "--config", str(bench.config),
           *(["--zero", str(spec.zero)] if spec.zero else ["--allreduce", spec.allreduce]),
           "--metrics", str(metrics), *bench.grid.flags(sync=True)]
    if bench.trace:
        cmd += ["--trace", str(bench.out / f"{spec.name}.trace.{{rank}}.json")]
    outcome = Outcome(spec, [metrics], [cmd])
    main = procs.start(cmd, log, bench.cluster.env if bench.cluster else None)
    try:
        outcome.error = _wait(procs, main, [], deadline, bench.timeout_s, [metrics], watch)
    finally:
        procs.stop([main])
    if outcome.error:
        outcome.tail = tail(log)
    return outcome


def run_simulated(spec: RunSpec, bench: Bench, procs: Processes, watch: Watch,
                  deadline: float) -> Outcome:
    """N ASP workers simulated in one process (dtlab-train --simulate-workers N): the
    staleness of an async run without its systems, on this machine (no network)."""
    metrics, log = bench.out / f"{spec.name}.jsonl", bench.out / f"{spec.name}.log"
    cmd = [*program("dtlab-train"), "--config", str(bench.config), "--simulate-workers",
           str(bench.ranks), "--staleness-lr", spec.staleness_lr, "--metrics", str(metrics)]
    outcome = Outcome(spec, [metrics], [cmd])
    main = procs.start(cmd, log)
    try:
        outcome.error = _wait(procs, main, [], deadline, bench.timeout_s, [metrics], watch)
    finally:
        procs.stop([main])
    if outcome.error:
        outcome.tail = tail(log)
    return outcome


def run_async(spec: RunSpec, bench: Bench, procs: Processes, watch: Watch,
              deadline: float) -> Outcome:
    name, out = spec.name, bench.out
    metrics = [out / f"{name}.w{w}.jsonl" for w in range(bench.ranks)]
    outcome = Outcome(spec, metrics)
    servers, logs, ready = [], [], []
    main = None
    try:
        for k in range(bench.shards):
            ready.append(out / f"{name}.shard{k}.ready")
            logs.append(out / f"{name}.shard{k}.log")
            cmd = [*program("dtlab-pserver"), "serve", "--config", str(bench.config),
                   "--shard", str(k), "--num-shards", str(bench.shards), "--port", "0",
                   "--consistency", spec.consistency, "--num-workers", str(bench.ranks),
                   "--staleness-lr", spec.staleness_lr, "--ready-file", str(ready[k])]
            if spec.consistency == "ssp":
                cmd += ["--staleness", str(spec.staleness)]
            if bench.trace:
                cmd += ["--trace", str(out / f"{name}.trace.s{k}.json")]
            if bench.cluster:
                host = k % bench.cluster.hosts
                cmd = bench.cluster.in_host(host, [*cmd, "--bind", bench.cluster.address(host),
                                                   "--no-shm"])
            outcome.commands.append(cmd)
            servers.append(procs.start(cmd, logs[k]))
        ports = wait_ready(servers, ready, min(SERVER_START_S, deadline - time.monotonic()))
        if isinstance(ports, str):
            outcome.error, outcome.tail = ports, tail(*logs)
            return outcome
        log = out / f"{name}.log"
        hosts = [bench.cluster.address(k % bench.cluster.hosts) if bench.cluster else "127.0.0.1"
                 for k in range(bench.shards)]
        cmd = [bench.mpiexec, *mpiexec_args(bench), "-n", str(bench.processes()),
               *program("dtlab-worker"), "--config", str(bench.config),
               "--servers", ",".join(f"{h}:{p}" for h, p in zip(hosts, ports, strict=True)),
               "--metrics", str(out / f"{name}.w{{worker}}.jsonl"),
               *bench.grid.flags(sync=False)]
        if bench.cluster:
            cmd.append("--no-shm")
        if bench.trace:  # a worker group's ranks trace apart: by their rank in the launch
            each = "{rank}" if bench.grid.tp * bench.grid.pp > 1 else "w{worker}"
            cmd += ["--trace", str(out / f"{name}.trace.{each}.json")]
        outcome.commands.append(cmd)
        main = procs.start(cmd, log, bench.cluster.env if bench.cluster else None)
        outcome.error = _wait(procs, main, servers, deadline, bench.timeout_s, metrics, watch)
        if outcome.error:
            outcome.tail = tail(log, *logs)
        return outcome
    finally:
        procs.stop([p for p in (main, *servers) if p is not None])
        for r in ready:
            r.unlink(missing_ok=True)


def mpiexec_args(bench: Bench) -> list[str]:
    return bench.cluster.mpiexec_args(slots=bench.grid.tp) if bench.cluster else []


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
