"""The comparison's methods: one entry per method, and the run a name stands for.

Each `Method` entry holds its run-name pattern, a one-line summary, the exchange it
runs (the class in the package that moves its gradients or parameters), and how a name
it matches becomes a `RunSpec`: the topology, the fields `runner.py` turns into the
flags of every program it starts, and the words the report shows for it. `parse` tries
the entries in order; `dtlab-compare --list-methods` prints them (`listing`).

Adding a method is one entry: its pattern and builder. Flags that no field below
carries go into the spec's `sync_flags` (every `dtlab-sync` rank), `worker_flags`
(every `dtlab-worker`) or `server_flags` (every `dtlab-pserver serve`), which the
launch appends as they are.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, replace

from dtlab.models.config import ConfigError

DILOCO = ("nesterov", 0.7, 0.9)  # Douillard et al. 2023's outer optimizer, lr, momentum


@dataclass(frozen=True)
class RunSpec:
    """One run of the comparison, as its name says."""

    name: str
    topology: str  # "sync", "async" or "simulated"
    what: str = ""  # the method in words, for the report
    allreduce: str = ""
    zero: int = 0  # sync: the ZeRO stage (dtlab-sync --zero)
    consistency: str = ""
    staleness: int = 0  # the SSP bound
    staleness_lr: str = "none"
    local_steps: int = 0  # local SGD / DiLoCo: inner steps per outer round (0: off)
    outer: str = "sgd"  # their outer optimizer: sgd (lr 1) or diloco (DILOCO)
    outer_lr: float | None = None  # a tuned outer lr in place of outer's (compare/study.py)
    outer_momentum: float | None = None  # ... a tuned outer momentum
    compress: str = ""  # dtlab-sync / dtlab-worker --compress (topk:F, randk:F, sign, ...)
    error_feedback: bool = True
    backups: int = 0  # async BSP: backup workers beside the --ranks N
    sync_flags: tuple[str, ...] = ()  # appended to every dtlab-sync rank's command
    worker_flags: tuple[str, ...] = ()  # ... to every dtlab-worker's
    server_flags: tuple[str, ...] = ()  # ... to every dtlab-pserver serve's

    @classmethod
    def parse(cls, name: str) -> RunSpec:
        return parse(name)

    def describe(self) -> str:
        return self.what

    @property
    def has_outer(self) -> bool:
        """Local SGD, DiLoCo and Streaming DiLoCo step an outer optimizer."""
        return self.local_steps > 0

    def outer_optimizer(self) -> tuple[str, float, float]:
        """The outer optimizer its servers (async) or ranks (sync) run, lr and momentum:
        outer's constants (DILOCO; sgd lr 1, momentum 0: model averaging) unless tuned."""
        name, lr, momentum = (DILOCO if self.outer == "diloco" else ("sgd", 1.0, 0.0))
        if self.outer == "diloco" and self.topology == "async":
            name = "delayed-nesterov"
        return (name, lr if self.outer_lr is None else self.outer_lr,
                momentum if self.outer_momentum is None else self.outer_momentum)


Build = Callable[[str, re.Match], RunSpec]


@dataclass(frozen=True)
class Method:
    """One method of the comparison: the names it answers to and the run each stands for."""

    usage: str  # the names, with their parameters in capitals
    pattern: str  # a regular expression matched against the whole run name
    summary: str  # one line: what the method does
    exchange: str  # the class (dtlab.*) that moves its gradients or parameters
    build: Build

    def match(self, name: str) -> re.Match | None:
        return re.fullmatch(self.pattern, name)


def compress_flag(name: str, text: str, sparse: str | None, percent: str | None,
                  rank: str | None) -> str:
    """A run name's compressor (topkP, randkP, sign, powersgdR) as --compress takes it
    (topk:P/100, ..., sign, powersgd:R); a ConfigError for a percent outside (0, 100]."""
    if sparse:
        if not 0 < float(percent) <= 100:
            raise ConfigError(f"--runs {name}: {sparse}P takes a percent P in (0, 100]")
        return f"{sparse}:{float(percent) / 100:g}"
    return "sign" if text.startswith("sign") else f"powersgd:{rank}"


