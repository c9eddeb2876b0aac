"""Each method's time to target at N workers on a named cluster: its steps to target
(simulate/statistical.py, measured in one process or fitted beyond) times the cost
model's step (Hadjis et al. 2016: time to target = hardware x statistical efficiency).

    seconds = method_step_s(Method.parse("asp"), "transformer", config, 64,
                            "dgx-h100-ndr", batch=16, speeds=Speeds())

The step of each method at N, from the cost model's public functions (simulate/
clusters.py's GPUs and links, bf16 compute and wire unless told):

    sync       clusters.step_time (our ring family, all but the last bucket behind the
               backward), plus the wait for the slowest of N workers: compute x
               (arrivals.round_time(N) - 1)
    backupB    a BSP round of N + B workers on parameter servers (step.ps_step), its compute
               the N-th fastest of N + B (arrivals.round_time)
    asp, sspS  a worker's pull + compute + push on parameter servers (step.ps_step); N
               workers make arrivals.throughput(N) pushes per worker step (N with equal
               speeds; fewer where SSP's bound holds the fast ones back), so a round of N
               pushes takes N / throughput worker steps
    localH,    simulate/methods.method_step: one all-reduce every H steps; the compressed
    dilocoH,   exchanges and their compressors' memory passes at the GPU's HBM bandwidth;
    topkP ...  plus the same wait for the slowest as sync

Parameter servers: one shard a node's worth of workers (max(1, N / G) shards, each on a
host of its own behind the cluster's inter-node link: clusters.server_link).

Beyond the largest N simulated, the steps are fitted as steps(N) = a + c / N on the
simulated points where the target was reached (McCandlish et al. 2018, "An Empirical
Model of Large-Batch Training", eq. 2.11: S = S_min (1 + B_noise / B) with B = N x the
per-worker batch; for an async method it says the pushes grow linearly in N), a >= 0,
c >= 0. A method that missed the target at its largest simulated N is taken to miss it
at every larger N (more workers, more staleness or a larger batch at the same lr).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from dtlab.lab.simulate import clusters, hardware
from dtlab.lab.simulate.arrivals import Speeds, round_time, throughput
from dtlab.lab.simulate.methods import Method as CostMethod
from dtlab.lab.simulate.methods import gradient_of, method_step, preset_compute
from dtlab.lab.simulate.precision import Precision
from dtlab.lab.simulate.statistical import Method
from dtlab.lab.simulate.step import Host, ps_step


@dataclass(frozen=True)
class Steps:
    """A method's per-worker steps to target at N and where the number comes from."""

    steps: float | None  # None: not reached
    source: str  # "simulated", "fit" or "as sync" (backup)


def fit(points: dict[int, int | None]) -> tuple[float, float] | None:
    """(a, c) of steps = a + c / N by least squares on the reached points (at least one;
    one point: c = 0), both clipped at 0; None when none was reached."""
    reached = sorted((n, s) for n, s in points.items() if s is not None)
    if not reached:
        return None
    if len(reached) == 1:
        return float(reached[0][1]), 0.0
    x = np.array([1.0 / n for n, _ in reached])  # (K,)
    y = np.array([float(s) for _, s in reached])  # (K,)
    c, a = np.polyfit(x, y, 1)
    if a < 0:  # steps do not fall below zero: through the origin
        a, c = 0.0, float(x @ y / (x @ x))
    if c < 0:  # more workers never save steps here: the mean
        a, c = float(y.mean()), 0.0
    return float(a), float(c)


def steps_at(points: dict[int, int | None], n: int) -> Steps:
    """Simulated where N was simulated; else the fit beyond the largest N simulated."""
    if n in points:
        return Steps(points[n], "simulated")
    largest = max(points)
    if n < largest:
        raise ValueError(f"N = {n} lies between simulated sizes: simulate it")
    if points[largest] is None:
        return Steps(None, "fit")
    a, c = fit(points)
    return Steps(a + c / n, "fit")


