"""One training step's time: compute plus the communication it leaves exposed.

    sync     step = compute + straggler + exposed all-reduce
             exposed = last bucket + max(0, other buckets - backward)
    async    step = pull + compute + push          (dtlab-worker does them in turn)
             + straggler under BSP (a round's pulls wait for the slowest push)
    time to target = step x steps to target        (Hadjis et al. 2016, Omnivore)

Compute is models/cost.py's FLOPs per step over a calibrated rate: t0 + F / R
(calibration_fit.py), or the measured step of exactly this model and batch when
the calibration holds one, or F / (--tflops) at scale.

Stragglers. Every rank waits for the slowest in the all-reduce (a BSP
round: for the slowest worker), so a step is the slowest of N compute times,
not the typical one: a rank's step is taken as normal with the spread of
one process's measured steps (robustly, from their interquartile range),
N ranks as N independent draws, and the expected maximum less the typical
step is added (step.ComputeRate.straggler_s; Gumbel 1958 for the order
statistics). Without measured steps (a preset device) the spread is taken
as none.

Overlap. The sync trainer starts each gradient bucket's all-reduce on a
comm thread as soon as backward has produced it (collective/reducers/buckets.py), so
all but the last bucket can hide behind the rest of backward (2/3 of the
matmul FLOPs). With k micro-batches a step (--grad-accum k) the gradients are
final only in the last micro-batch's backward, and dtlab-sync starts the
bucket reducer there alone (models/model.py Replica.compute_grads passes
grad_ready to the last backward only, as DDP's no_sync): the all-reduce hides
behind 2/3 of one micro-batch's compute, compute / k, not the step's. That
needs somewhere for the comm thread to run: a GPU computes while the host
communicates, a CPU rank needs a core of its own.
With as many ranks as cores or more on one host, the comm thread takes its
time from compute, so nothing is hidden.

Async on a shared host. A worker blocked on a pull or push sleeps in gRPC
and gives its core away, so the workers do not all compute at once as the
sync ranks (which poll in their waits, collective/transport/waits.py) do: a round
takes the longer of its critical path (one worker's compute with its
threads, the slowest worker, pull, push) and the CPU work of the round
spread over the cores, W (compute + one worker's pull + push round) / C;
a pull or push round is taken as one core busy (the worker and its shard
take turns), and the parts are stretched in proportion.

Measured together. Where N processes were timed computing at once on the
host (dtlab.lab.bench.together, as dtlab-simulate --validate does), their
typical step and the slowest one's lateness replace the two estimates
above: the sharing of cores, caches and the scheduler's slices is in them.
What they leave out is communication: an all-reduce as below, and for an
async round its pull and push plus the CPU of the other workers' rounds,
which runs while the slowest worker computes (ps_step_together).

Ranks sharing a host's cores (models/run/threads.py): R processes on C
cores get max(1, C // R) BLAS threads each, and when R > C each computes at
C / R of a core's rate; the compute time is the calibrated one at that
thread count times max(1, R / C), and so is the all-reduce's (its waits and
copies are CPU work too; calibration_fit.py fits its constants the same way).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

import numpy as np

from dtlab.lab.simulate.formulas import Network, ServerLink, bucketed_allreduce_s, pserver_s

BACKWARD_SHARE = 2 / 3  # backward's matmul FLOPs are twice forward's (models/cost.py)
IQR_PER_SIGMA = 1.349  # a normal distribution's interquartile range in sigmas


@dataclass(frozen=True)
class Workload:
    model: str
    config: dict  # the model config, as models.cost records it
    batch_size: int  # per rank or worker
    flops_step: float
    grad_bytes: float
    optimizer: str
    microbatches: int = 1  # --grad-accum: flops_step is all of them; only the last hides
    overlapped: bool = True  # False: reduced after the last backward (--grad-reduce-after)

    @property
    def last_backward_share(self) -> float:
        """The step's compute fraction the all-reduce can hide behind: the last
        micro-batch's backward (none where the all-reduce starts after it)."""
        return BACKWARD_SHARE / self.microbatches if self.overlapped else 0.0


@dataclass(frozen=True)
class ComputeRate:
    """Seconds of one step of a workload: t0 + F / R, or a measured step."""

    flops_per_s: float
    overhead_s: float = 0.0
    measured_s: float | None = None  # this very model and batch, measured (median)
    source: str = ""
    samples_s: tuple[float, ...] = ()  # every measured step, when kept

    def seconds(self, flops: float) -> float:
        if self.measured_s is not None:
            return self.measured_s
        return self.overhead_s + flops / self.flops_per_s

    def straggler_s(self, n: int) -> float:
        """E[slowest of n steps] - the typical step: n independent draws from a normal
        distribution whose spread is the measured steps' interquartile range / 1.349 (a
        robust sigma: a burst of another process's work on a shared host is not a rank's
        own spread); 0 without measured steps."""
        if len(self.samples_s) < 4 or n < 2:
            return 0.0
        q1, _, q3 = statistics.quantiles(self.samples_s, n=4)
        return (q3 - q1) / IQR_PER_SIGMA * expected_max_normal(n)


def expected_max_normal(n: int) -> float:
    """E[max of n independent standard normals] = integral of x n phi(x) Phi(x)^(n-1) dx
    (0.5642 for n = 2, 1.0294 for n = 4), by the trapezoid rule on [-8, 8]."""
    x = np.linspace(-8.0, 8.0, 4001)  # (K,)
    pdf = np.exp(-x * x / 2) / math.sqrt(2 * math.pi)  # (K,)
    cdf = 0.5 * (1 + np.array([math.erf(v / math.sqrt(2)) for v in x]))  # (K,)
    return float(np.trapezoid(x * n * pdf * cdf ** (n - 1), x))