def _outer_words(topology: str, outer: str, lr: float | None = None,
                 momentum: float | None = None) -> str:
    """The outer optimizer in words: its constants, or the tuned lr / momentum given."""
    tuned = lr is not None or momentum is not None
    default = DILOCO[1:] if outer == "diloco" else (1.0, 0.0)
    lr, momentum = (default[0] if lr is None else lr,
                    default[1] if momentum is None else momentum)
    if outer != "diloco":
        return (f"outer SGD lr {lr:g}, momentum {momentum:g} (tuned)" if tuned
                else "outer SGD lr 1 (model averaging)")
    if topology == "sync":
        source = "DiLoCo's, tuned" if tuned else "DiLoCo"
        return f"outer Nesterov lr {lr:g}, momentum {momentum:g} ({source})"
    source = "Liu et al. 2024, tuned" if tuned else "Liu et al. 2024"
    return f"outer Delayed Nesterov lr {lr:g}, momentum {momentum:g}, period N ({source})"


def with_outer(spec: RunSpec, lr: float | None, momentum: float | None) -> RunSpec:
    """`spec` with its outer optimizer's lr and momentum tuned (None: the constant kept)."""
    if not spec.has_outer:
        raise ConfigError(f"{spec.name} has no outer optimizer to take an outer lr")
    if lr is None and momentum is None:
        return spec
    what = spec.what.replace(_outer_words(spec.topology, spec.outer),
                             _outer_words(spec.topology, spec.outer, lr, momentum))
    return replace(spec, what=what, outer_lr=lr, outer_momentum=momentum)


def _allreduce(name: str, m: re.Match) -> RunSpec:
    words = {"ring": "sync, our ring", "auto": "sync, ours chosen by size",
             "naive": "sync, reduce + broadcast", "mpi": "sync, MPI_Allreduce"}
    return RunSpec(name, "sync", words[m["allreduce"]], allreduce=m["allreduce"])


def _zero(name: str, m: re.Match) -> RunSpec:
    return RunSpec(name, "sync", f"sync, ZeRO stage {m['zero']}", allreduce="ring",
                   zero=int(m["zero"]))


def _zero_quantized(name: str, m: re.Match) -> RunSpec:
    """sync-zero3-qwz8[-qgzB], sync-zeroS-qgzB: ZeRO++'s int8 weights / B-bit gradients."""
    grads = m["both"] or m["qg"]
    flags = (("--zero-quantize-weights", "int8") if m["zero"] is None else ()) + \
        (("--zero-quantize-grads", f"int{grads}") if grads else ())
    zero = int(m["zero"] or 3)
    return RunSpec(name, "sync", f"sync, ZeRO stage {zero}, {' '.join(flags)} (ZeRO++)",
                   allreduce="ring", zero=zero, sync_flags=flags)


def _local(topology: str) -> Build:
    where = "sync" if topology == "sync" else "async (ASP servers)"

    def build(name: str, m: re.Match) -> RunSpec:
        H, outer = int(m["H"]), "diloco" if m["kind"] == "diloco" else "sgd"
        what = (f"{where} local SGD, {H} inner steps a round, "
                f"{_outer_words(topology, outer)}")
        return RunSpec(name, topology, what, allreduce="ring" if topology == "sync" else "",
                       consistency="asp" if topology == "async" else "", local_steps=H,
                       outer=outer)
    return build


def _speed_aware(name: str, m: re.Match) -> RunSpec:
    """async-localH-dylu, async-dilocoH-dylu: async local SGD / DiLoCo, H per worker."""
    spec = _local("async")(name, m)
    return replace(spec, worker_flags=("--dylu",), what=(
        f"{spec.what}; speed-aware: worker i's rounds take H_i = round(H t_fast / t_i) "
        "steps (DyLU, Liu et al. 2024)"))