def shards_for(n: int, cluster: str) -> int:
    return max(1, n // clusters.cluster(cluster).gpus_per_node)


def method_step_s(m: Method, model: str, config, n: int, cluster: str, batch: int,
                  speeds: Speeds, precision: str = "bf16", wire: str = "bf16") -> float:
    """Seconds of one per-worker step of method m at n workers (the module docstring):
    for asp/ssp the time of a round of n pushes."""
    sync = clusters.step_time(model, config, n, cluster, batch, precision=precision,
                              wire=wire)
    compute = sync.compute_s
    slowest = compute * (round_time(n, speeds) - 1)
    if m.kind == "sync":
        return sync.step_s + slowest
    ps, w = clusters.server_link(cluster), sync.workload
    if m.kind == "backup":
        b = int(m.value)
        late = compute * round_time(n, speeds, b)
        return ps_step(w, n + b, shards_for(n, cluster), ps, late, Host(0)).step_s
    if m.kind in ("asp", "ssp"):
        worker = ps_step(w, n, shards_for(n, cluster), ps, compute, Host(0)).step_s
        bound = int(m.value) if m.kind == "ssp" else None
        return worker * n / throughput(n, speeds, bound)
    p = Precision.of("float32", precision, wire)
    grad = gradient_of(model, config, p.gradient)
    value = m.value if m.kind in ("local", "diloco") else m.value / 100
    cost = CostMethod(m.kind, value)
    r = clusters.rate(cluster, model, config, batch, p)
    gpu = hardware.gpu(clusters.cluster(cluster).gpu)
    cc = preset_compute([cost], grad, gpu.hbm_bytes_per_s / 1e9, r.flops_per_s)
    return method_step(cost, grad, n, clusters.network(cluster), compute, Host(0), slowest,
                       cc).step_s


@dataclass(frozen=True)
class Cell:
    n: int
    steps: Steps
    step_s: float
    time_s: float | None  # None: the target not reached

    def as_dict(self) -> dict:
        return {"n": self.n, "steps": self.steps.steps, "source": self.steps.source,
                "step_s": self.step_s, "time_s": self.time_s}


def cells(m: Method, points: dict[int, int | None], sizes: list[int], model: str, config,
          cluster: str, batch: int, speeds: Speeds, precision: str = "bf16",
          wire: str = "bf16") -> list[Cell]:
    """m's time to target at each N of `sizes` on `cluster` (points: its simulated steps;
    backup: sync's)."""
    out = []
    for n in sizes:
        st = steps_at(points, n)
        if m.same_steps_as:
            st = Steps(st.steps, f"{st.source}, as {m.same_steps_as}")
        step = method_step_s(m, model, config, n, cluster, batch, speeds, precision, wire)
        out.append(Cell(n, st, step, None if st.steps is None else st.steps * step))
    return out


def crossover(method: list[Cell], base: list[Cell]) -> int | None | str:
    """The smallest N from which `method` reaches the target sooner than `base` at every
    larger N of the grid: an int; "always" from the first N; None: never within it."""
    ahead = [m.time_s is not None and (b.time_s is None or m.time_s < b.time_s)
             for m, b in zip(method, base, strict=True)]
    if not ahead[-1]:
        return None
    first = len(ahead) - 1
    while first > 0 and ahead[first - 1]:
        first -= 1
    return "always" if first == 0 else method[first].n


def crossover_words(label: str, base: str, x: int | None | str, cluster: str,
                    largest: int) -> str:
    if x is None:
        return f"{label} never overtakes {base} up to N = {largest} on {cluster}"
    if x == "always":
        return f"{label} beats {base} at every N on {cluster}"
    return f"{label} overtakes {base} from N = {x} on {cluster}"


def log_sizes(smallest: int, largest: int) -> list[int]:
    """Powers of two from smallest to largest."""
    return [2 ** k for k in range(int(math.log2(smallest)), int(math.log2(largest)) + 1)]
