"""Sync vs async training of one model on one budget, side by side.

    dtlab-compare                                  # the default comparison
    dtlab-compare --runs sync-ring,async-bsp,async-asp --steps 300 --out runs/c
    dtlab-compare --config run.json --ranks 4 --shards 2 --target-loss 1.3

Every run trains the same model on the same data with the same seed (so the
same initial weights), the same global batch (sync: N ranks of per-rank
batch B; async: N workers of batch B), the same optimizer and the same
number of steps per rank or worker. The config is the defaults, then
--config FILE (default scripts/lab/configs/transformer.json unless --model is
given), then the model, data, optimizer and run flags given; it is written
to OUT/config.json and every process of every run reads it. Runs (--runs):

    sync-ring, sync-naive, sync-mpi   mpiexec -n N dtlab-sync --allreduce ring|naive|mpi
    async-bsp, async-sspS, async-asp  S fresh dtlab-pserver shards on free loopback ports
                                      (--consistency bsp, ssp --staleness S, asp) and
                                      mpiexec -n N dtlab-worker
    ... -div                          the same with --staleness-lr divide (Zhang et al. 2016)

--tp T --pp P [--pp-schedule S] make every replica a model-parallel one: a sync
replica and an async worker group alike are T x P ranks (N x T x P processes
per run; a worker group is one worker to the servers); --ep E (sync runs, a
model with experts) spreads the experts over E of the N data ranks.

Each run is started, waited for and cleaned up here (every process it
started is gone when it ends, also on Ctrl-C, a failure or --timeout); a
failed run is marked failed in the report with the end of its log and the
others go on. OUT (--out, default runs/compare-DATE-TIME) gets each run's
metrics and logs, summary.json, report.md and PNG plots (compare/report.py):
hardware efficiency (s/step) and statistical efficiency (steps to the target
loss) multiplied into time to target (Hadjis et al. 2016, Omnivore). The
target is the data's loss floor + 0.1 nats, or --target-loss. --trace merges
each run's process traces into OUT/NAME.trace.json (compare/traces.py);
--calibration FILE sets the cost model's step beside each run's measured one
(compare/predict.py). --launcher says where the processes run (compare/placement.py:
this host, emulated hosts, real ones through mpiexec over ssh or srun in a Slurm
allocation); on several hosts the links between them are measured first
(compare/probe.py: an all-reduce and a gRPC probe, OUT/links.json) and named in
the report's header. The exit
status is 0 when every run finished, 1 when one failed, 2 for a bad config
(named before anything starts), 130 on Ctrl-C.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

from dtlab.lab import presets
from dtlab.lab.compare import (
    analysis,
    cluster,
    placement,
    predict,
    probe,
    registry,
    report,
    reproductions,
    runner,
    study,
    study_report,
    sweep,
    traces,
)
from dtlab.lab.compare.runner import Outcome, Processes, RunContext, RunSpec
from dtlab.models.config import ConfigError
from dtlab.models.data.dataset import in_words
from dtlab.models.data.factory import source_of
from dtlab.models.run.cli import run_cli
from dtlab.models.run.metrics import hardware, read_metrics, versions
from dtlab.models.run.session import Setup, build_session, parse
from dtlab.models.schedule import SCHEDULES
from dtlab.models.zoo import build_model, check_grid

PROG = "dtlab-compare"
# BSP applies no stale gradient, so async-bsp-div would repeat async-bsp
DEFAULT_RUNS = "sync-ring,sync-auto,async-bsp,async-ssp2,async-asp,async-asp-div"
RUN_FLAGS = ("steps", "batch_size", "grad_accum", "seed", "dtype", "log_every", "eval_every",
             "eval_samples", "straggler", "delay_ms")
TARGET_GAP = 0.1  # nats above the floor
DEFAULT_SEEDS = 3
EVALS = 20  # held-out evaluations a run makes when --eval-every is not given
EVAL_SAMPLES = 256  # ... on this many examples unless --eval-samples says otherwise
PROBE_TIMEOUT_S = 120.0  # the link probe at the start (compare/probe.py)
NO_PLOTS = "no plots: --no-plots"


def add_compare_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("comparison")
    g.add_argument("--runs", default=DEFAULT_RUNS,
                   help=f"comma-separated runs, in order; the first is the baseline of the "
                        f"ratios (default {DEFAULT_RUNS}; async-bsp-div is left out: BSP "
                        "applies no stale gradient; --list-methods names them all)")
    g.add_argument("--list-methods", action="store_true",
                   help="print every method the comparison runs (compare/registry.py): its "
                        "run names, what it does and the exchange it runs; then exit")
    g.add_argument("--ranks", type=int, default=2,
                   help="sync ranks = async workers, N (default 2)")
    g.add_argument("--shards", type=int, default=2,
                   help="parameter-server shards of every async run (default 2)")
    g.add_argument("--tune", action="append", default=[], metavar="NAME=V1,V2,...",
                   help="tune every method over these values of an optimizer setting "
                        "(repeat for a grid: --tune lr=0.005,0.01 --tune momentum=0.5,0.9) "
                        "and report each at its best (compare/study.py); outer_lr and "
                        "outer_momentum tune the outer optimizer of the methods that have "
                        "one (local SGD, DiLoCo, Streaming DiLoCo, sync and async) in place "
                        "of its constant, the others running once per point of the other "
                        "axes; default: lr at 0.5, 1 and 2 x the config's; 'none': the "
                        "config as it is")
    g.add_argument("--seeds", type=int, default=DEFAULT_SEEDS,
                   help=f"fresh seeds each method runs at its best point; the figures are "
                        f"their mean and min-max (default {DEFAULT_SEEDS})")
    g.add_argument("--preset", choices=list(reproductions.PRESETS), default=None,
                   help="a known result reproduced: its runs and grid, its expected "
                        "outcome stated and checked in the report (compare/reproductions.py; "
                        "flags given win over the preset's)")
    g.add_argument("--target-loss", type=float, default=None,
                   help=f"the loss every run is timed to (default: the data's floor + "
                        f"{TARGET_GAP} nats; needed when the data has no known floor)")
    g.add_argument("--out", metavar="DIR", default="",
                   help="a new or empty folder for everything written "
                        "(default runs/compare-DATE-TIME)")
    g.add_argument("--launcher", choices=placement.LAUNCHERS, default=None,
                   help="where every run's processes run: local (this host, shared memory), "
                        "emulated (--hosts H emulated hosts), mpiexec (--hosts a,b,...: real "
                        "hosts, Hydra over ssh), srun (the nodes of the current Slurm "
                        "allocation); on several hosts rank, worker or shard i goes to host "
                        "i mod H (a --tp group on one host) and the links are probed first "
                        "(default: emulated when --hosts is a number above 1, else local)")
    g.add_argument("--hosts", default="1",
                   help="local / emulated: how many hosts (emulated ones: network namespaces "
                        "joined by tc-shaped links; needs root and iproute2; default 1: this "
                        "host); mpiexec: the hosts' names, comma-separated (ssh reaches them "
                        "without a password and they share this folder)")
    g.add_argument("--link-gbit", type=float, default=1.0,
                   help="each emulated host's link rate in Gbit/s (default 1)")
    g.add_argument("--tcp-cc", default="reno",
                   help="the emulated hosts' TCP congestion control (default reno, loss-based, "
                        "what the cost model's link assumes; 'host': this machine's own; "
                        "compare/cluster.py)")
    g.add_argument("--trace", action="store_true",
                   help="every process of every run writes a Chrome trace into OUT; after "
                        "each run they are merged into OUT/NAME.trace.json (opens in Perfetto)")
    g.add_argument("--no-plots", action="store_true",
                   help="write no PNG plots (about a second of matplotlib a comparison); the "
                        "report says so")
    g.add_argument("--calibration", metavar="FILE", default="",
                   help="a dtlab-simulate --calibrate JSON: benchmark the model first and set "
                        "the cost model's predicted step beside each run's measured one")
    g.add_argument("--sweep", choices=["model-size"], default=None,
                   help="instead of comparing topologies, train --sweep-sizes under the first "
                        "of --runs for one compute budget (--steps steps of the smallest) and "
                        "fit loss against parameters and compute (compare/sweep.py)")
    g.add_argument("--sweep-sizes", default="32,64,128",
                   help="widths of the sweep: transformer d_model (d_ff = 4 d_model), mlp "
                        "d_hidden (default 32,64,128)")
    g = p.add_argument_group("model parallelism (every run's replica)")
    g.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel ranks per replica: sync replicas and async worker "
                        "groups alike (default 1)")
    g.add_argument("--pp", type=int, default=1,
                   help="pipeline stages per replica; its micro-batches are --grad-accum "
                        "(default 1)")
    g.add_argument("--pp-schedule", choices=list(SCHEDULES), default="1f1b",
                   help="pipeline schedule with --pp (default 1f1b)")
    g.add_argument("--ep", type=int, default=1,
                   help="sync runs: spread the experts over this many of the --ranks data "
                        "ranks (--ranks / ep data-parallel groups); async workers hold every "
                        "expert (default 1)")
    g = p.add_argument_group("limits")
    g.add_argument("--timeout", type=float, default=600.0,
                   help="seconds a run may take before it is stopped and marked failed "
                        "(default 600)")


def parse_args(argv: list[str]) -> tuple[Setup, list[RunSpec]]:
    named = any(a.split("=", 1)[0] in ("--config", "--model") for a in argv)
    setup = parse(presets.resolve(argv) if named else
                  ["--config", str(presets.config_path(presets.DEFAULT)), *argv], prog=PROG,
                  description=__doc__.split("\n\n")[0], add_extra=add_compare_flags,
                  flags={"data": None, "optim": None, "run": RUN_FLAGS},
                  why="every run's metrics, logs and processes are the comparison's own "
                      "(see --out)")
    opts = setup.extra
    held_out = source_of(setup.data, setup.model_name, setup.model) in ("teacher", "markov")
    if not setup.run.eval_every and held_out:  # by default: targets are judged on it
        setup.run.eval_every = max(1, setup.run.steps // EVALS)
        if not any(a.split("=", 1)[0] == "--eval-samples" for a in argv):
            setup.run.eval_samples = EVAL_SAMPLES
    for flag, value in (("--ranks", opts.ranks), ("--shards", opts.shards),
                        ("--seeds", opts.seeds)):
        if value < 1:
            raise ConfigError(f"{flag} must be at least 1 (got {value})")
    if not opts.timeout > 0:
        raise ConfigError(f"--timeout must be positive (got {opts.timeout})")
    if not (math.isfinite(opts.link_gbit) and opts.link_gbit > 0):
        raise ConfigError(f"--link-gbit must be a positive rate (got {opts.link_gbit})")
    check_launcher(opts)
    opts.grid = study.parse_grid(opts.tune, setup.optim)
    studied = len(opts.grid.points()) > 1 or opts.seeds > 1
    if studied and (opts.sweep or opts.calibration):
        raise ConfigError(f"{'--sweep' if opts.sweep else '--calibration'} runs every method "
                          "once: give --tune none --seeds 1")
    if opts.calibration and opts.sweep:
        raise ConfigError("--calibration predicts the runs of a comparison, not a --sweep")
    check_parallel(setup)
    if opts.calibration and opts.tp * opts.pp * opts.ep > 1:
        raise ConfigError("--calibration predicts data-parallel runs; dtlab-simulate "
                          "predicts --tp/--pp/--ep layouts")
    opts.cal = predict.load(opts.calibration, opts.ranks, opts.emulated_hosts) \
        if opts.calibration else None
    names = [n.strip() for n in opts.runs.split(",") if n.strip()]
    if not names:
        raise ConfigError("--runs names no run")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(f"--runs names {', '.join(twice)} twice")
    if opts.sweep:
        try:
            opts.widths = [int(w) for w in opts.sweep_sizes.split(",")]
        except ValueError:
            raise ConfigError(f"--sweep-sizes {opts.sweep_sizes!r}: expected comma-separated "
                              "widths") from None
        if len(opts.widths) < 2 or min(opts.widths) < 1 or len(set(opts.widths)) != len(
                opts.widths):
            raise ConfigError(f"--sweep-sizes {opts.sweep_sizes!r}: needs two or more distinct "
                              "positive widths")
    specs = [RunSpec.parse(n) for n in names]
    study.check_methods(opts.grid, specs)
    grouped = [s.name for s in specs if s.topology == "async"]
    if opts.real and grouped and opts.tp * opts.pp > 1:
        raise ConfigError(f"--launcher {opts.launcher} runs {', '.join(grouped)} as one job of "
                          "servers and workers, whose MPI world a worker group (--tp/--pp) "
                          "cannot have to itself: drop --tp/--pp or those runs")
    simulated = [s.name for s in specs if s.topology == "simulated"]
    if simulated and opts.tp * opts.pp * opts.ep > 1:
        raise ConfigError(f"--runs {', '.join(simulated)}: the simulated workers are one "
                          "process of whole replicas; drop --tp/--pp/--ep or the run")
    return setup, specs


def check_launcher(opts: argparse.Namespace) -> None:
    """--launcher and --hosts, named before anything starts: sets opts.launcher,
    opts.emulated_hosts (H of --launcher emulated, else 1) and opts.real (the real hosts of
    --launcher mpiexec | srun, else None)."""
    hosts = opts.hosts.strip()
    count = int(hosts) if hosts.isdigit() else None
    launcher = opts.launcher or ("emulated" if count and count > 1 else "local")
    opts.launcher, opts.emulated_hosts, opts.real = launcher, 1, None
    if launcher in ("local", "emulated") and count is None:
        raise ConfigError(f"--hosts {hosts!r}: --launcher {launcher} takes a number of hosts "
                          "(host names go with --launcher mpiexec)")
    if launcher == "local" and count != 1:
        raise ConfigError(f"--launcher local runs on this host: --hosts {hosts} needs "
                          "--launcher emulated (or mpiexec with the hosts' names)")
    if launcher == "emulated":
        if count < 2:
            raise ConfigError(f"--launcher emulated needs --hosts 2 or more (got {hosts})")
        if why := cluster.check():
            raise ConfigError(f"--hosts {count}: {why}; without --hosts the comparison runs "
                              "on this host")
        if why := cluster.check_congestion_control(opts.tcp_cc):
            raise ConfigError(f"--tcp-cc {opts.tcp_cc}: {why}")
        opts.emulated_hosts = count
    elif launcher == "mpiexec":
        opts.real = placement.mpiexec_hosts(hosts, runner.find_mpiexec())
    elif launcher == "srun":
        if hosts != "1":
            raise ConfigError("--launcher srun runs on the allocation's nodes "
                              "(SLURM_JOB_NODELIST): leave --hosts out")
        opts.real = placement.srun_hosts()
    if opts.real and (opts.trace or opts.calibration):
        raise ConfigError(f"--launcher {launcher} does not go with "
                          f"{'--trace' if opts.trace else '--calibration'}: "
                          + ("the hosts' clocks differ" if opts.trace else
                             "the cost model predicts this host or emulated ones; "
                             "OUT/links.json holds the measured links"))


def check_parallel(setup: Setup) -> None:
    """ConfigError naming the flag where --tp/--pp/--ep cannot split this model or these
    ranks (before anything starts)."""
    opts = setup.extra
    for flag, value in (("--tp", opts.tp), ("--pp", opts.pp), ("--ep", opts.ep)):
        if value < 1:
            raise ConfigError(f"{flag} must be at least 1 (got {value})")
    if opts.ranks % opts.ep:
        raise ConfigError(f"--ranks {opts.ranks} (the data ranks) is not divisible by --ep "
                          f"{opts.ep}")
    check_grid(setup.model_name, setup.model, opts.tp, opts.ep)
    modules = len(build_model(setup.model_name, setup.model).body.modules)
    if opts.pp > modules:
        raise ConfigError(f"--pp {opts.pp} is more stages than the model's {modules} layers")


def target_loss(given: float | None, floor: float | None) -> tuple[float, str]:
    if given is None:
        if floor is None:
            raise ConfigError("the data has no known loss floor: give --target-loss")
        return floor + TARGET_GAP, f"the floor + {TARGET_GAP} nats"
    if not math.isfinite(given):
        raise ConfigError(f"--target-loss must be a finite number (got {given})")
    if floor is not None and given <= floor:
        raise ConfigError(f"--target-loss {given} is at or below the data's floor {floor:.4f}: "
                          "no run can reach it")
    return given, "--target-loss"


def out_dir(given: str) -> Path:
    if given:
        out = Path(given)
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise ConfigError(f"--out {given}: exists and is not an empty folder; nothing "
                              "there is touched: give a new one")
        out.mkdir(parents=True, exist_ok=True)
        return out
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    for n in range(100):
        out = Path("runs") / (f"compare-{stamp}" + (f"-{n}" if n else ""))
        try:
            out.mkdir(parents=True)
            return out
        except FileExistsError:
            continue
    raise ConfigError(f"runs/compare-{stamp}: 100 folders of that second exist; give --out")


class Board:
    """One line per run: redrawn as it goes on a terminal, printed when it ends elsewhere."""

    def __init__(self, specs: list[RunSpec], steps: int, stream=sys.stderr):
        self.width = max(len(s.name) for s in specs)
        self.n, self.steps, self.stream = len(specs), steps, stream
        self.tty = stream.isatty()
        self.drawn = False  # a line is on the terminal without its newline

    def end_line(self) -> None:
        if self.drawn:
            self.stream.write("\n")
            self.drawn = False

    def _line(self, i: int, name: str, text: str) -> str:
        return f"[{i + 1}/{self.n}] {name:<{self.width}}  {text}"

    def watch(self, i: int, name: str) -> runner.Watch:
        start = time.monotonic()

        def show(step: int, loss: float | None) -> None:
            if self.tty:
                text = (f"step {step}/{self.steps}  loss {loss:.4f}" if step else "starting")
                text += f"  {time.monotonic() - start:.0f} s"
                self.stream.write("\r" + self._line(i, name, text) + "\033[K")
                self.stream.flush()
                self.drawn = True
        return show

    def done(self, i: int, result: report.Result) -> None:
        s = result.stats
        if s is None:
            text = f"FAILED: {result.outcome.error}"
        else:
            reached = (f"target at step {s['steps_to_target']}" if s["steps_to_target"]
                       else "target not reached")
            text = (f"{s['steps']} steps in {s['time_s']:.1f} s  final loss "
                    f"{s['final_loss']:.4f}  {reached}")
        self.stream.write(("\r" if self.tty else "") + self._line(i, result.name, text)
                          + ("\033[K" if self.tty else "") + "\n")
        self.stream.flush()
        self.drawn = False


def analyse(outcome: Outcome, ctx: RunContext, global_batch: int, floor: float | None,
            target: float) -> report.Result:
    if outcome.error:
        return report.Result(outcome)
    read = [read_metrics(str(p)) for p in outcome.metrics]
    headers, records = [h for h, _ in read], [r for _, r in read]
    spec = outcome.spec
    if spec.topology == "simulated":
        records = [analysis.rounds(records[0])]
    curve, stats = analysis.measure(spec.topology, records, global_batch, ctx.ranks,
                                    spec.consistency, floor, target)
    return report.Result(outcome, curve, stats, analysis.what_ran(spec.topology, headers,
                                                                  records))


def describe(setup: Setup, data: dict) -> list[str]:
    """The setup in words: the first lines of report.md."""
    hw, v, run, opt = data["hardware"], data["versions"], setup.run, setup.optim
    lines = [
        f"{data['started']} on {hw['host']} ({hw['cpu']}, {hw['cpu_count']} cores); "
        + ", ".join(f"{k} {v[k]}" for k in ("dtlab", "numpy", "mpich", "grpcio") if k in v),
        f"model {data['model']}, {data['n_params']:,} parameters; data {in_words(data['dataset'])}",
        f"every run: {run.steps} steps of global batch {data['global_batch']} = "
        f"{data['ranks']} ranks or workers x {run.batch_size * run.grad_accum}; seed {run.seed}, "
        f"{run.dtype}; {opt.optimizer} lr {opt.lr:g}, {opt.warmup} warm-up steps, "
        f"{opt.schedule}, clip {opt.clip:g}; async: {data['shards']} shards, fresh servers "
        "for every run",
        f"target loss {data['target_loss']:.4f} ({data['target_rule']})",
        f"command: `{data['command']}`",
    ]
    grid = runner.Grid(**data["grid"])
    if grid.model_parallel:
        lines.append(f"every replica: {grid.describe()}")
    if data.get("cluster"):
        lines.append(f"network: {data['cluster']}; {runner.placement(grid)}")
    if opt.clip:
        lines.append("clip > 0: sync clips the averaged gradient, each async worker its own, "
                     "so async-bsp is not the sync computation")
    return ["- " + line for line in lines]


def grid_of(opts: argparse.Namespace) -> runner.Grid:
    return runner.Grid(opts.tp, opts.pp, opts.ep, opts.pp_schedule)


def shared_config(setup: Setup) -> dict:
    """The run config every process of every run reads (--config OUT/config.json)."""
    shared = setup.as_dict()
    shared["run"] = {k: v for k, v in shared["run"].items() if k in RUN_FLAGS}
    return shared


def setup_record(setup: Setup, argv: list[str], session, target: float, rule: str) -> dict:
    """What every run shares, for summary.json (and, in words, report.md)."""
    opts, run, floor = setup.extra, setup.run, session.dataset.floor
    return {"command": f"{PROG} {shlex.join(argv)}".strip(), "config": shared_config(setup),
            "model": setup.model_name, "n_params": session.params.size,
            "dataset": session.dataset.describe(), "floor": floor, "target_loss": target,
            "target_rule": rule, "smooth_window": analysis.window_for(run.steps),
            "ranks": opts.ranks, "shards": opts.shards, "batch_size": run.batch_size,
            "global_batch": opts.ranks * run.batch_size * run.grad_accum, "steps": run.steps,
            "grid": dataclasses.asdict(grid_of(opts)),
            "hardware": hardware(), "versions": versions(), "cluster": None, "emulated": None,
            "calibration": opts.calibration or None, "load_avg": None,
            "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def run_sweep(setup: Setup, spec: RunSpec, argv: list[str], session, out: Path,
              mpiexec: str, target: float, rule: str) -> int:
    """--sweep model-size: one run of `spec` per width, the same training FLOPs each."""
    opts, floor = setup.extra, session.dataset.floor
    sizes = sweep.plan(setup.model_name, setup.model, opts.widths,
                       opts.ranks * setup.run.batch_size * setup.run.grad_accum, setup.run.steps)
    data = setup_record(setup, argv, session, target, rule)
    procs, metrics = Processes(), []
    runs = [dataclasses.replace(spec, name=f"{spec.name}-w{s['width']}") for s in sizes]
    board = Board(runs, max(s["steps"] for s in sizes))
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        for i, s in enumerate(sizes):
            folder = out / f"width-{s['width']}"
            folder.mkdir()
            config = dict(data["config"], model=dataclasses.asdict(s["config"]))
            config["run"] = dict(config["run"], steps=s["steps"])
            (folder / "config.json").write_text(json.dumps(config, indent=1) + "\n")
            ctx = RunContext(folder, (folder / "config.json").resolve(), opts.ranks, opts.shards,
                          s["steps"], opts.timeout, mpiexec, grid=grid_of(opts))
            outcome = runner.run(runs[i], ctx, procs, board.watch(i, runs[i].name))
            result = analyse(outcome, ctx, data["global_batch"], floor, target)
            board.done(i, result)
            if not result.ok:
                print(f"{PROG}: width {s['width']} failed: {outcome.error}", file=sys.stderr)
                return 1
            metrics.append(outcome.metrics[0])
    finally:
        board.end_line()
        procs.stop_all()
    result = sweep.analyse(sizes, metrics, floor)
    result["setup"] = {k: data[k] for k in ("command", "model", "dataset", "floor", "ranks",
                                             "global_batch", "hardware", "versions", "started")}
    png = sweep.plot(out, result, floor) if floor is not None else None
    lines = [f"- {spec.name}: {spec.describe()}; every width trains "
             f"{sizes[0]['steps'] * sizes[0]['flops_per_step']:.3g} FLOPs (the smallest "
             f"{setup.run.steps} steps); data {in_words(data['dataset'])}",
             f"- command: `{data['command']}`"]
    sweep.write(out, result, lines, floor, png)
    print(f"sweep: {out / 'sweep.md'}")
    return 0


@dataclasses.dataclass
class Lab:
    """What every folder of a comparison shares while it runs."""

    setup: Setup
    data: dict  # setup_record's
    floor: float | None
    target: float
    mpiexec: str
    procs: Processes
    hosts: cluster.EmulatedCluster | None = None


def run_folder(lab: Lab, folder: Path, point: dict, seed: int, specs: list[RunSpec],
               title: str = "") -> list[report.Result]:
    """Every run of `specs` with the shared config at grid `point` and `seed`, into
    `folder` (its config.json, metrics and logs); their results. The point's outer lr /
    momentum go to the methods with an outer optimizer (study.at_point)."""
    opts = lab.setup.extra
    config = dict(lab.data["config"])
    config["optim"] = {**config["optim"], **study.inner(point)}
    config["run"] = {**config["run"], "seed": seed}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    ctx = RunContext(folder, (folder / "config.json").resolve(), opts.ranks, opts.shards,
                  lab.setup.run.steps, opts.timeout, lab.mpiexec, lab.hosts, opts.trace,
                  grid_of(opts), opts.real)
    if title:
        print(title, file=sys.stderr)
    board = Board(specs, lab.setup.run.steps)
    results = []
    try:
        for i, spec in enumerate(specs):
            outcome = runner.run(study.at_point(spec, point), ctx, lab.procs,
                                 board.watch(i, spec.name))
            if opts.trace:
                traces.merge_run(outcome, folder)
            results.append(analyse(outcome, ctx, lab.data["global_batch"], lab.floor,
                                   lab.target))
            board.done(i, results[-1])
    finally:
        board.end_line()
    return results


def run_single(lab: Lab, out: Path, specs: list[RunSpec], load_before) -> int:
    """No study (one grid point, --seeds 1): each method once, as configured (at the one
    point given, if any), into OUT."""
    setup, data, opts = lab.setup, lab.data, lab.setup.extra
    if opts.cal is not None:
        (out / "config.json").write_text(json.dumps(data["config"], indent=1) + "\n")
        print("benchmarking the model for --calibration", file=sys.stderr)
        predict.bench_compute(opts.cal, (out / "config.json").resolve(), opts.ranks, out)
    results = run_folder(lab, out, opts.grid.points()[0], setup.run.seed, specs)
    plots, note = ([], NO_PLOTS) if opts.no_plots else \
        report.plot(out, results, lab.floor, lab.target)
    if note:
        print(note, file=sys.stderr)
    data["load_avg"] = {"before": list(load_before), "after": list(os.getloadavg())}
    summary = report.summary(data, results, plots, note)
    if opts.cal is not None:
        predict.predict(opts.cal, out, summary)
    report.write_summary(out, summary)
    report.write_report(out, summary, results, describe(setup, data))
    check_reproduction(lab, out, summary)
    return finish(out, results)


def run_study(lab: Lab, out: Path, specs: list[RunSpec], grid: study.Grid,
              load_before) -> int:
    """Tune every method over `grid` with the tuning seed, then run each at its best point
    with --seeds fresh seeds (compare/study.py)."""
    setup, data = lab.setup, lab.data
    seed0, k = setup.run.seed, setup.extra.seeds
    trials: list[study.Trial] = []
    results: list[report.Result] = []

    def record(phase: str, folder: Path, point: dict, seed: int,
               done: list[report.Result]) -> None:
        for r in done:
            trials.append(study.Trial(r.outcome.spec, point, seed, r.stats,
                                      str(folder.relative_to(out)), r.ran or {}))
            results.append(r)
            r.phase, r.point, r.seed, r.folder = phase, point, seed, trials[-1].folder

    points = grid.points()
    best = {s.name: study.applicable(s, points[0]) for s in specs}
    if len(points) > 1:
        for point, group in study.tuning_plan(specs, grid):
            folder = out / "tune" / study.label(point)
            record("tune", folder, point, seed0,
                   run_folder(lab, folder, point, seed0, group,
                              f"tuning {study.label(point)}, seed {seed0}:"))
        best = {s.name: study.best_point([t for t in trials if t.spec.name == s.name])
                for s in specs}
    seeds = [seed0 + 1 + i for i in range(k)] if len(points) > 1 else \
        [seed0 + i for i in range(k)]
    for seed in seeds:
        for point in {study.label(p): p for p in best.values()}.values():
            group = [s for s in specs if best[s.name] == point]
            folder = out / f"seed-{seed}" / study.label(point)
            record("seed", folder, point, seed,
                   run_folder(lab, folder, point, seed, group,
                              f"seed {seed}, {study.label(point)}:"))
    data["load_avg"] = {"before": list(load_before), "after": list(os.getloadavg())}
    summary = study_report.summary(data, specs, grid, best, seeds, trials, results)
    summary["plots"], summary["plots_note"] = ([], NO_PLOTS) if setup.extra.no_plots else \
        study_report.plot(out, summary, results, lab.floor, lab.target)
    report.write_summary(out, summary)
    study_report.write(out, summary, results, describe(setup, data))
    check_reproduction(lab, out, summary)
    return finish(out, results)


def check_reproduction(lab: Lab, out: Path, summary: dict) -> None:
    """With --preset: its expectation checked on what ran, added to the report and the
    summary, and said."""
    if lab.setup.extra.reproduction is None:
        return
    name, preset = lab.setup.extra.reproduction
    try:
        held, measured = preset.check(summary, out)
    except (KeyError, StopIteration, TypeError, ValueError) as e:  # a run failed
        held, measured = False, f"could not be checked ({type(e).__name__}: {e})"
    summary["reproduction"] = {"preset": name, "expected": preset.expected, "held": held,
                               "measured": measured}
    report.write_summary(out, summary)
    text = (out / "report.md").read_text().split("\n")
    at = next(i for i, line in enumerate(text) if line.startswith("## ") and i > 0)
    text[at:at] = reproductions.lines(name, preset, held, measured)
    (out / "report.md").write_text("\n".join(text))
    print(f"{name}: {'held' if held else 'not held'}: {measured}", file=sys.stderr)


def measured_links(lab: Lab, hosts: placement.Hosts, out: Path) -> str:
    """The hosts and their links in words, measured by compare/probe.py with one rank
    per host (OUT/links.json); ConfigError naming the probe's log when it fails."""
    path, log = out / "links.json", out / "probe.log"
    prog = [sys.executable, "-m", "dtlab.lab.compare.probe", str(path)]
    cmd, env = hosts.line([(len(hosts.names), prog)], list(range(len(hosts.names))), out,
                          "probe")
    proc = lab.procs.start(cmd, log, env)
    try:
        proc.wait(timeout=PROBE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pass
    finally:
        lab.procs.stop([proc])
    if proc.returncode or not path.exists():
        raise ConfigError(f"the link probe across {', '.join(hosts.names)} failed "
                          f"({runner.tail(log).strip()}); nothing else ran")
    links = json.loads(path.read_text())
    return f"{hosts.describe()}; links measured at the start ({path.name}): " + \
        probe.describe(links)


def finish(out: Path, results: list[report.Result]) -> int:
    print(f"report: {out / 'report.md'}")
    failed = [r.name for r in results if not r.ok]
    if failed:
        print(f"{PROG}: {len(failed)} of {len(results)} runs failed ({', '.join(failed)}); "
              "see the report", file=sys.stderr)
    return 1 if failed else 0


def main(argv: list[str]) -> int:
    if "--list-methods" in argv:
        print(registry.listing())
        return 0
    expanded, preset, preset_name = reproductions.expand(argv)
    setup, specs = parse_args(expanded)
    setup.extra.reproduction = (preset_name, preset) if preset else None
    opts = setup.extra
    session = build_session(setup)  # the model and data exist and fit: else a ConfigError
    floor = session.dataset.floor
    target, rule = target_loss(opts.target_loss, floor)
    mpiexec = runner.find_mpiexec()
    if opts.sweep:
        sweep.plan(setup.model_name, setup.model, opts.widths, 1, setup.run.steps)  # or named
        return run_sweep(setup, specs[0], argv, session, out_dir(opts.out), mpiexec, target,
                         rule)
    grid = opts.grid
    out = out_dir(opts.out)
    data = setup_record(setup, argv, session, target, rule)
    trivial = len(grid.points()) == 1 and opts.seeds == 1
    tuning = sum(len(g) for _, g in study.tuning_plan(specs, grid)) \
        if len(grid.points()) > 1 else 0
    runs = tuning + len(specs) * opts.seeds
    print(f"{runs} runs of {setup.model_name} into {out}"
          + ("" if trivial else f": {len(specs)} methods, tuned over {grid.describe() or '-'}, "
             f"then {opts.seeds} seed(s) each at its best"), file=sys.stderr)
    load_before = os.getloadavg()
    lab = Lab(setup, data, floor, target, mpiexec, Processes())
    # SIGTERM cleaned up as Ctrl-C is; SIGINT too where it came ignored (a shell's
    # background job), which Python would otherwise keep: every process it started ends
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.default_int_handler)
    try:
        if opts.launcher == "emulated":
            lab.hosts = cluster.EmulatedCluster(opts.emulated_hosts, opts.link_gbit, out,
                                                opts.tcp_cc).__enter__()
            data["cluster"] = lab.hosts.describe()
            data["emulated"] = {"hosts": opts.emulated_hosts, "link_gbit": opts.link_gbit,
                                "tcp_cc": lab.hosts.congestion_control()}
            print(lab.hosts.describe(), file=sys.stderr)
        if opts.real:
            data["cluster"] = measured_links(lab, opts.real, out)
            print(data["cluster"], file=sys.stderr)
        if trivial:
            return run_single(lab, out, specs, load_before)
        return run_study(lab, out, specs, grid, load_before)
    finally:
        kept = {sig: signal.signal(sig, signal.SIG_IGN)  # a second Ctrl-C does not cut it short
                for sig in (signal.SIGINT, signal.SIGTERM)}
        lab.procs.stop_all()
        if lab.hosts is not None:
            lab.hosts.close()
        for sig, handler in kept.items():
            signal.signal(sig, handler)


def cli() -> None:
    sys.exit(run_cli(main, PROG))