def _streaming(name: str, m: re.Match) -> RunSpec:
    H, F, tau = int(m["H"]), int(m["F"]), int(m["tau"] or 0)
    bits = m["bits"] or "fp32"
    what = (f"sync Streaming DiLoCo, {H} inner steps a round in {F} fragments (one every "
            f"{H // F} steps), exchange overlapping {tau} step(s), outer gradients in {bits}, "
            f"{_outer_words('sync', 'diloco')}")
    flags = ("--fragments", str(F), "--overlap-steps", str(tau), "--outer-precision", bits)
    return RunSpec(name, "sync", what, allreduce="ring", local_steps=H, outer="diloco",
                   sync_flags=flags)


def _async_streaming(name: str, m: re.Match) -> RunSpec:
    """async-streamHxF: async DiLoCo whose outer gradient is pushed in F fragments."""
    H, F = int(m["H"]), int(m["F"])
    what = (f"async (ASP servers) Streaming DiLoCo, {H} inner steps a round in {F} fragments "
            f"(one pushed every {H // F} steps), {_outer_words('async', 'diloco')}")
    return RunSpec(name, "async", what, consistency="asp", local_steps=H, outer="diloco",
                   worker_flags=("--fragments", str(F)))


def _onebit(name: str, m: re.Match) -> RunSpec:
    W = int(m["W"])
    what = (f"sync 1-bit Adam, {W} warm-up steps of Adam, then the momentum's signs with "
            "error feedback, the variance frozen")
    return RunSpec(name, "sync", what, allreduce="ring", sync_flags=("--onebit-adam", str(W)))


def _quantized(name: str, m: re.Match) -> RunSpec:
    q = f"int{m['bits']}"
    return RunSpec(name, "sync", f"sync, gradients through the quantized ring ({q}, "
                                 "re-quantized at every hop)", allreduce="ring",
                   sync_flags=("--quantize-grads", q))


def _pipedream(name: str, m: re.Match) -> RunSpec:
    words = {"flush": "PipeDream-Flush (1F1B, flushed every step)",
             "2bw": "PipeDream-2BW (no flush, gradients one weight version stale)",
             "stash": "PipeDream weight stashing (stage s of p, p - 1 - s versions stale)"}
    return RunSpec(name, "sync", f"sync pipeline (--pp), {words[m['mode']]}",
                   allreduce="ring", sync_flags=("--pipedream", m["mode"]))


def _compressed(topology: str) -> Build:
    def build(name: str, m: re.Match) -> RunSpec:
        compress = compress_flag(name, m["compress"], m["sparse"], m["percent"],
                                 m.groupdict().get("rank"))
        ef = not m["noef"]
        where = "sync" if topology == "sync" else f"async {m['cons'].upper()}"
        what = (f"{where}, gradients compressed {compress}, "
                f"{'error feedback' if ef else 'no error feedback'}")
        return RunSpec(name, topology, what, allreduce="ring" if topology == "sync" else "",
                       consistency=m["cons"] if topology == "async" else "",
                       compress=compress, error_feedback=ef)
    return build


def _backup(name: str, m: re.Match) -> RunSpec:
    b = int(m["backups"])
    return RunSpec(name, "async", f"async, BSP with {b} backup worker(s) beside the N",
                   consistency="bsp", backups=b)


def _consistency(name: str, m: re.Match) -> RunSpec:
    consistency = "ssp" if m["bound"] is not None else m["consistency"]
    bound = int(m["bound"] or 0)
    div = ", lr / staleness" if m["div"] else ""
    rule = f"SSP s={bound}" if consistency == "ssp" else consistency.upper()
    return RunSpec(name, "async", f"async, {rule}{div}", consistency=consistency,
                   staleness=bound, staleness_lr="divide" if m["div"] else "none")


def _simulated(name: str, m: re.Match) -> RunSpec:
    div = ", lr / staleness" if m["div"] else ""
    return RunSpec(name, "simulated", f"ASP simulated in one process (N - 1 stale){div}",
                   consistency="asp", staleness_lr="divide" if m["div"] else "none")