def same_step(row: dict, w: Workload) -> bool:
    """A measured row is of this very step: same model, batch and FLOPs, and the same value
    of every config field both name (a field added to the model since, at a value that
    leaves the FLOPs alone, does not make it another model)."""
    common = row["config"].keys() & w.config.keys()
    return (row["model"] == w.model and row["batch_size"] == w.batch_size
            and row["flops_step"] == w.flops_step
            and all(row["config"][k] == w.config[k] for k in common))


def compute_rate(calibration: dict, w: Workload, threads: int) -> ComputeRate:
    """The calibrated rate nearest `threads`: an exact row of this model and batch first,
    else the fit of its model kind."""
    exact = [r for r in calibration.get("compute_rows", []) if same_step(r, w)]
    if exact:
        r = min(exact, key=lambda r: abs(r["threads"] - threads))
        return ComputeRate(r["flops_step"] / r["step_s"], measured_s=r["step_s"],
                           source=f"measured step at {r['threads']} thread(s)",
                           samples_s=tuple(r.get("samples_s", ())))
    fits = [f for f in calibration.get("compute", []) if f["model"] == w.model]
    if not fits:
        raise LookupError(f"the calibration has no compute rate for {w.model}: add a "
                          "bench model JSON")
    f = min(fits, key=lambda f: abs(f["threads"] - threads))
    return ComputeRate(f["flops_per_s"], f["overhead_s"],
                       source=f"{w.model} fit at {f['threads']} thread(s)")


@dataclass(frozen=True)
class Host:
    """How many ranks or workers share a host's cores (a CPU host), or none (devices)."""

    cores: int = 0  # 0: each rank has its own device and a host core to communicate

    def threads(self, ranks: int) -> int:
        return max(1, self.cores // ranks) if self.cores else 1

    def share(self, ranks: int) -> float:
        return max(1.0, ranks / self.cores) if self.cores else 1.0

    def overlap(self, ranks: int) -> bool:
        return not self.cores or ranks < self.cores


@dataclass
class Step:
    kind: str  # ring, naive, ps
    n: int  # ranks or workers
    compute_s: float
    comm_s: float  # exposed (sync) or pull + push (async)
    algo: str = ""
    parts: dict = field(default_factory=dict)

    @property
    def step_s(self) -> float:
        return self.compute_s + self.comm_s


def sync_step(kind: str, w: Workload, n: int, net: Network, compute_s: float,
              bucket_bytes: float, host: Host, straggler_s: float = 0.0) -> Step:
    """straggler_s: how much later than the median the slowest rank ends backward; every
    rank waits for it in the all-reduce."""
    ranks_here = min(n, net.gpus_per_node) if not host.cores else n
    total, last, algo = bucketed_allreduce_s(kind, w.grad_bytes, bucket_bytes, n, net,
                                             one_host_shm=bool(host.cores))
    total, last = total * host.share(n), last * host.share(n)  # the ranks' turns on the cores
    if host.overlap(ranks_here):
        exposed = last + max(0.0, total - last - w.last_backward_share * compute_s)
    else:
        exposed = total
    return Step(kind, n, compute_s, straggler_s + exposed, algo,
                {"allreduce_s": total, "straggler_s": straggler_s,
                 "overlap": host.overlap(ranks_here)})


def ps_step(w: Workload, workers: int, shards: int, ps: ServerLink, compute_s: float,
            host: Host, straggler_s: float = 0.0) -> Step:
    """compute_s: a worker's step with its cores to itself; straggler_s: under BSP a round's
    pulls wait for the slowest worker's push. On a shared host the step is the longer of
    that critical path and the round's CPU work over the cores (see the module docstring)."""
    pull, push = pserver_s(w.grad_bytes, workers, shards, ps)
    critical = compute_s + straggler_s + pull + push
    stretch = 1.0
    if host.cores:
        alone = pserver_s(w.grad_bytes, 1, 1, ps)  # a round's CPU time: one side runs at a time
        work = workers * (compute_s + sum(alone)) / host.cores
        stretch = max(1.0, work / critical)
    return Step("ps", workers, stretch * compute_s, stretch * (straggler_s + pull + push),
                f"S={shards}", {"pull_s": stretch * pull, "push_s": stretch * push,
                                "straggler_s": stretch * straggler_s, "cpu_bound": stretch > 1})


def ps_step_together(w: Workload, workers: int, shards: int, ps: ServerLink, compute_s: float,
                     host: Host, straggler_s: float = 0.0) -> Step:
    """A round on this host when the workers' compute was measured stepping together
    (dtlab.lab.bench.together): compute_s a worker's step and straggler_s how much later
    the slowest one ends (under BSP), both with the cores already shared. What the
    measurement leaves out is the communication's CPU: while the slowest worker computes,
    the other W - 1 workers' rounds run, and the shards' work on them, each taking the CPU
    bench fanout measured (ps.cpu; without it, S rounds of n / S bytes with one core
    busy: the worker and its shard taking turns); where the processes (W workers, S
    shards) outnumber the cores, that CPU comes out of the cores the slowest worker
    computes on, spread over them. Then its own pull and push."""
    pull, push = pserver_s(w.grad_bytes, workers, shards, ps)
    if ps.cpu is not None:
        round_cpu = ps.cpu.seconds(w.grad_bytes, shards)
    else:
        round_cpu = shards * sum(pserver_s(w.grad_bytes / shards, 1, 1, ps))
    crowded = host.cores and workers + shards > host.cores
    steal = (workers - 1) * round_cpu / host.cores if crowded else 0.0
    return Step("ps", workers, compute_s, straggler_s + steal + pull + push, f"S={shards}",
                {"pull_s": pull, "push_s": push, "straggler_s": straggler_s,
                 "comm_cpu_s": steal, "cpu_bound": False})