SPARSE = r"(?P<sparse>topk|randk)(?P<percent>\d+(\.\d+)?)"  # topkP, randkP: P percent kept
METHODS: tuple[Method, ...] = (
    Method("sync-ring | sync-auto | sync-naive | sync-mpi",
           r"sync-(?P<allreduce>ring|auto|naive|mpi)",
           "gradients averaged every step: our ring, ours chosen by size, reduce + "
           "broadcast, or MPI_Allreduce",
           "dtlab.collective.train.DataParallelReducer", _allreduce),
    Method("sync-zeroS", r"sync-zero(?P<zero>[123])",
           "ZeRO stage S = 1, 2, 3 (Rajbhandari et al. 2020): optimizer state, gradients, "
           "parameters sharded over the ranks",
           "dtlab.collective.zero.trainer.ZeroReducer", _zero),
    Method("sync-zero3-qwz8[-qgzB] | sync-zeroS-qgzB",
           r"sync-zero(?:3-qwz8(?:-qgz(?P<both>[84]))?|(?P<zero>[23])-qgz(?P<qg>[84]))",
           "ZeRO++ (Wang et al. 2023): stage 3's weights all-gathered as int8, stage S = 2, 3's "
           "gradients reduce-scattered in B = 8 or 4 bits re-quantized at every ring hop",
           "dtlab.collective.zero.quantized.QuantizedUnits", _zero_quantized),
    Method("sync-localH | sync-dilocoH", r"sync-(?P<kind>local|diloco)(?P<H>[1-9]\d*)",
           "H local steps, then the outer gradient all-reduced (Stich 2019; DiLoCo: outer "
           "Nesterov, Douillard et al. 2023)",
           "dtlab.collective.reducers.local_sgd.LocalReducer", _local("sync")),
    Method("sync-streamHxF[-tT][-int8|-int4]",
           r"sync-stream(?P<H>[1-9]\d*)x(?P<F>[1-9]\d*)(-t(?P<tau>\d+))?(-(?P<bits>int8|int4))?",
           "Streaming DiLoCo (Douillard et al. 2025): F fragments, one synchronised every H / "
           "F steps, its exchange overlapping T steps, outer gradients in fp32, int8 or 4 bits",
           "dtlab.collective.reducers.streaming.LocalOptimizer", _streaming),
    Method("sync-qring8 | sync-qring4", r"sync-qring(?P<bits>[84])",
           "gradients averaged through a ring all-reduce of int8 or 4-bit payloads, a scale per "
           "256 values, re-quantized at every hop (INTELLECT-1's ring)",
           "dtlab.collective.algorithms.quantized_ring.QuantizedReducer", _quantized),
    Method("sync-onebitadamW", r"sync-onebitadam(?P<W>[1-9]\d*)",
           "1-bit Adam (Tang et al. 2021): W warm-up steps of Adam, then the momentum all-"
           "gathered as signs with error feedback, the variance frozen",
           "dtlab.collective.reducers.onebit_adam.OneBitReducer", _onebit),
    Method("sync-zerooneadamW", r"sync-zerooneadam(?P<W>[1-9]\d*)",
           "0/1 Adam (Lu et al. 2022): the variance updated on a doubling interval up to step "
           "W, then frozen; the momentum all-gathered as signs with error feedback, after W "
           "on a doubling interval of local steps (--zero-one-* flags: their defaults)",
           "dtlab.collective.reducers.zero_one_adam.ZeroOneReducer",
           lambda name, m: RunSpec(name, "sync", f"sync 0/1 Adam, the variance frozen after "
                                   f"step {m['W']}, the momentum's signs with error feedback, "
                                   "local steps after it", allreduce="ring",
                                   sync_flags=("--zero-one-adam", m["W"]))),
    Method("sync-pipedream-flush | sync-pipedream-2bw | sync-pipedream-stash",
           r"sync-pipedream-(?P<mode>flush|2bw|stash)",
           "a pipeline of --pp stages (Narayanan et al. 2021): 1F1B flushed every step, or "
           "2BW's updates one weight version stale, or PipeDream's weight stashing "
           "(--grad-accum 1); staleness and the kept versions' bytes recorded",
           "dtlab.models.pipedream.VersionedReplica", _pipedream),
    Method("sync-topkP | sync-randkP | sync-sign | sync-powersgdR [-noef]",
           rf"sync-(?P<compress>{SPARSE}|sign|powersgd(?P<rank>[1-9]\d*))(?P<noef>-noef)?",
           "compressed gradients with error feedback (Karimireddy et al. 2019; PowerSGD, "
           "Vogels et al. 2019); P percent kept, R the rank",
           "dtlab.collective.reducers.compress.CompressReducer", _compressed("sync")),
    Method("async-localH | async-dilocoH", r"async-(?P<kind>local|diloco)(?P<H>[1-9]\d*)",
           "async local SGD: each worker pushes its outer gradient every H steps to ASP "
           "servers (DiLoCo: Delayed Nesterov, Liu et al. 2024)",
           "dtlab.pserver.worker.exchange.OuterPushPull", _local("async")),
    Method("async-localH-dylu | async-dilocoH-dylu",
           r"async-(?P<kind>local|diloco)(?P<H>[1-9]\d*)-dylu",
           "async local SGD / DiLoCo with speed-aware local steps (DyLU, Liu et al. 2024): "
           "worker i's rounds take H_i = round(H t_fast / t_i) steps, so that every outer "
           "gradient covers about the same wall time",
           "dtlab.pserver.worker.exchange.OuterPushPull",
           _speed_aware),
    Method("async-streamHxF", r"async-stream(?P<H>[1-9]\d*)x(?P<F>[1-9]\d*)",
           "Streaming DiLoCo on the servers (Douillard et al. 2025): each worker pushes one "
           "of F fragments of its outer gradient every H / F inner steps, a ranged push to "
           "the servers' Delayed Nesterov",
           "dtlab.pserver.worker.streaming.StreamingPushPull", _async_streaming),
    Method("async-bsp-backupB", r"async-bsp-backup(?P<backups>[1-9]\d*)",
           "BSP closing each round at the first N of N + B gradients (Chen et al. 2016)",
           "dtlab.pserver.worker.exchange.PushPull", _backup),
    Method("async-bsp-topkP | async-asp-randkP | async-bsp-sign ... [-noef]",
           rf"async-(?P<cons>bsp|asp)-(?P<compress>{SPARSE}|sign)(?P<noef>-noef)?",
           "compressed pushes with error feedback, applied by the servers as ranged pushes",
           "dtlab.pserver.worker.compressed_push.CompressedPush", _compressed("async")),
    Method("async-bsp | async-sspS | async-asp [-div]",
           r"async-(?P<consistency>bsp|asp|ssp(?P<bound>\d+))(?P<div>-div)?",
           "parameter servers under BSP, SSP with bound S, or ASP; -div: lr / staleness "
           "(Zhang et al. 2016)",
           "dtlab.pserver.worker.exchange.PushPull", _consistency),
    Method("sim-asp [-div]", r"sim-asp(?P<div>-div)?",
           "N ASP workers simulated in one process (each gradient N - 1 versions stale)",
           "dtlab.models.run.simulated.SimulatedWorkers", _simulated),
)


def known() -> str:
    return "; ".join(m.usage for m in METHODS)


def parse(name: str) -> RunSpec:
    """The run `name` stands for; a ConfigError naming the known methods if none."""
    for method in METHODS:
        m = method.match(name)
        if m is not None:
            return method.build(name, m)
    raise ConfigError(f"--runs: unknown run {name!r} (known: {known()})")


def listing() -> str:
    """`dtlab-compare --list-methods`: every method, its names, what it does, its exchange."""
    lines = []
    for m in METHODS:
        lines += [m.usage, f"    {m.summary}", f"    exchange: {m.exchange}"]
    return "\n".join(lines)
