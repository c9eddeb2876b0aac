"""Each method's steps to the held-out target with N workers, simulated in one process:
the statistical half of the at-scale verdict (simulate/verdict.py; Hadjis et al. 2016's
statistical efficiency).

    setup = session.parse(["--config", "scripts/lab/configs/transformer.json"], "verdict")
    r = steps_to_target(setup, Method.parse("asp"), n=64, target=1.31, eval_every=10,
                        speeds=Speeds())
    r.steps, r.samples                     # per-worker steps (None: not within --steps)

What one step of N workers is, per method, each worker on its own batch of B (the
loader's rank w of N, as the comparison's programs read their data):

    sync       one replica on the union of the N batches (ShardedLoader at batch N B, in
               micro-batches of at most MICRO_BATCH samples: the same mean gradient as N
               ranks' average)
    backupB    BSP closing each round at N of N + B gradients (Chen et al. 2016): every
               accepted gradient was computed on the round's parameters, so its steps
               are sync's (no run of its own); only its time differs (arrivals.round_time)
    asp, sspS  N workers of the given speeds in the order arrivals.trace finds (the
               staleness they produce; equal speeds: models/run/simulated.py's order, bit
               for bit), each gradient computed on the version it read, applied at once at
               the servers' lr, Schedule(N x --steps updates) (-div: lr / staleness, Zhang
               et al. 2016); a step is a round of N pushes
    localH     N replicas, each H inner steps with its own optimizer on its own data from
    dilocoH    the round's global parameters, then the mean outer gradient through the outer
               optimizer (models/outer.py: SGD lr 1, or DiLoCo's Nesterov 0.7 / 0.9,
               Douillard et al. 2023), as collective/reducers/local_sgd.py; the
               replicas run one after another, so only their optimizer states are kept (N of them)
    topkP,     each of the N workers compresses its own gradient with its own error-feedback
    randkP,    residual (models/compress.py), the N payloads are added and divided by N
    sign       (collective/reducers/compress.py)

The held-out loss (make_heldout's examples) is evaluated every `eval_every` steps (at the
end of a round for local SGD); the target is reached at the first evaluation at or below
it, as the comparison's held-out target; a loss that is not finite ends the simulation
(diverged: not reached). Memory: N gradients (async), N optimizer states
(local SGD) or N residuals (compression) of the model's size.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import dataclass, field

import numpy as np

from dtlab.lab.simulate.arrivals import Speeds, Trace, trace
from dtlab.models.compress import CompressConfig, make_compressor, matrix_layout
from dtlab.models.config import ConfigError, build
from dtlab.models.data import ShardedLoader
from dtlab.models.data.factory import make_heldout
from dtlab.models.optim import Schedule, divided_lr, make_optimizer
from dtlab.models.outer import LocalSGD, OuterConfig, make_outer
from dtlab.models.run.session import Session, Setup, build_session

MICRO_BATCH = 256  # sync's big batch is computed in micro-batches of at most this
DILOCO = {"outer_optimizer": "nesterov", "outer_lr": 0.7, "outer_momentum": 0.9}
PATTERN = re.compile(r"(?P<kind>sync|asp|ssp|local|diloco|topk|randk|sign|backup)"
                     r"(?P<value>\d+(\.\d+)?)?(?P<div>-div)?")
NEEDS_VALUE = {"ssp": "the bound S", "local": "H inner steps", "diloco": "H inner steps",
               "topk": "the percent kept P", "randk": "the percent kept P",
               "backup": "B backup workers"}


@dataclass(frozen=True)
class Method:
    kind: str
    value: float = 0.0  # ssp S, local/diloco H, topk/randk percent, backup B
    divide: bool = False  # asp/ssp: lr / staleness

    @classmethod
    def parse(cls, name: str) -> Method:
        """sync, asp[-div], sspS[-div], localH, dilocoH, topkP, randkP, sign, backupB (the
        comparison's run names without their topology); ConfigError naming the entry."""
        m = PATTERN.fullmatch(name.strip())
        if m is None:
            raise ConfigError(f"--methods {name}: not one of sync, asp[-div], sspS[-div], "
                              "localH, dilocoH, topkP, randkP, sign, backupB")
        kind, value = m["kind"], m["value"]
        if kind in NEEDS_VALUE and value is None:
            raise ConfigError(f"--methods {name}: {kind} needs {NEEDS_VALUE[kind]}")
        if kind not in NEEDS_VALUE and value is not None:
            raise ConfigError(f"--methods {name}: {kind} takes no number")
        if m["div"] and kind not in ("asp", "ssp"):
            raise ConfigError(f"--methods {name}: -div is for asp and ssp")
        v = float(value or 0)
        if kind in ("local", "diloco", "backup") and (v != int(v) or v < 1):
            raise ConfigError(f"--methods {name}: {NEEDS_VALUE[kind]} must be a positive "
                              "integer")
        if kind in ("topk", "randk") and not 0 < v <= 100:
            raise ConfigError(f"--methods {name}: P is a percent in (0, 100]")
        return cls(kind, v, bool(m["div"]))

    @property
    def label(self) -> str:
        v = f"{self.value:g}" if self.kind in NEEDS_VALUE else ""
        return f"{self.kind}{v}{'-div' if self.divide else ''}"

    @property
    def same_steps_as(self) -> str | None:
        """The method whose statistical run stands for this one's (backup: sync's)."""
        return "sync" if self.kind == "backup" else None


@dataclass
class Result:
    method: str
    n: int
    batch_size: int  # per worker
    steps: int | None  # per-worker steps to the held-out target (None: not reached)
    budget: int  # per-worker steps allowed (--steps)
    curve: list = field(default_factory=list)  # (step, held-out loss)
    staleness: dict | None = None  # async: arrivals' summary of the pushes made
    seconds: float = 0.0  # wall time of the simulation
    diverged: int | None = None  # the step whose held-out loss was not finite (then stopped)

    @property
    def samples(self) -> int | None:
        return None if self.steps is None else self.steps * self.n * self.batch_size


class Heldout:
    """The held-out examples in batches of at most MICRO_BATCH, evaluated on a replica."""

    def __init__(self, setup: Setup):
        held = make_heldout(setup.data, setup.model_name, setup.model, setup.run.eval_samples)
        self.batches = [held.batch(np.arange(i, min(i + MICRO_BATCH, held.n)))
                        for i in range(0, held.n, MICRO_BATCH)]
        self.weights = [len(b[1]) for b in self.batches]

    def loss(self, s: Session) -> float:
        losses = [s.replica.evaluate([b]) for b in self.batches]
        return float(np.average(losses, weights=self.weights))


class Run:
    """What every method's simulation shares: the session, the held-out set, the target
    and the cadence, and the curve it records."""

    def __init__(self, setup: Setup, method: Method, n: int, target: float, eval_every: int):
        if setup.run.precision != "fp32":
            raise ConfigError("the verdict's simulations train in float32 (--precision "
                              f"{setup.run.precision} is not simulated)")
        if setup.run.grad_accum != 1:
            raise ConfigError("the verdict's simulations take --grad-accum 1")
        self.s = build_session(setup)
        self.setup, self.method, self.n = setup, method, n
        self.target, self.eval_every = target, max(1, eval_every)
        self.held = Heldout(setup)
        self.result = Result(method.label, n, setup.run.batch_size, None, setup.run.steps)

    def loader(self, rank: int, world: int, batch: int | None = None,
               micro: int = 1) -> ShardedLoader:
        run = self.setup.run
        return ShardedLoader(self.s.dataset, batch or run.batch_size, rank=rank, world=world,
                             seed=run.seed, micro_batches=micro)

    def evaluate(self, step: int) -> bool:
        """Record the held-out loss after `step` per-worker steps; whether the simulation
        ends: the target reached (then the result's steps are set) or the loss not finite
        (diverged: the target never reached)."""
        with np.errstate(all="ignore"):
            loss = self.held.loss(self.s)
        if not math.isfinite(loss):
            self.result.diverged = step
            return True
        self.result.curve.append((step, loss))
        if loss <= self.target:
            self.result.steps = step
            return True
        return False

    def due(self, step: int) -> bool:
        return step % self.eval_every == 0 or step == self.setup.run.steps

    def clip_and_step(self, lr: float) -> None:
        s = self.s
        s.model.clip_grad_norm(s.params, self.setup.optim.clip)
        s.optimizer.step(s.params.data, s.params.grad, lr)


def run_sync(r: Run) -> None:
    n, b = r.n, r.setup.run.batch_size
    per = math.gcd(n * b, MICRO_BATCH) if n * b > MICRO_BATCH else n * b
    loader = r.loader(0, 1, per, n * b // per)  # the union of the N ranks' batches
    for step in range(1, r.setup.run.steps + 1):
        r.s.replica.compute_grads(loader.next())
        r.clip_and_step(r.s.schedule(r.s.optimizer.steps))
        if r.due(step) and r.evaluate(step):
            return


class AsyncPushes:
    """N workers' pushes in the order `order` gives, each gradient computed when its worker
    read (the live parameters then) and kept until its push: the same numbers as computing
    it at push time on the values it read (models/run/simulated.py)."""

    def __init__(self, s: Session, order, loaders, divide: bool, span: int):
        self.s, self.order, self.loaders = s, order, loaders
        self.rule = "divide" if divide else "none"
        self.schedule = Schedule(s.setup.optim, span)
        self.pending: dict[int, np.ndarray] = {}  # push -> (P,) its clipped gradient
        self.readers: dict[int, list[int]] = {}  # version -> the pushes computed on it
        for p, v in enumerate(order.read.tolist()):
            self.readers.setdefault(v, []).append(p)
        self.updates = 0
        self.compute_reads(0)

    def compute_reads(self, version: int) -> None:
        s = self.s
        for p in self.readers.pop(version, []):
            w = int(self.order.worker[p])
            s.replica.compute_grads(self.loaders[w].next())
            s.model.clip_grad_norm(s.params, s.setup.optim.clip)
            self.pending[p] = s.params.grad.copy()

    def push(self, p: int) -> None:
        s = self.s
        staleness = p - int(self.order.read[p])
        lr = divided_lr(self.schedule(s.optimizer.steps), [staleness], self.rule)
        s.optimizer.step(s.params.data, self.pending.pop(p), lr)
        self.updates += 1
        self.compute_reads(self.updates)


def run_async(r: Run, speeds: Speeds, seed: int = 0, order: Trace | None = None) -> None:
    n, steps = r.n, r.setup.run.steps
    bound = int(r.method.value) if r.method.kind == "ssp" else None
    if order is None:
        order = trace(n, speeds, n * steps, bound, seed)
    r.result.staleness = order.summary()
    loaders = [r.loader(w, n) for w in range(n)]
    pushes = AsyncPushes(r.s, order, loaders, r.method.divide, n * steps)
    for p in range(min(n * steps, order.read.size)):
        pushes.push(p)
        if (p + 1) % n == 0 and r.due((p + 1) // n) and r.evaluate((p + 1) // n):
            return


def run_local(r: Run) -> None:
    s, n, H = r.s, r.n, int(r.method.value)
    outer_cfg = build(OuterConfig, DILOCO if r.method.kind == "diloco"
                      else {"outer_optimizer": "sgd"})
    local = LocalSGD(s.params.data, make_outer(outer_cfg, s.params.data))
    optim = r.setup.optim
    inner = [make_optimizer(optim, s.params.data, decay_mask=s.params.decay_mask())
             for _ in range(n)]
    loaders = [r.loader(w, n) for w in range(n)]
    mean = np.zeros_like(s.params.data)  # (P,) the mean outer gradient
    steps, done = r.setup.run.steps, 0
    while done < steps:
        h = min(H, steps - done)  # a shorter last round
        mean[...] = 0
        for w in range(n):
            s.params.data[...] = local.anchor
            for i in range(h):
                s.replica.compute_grads(loaders[w].next())
                s.model.clip_grad_norm(s.params, optim.clip)
                inner[w].step(s.params.data, s.params.grad, s.schedule(done + i))
            mean += local.outer_gradient(s.params.data)
        local.delta[...] = mean / n
        local.step(s.params.data)
        crossed = done // r.eval_every < (done + h) // r.eval_every  # an evaluation due
        done += h
        if (crossed or done == steps) and r.evaluate(done):
            return


def run_compressed(r: Run) -> None:
    s, n = r.s, r.n
    kind = r.method.kind
    spec = "sign" if kind == "sign" else f"{kind}:{r.method.value / 100:g}"
    cfg = build(CompressConfig, {"compress": spec})
    size, dtype = s.params.data.size, s.params.data.dtype
    layout = matrix_layout(s.params)
    comps = [make_compressor(cfg, size, dtype, np, layout, seed=r.setup.run.seed)
             for _ in range(n)]
    loaders = [r.loader(w, n) for w in range(n)]
    total = np.zeros_like(s.params.grad)  # (P,) the N decoded payloads added
    for step in range(1, r.setup.run.steps + 1):
        total[...] = 0
        for w in range(n):
            s.replica.compute_grads(loaders[w].next())
            comps[w].accumulate(comps[w].compress(s.params.grad), total)
        np.divide(total, n, out=s.params.grad)
        r.clip_and_step(s.schedule(s.optimizer.steps))
        if r.due(step) and r.evaluate(step):
            return


def steps_to_target(setup: Setup, method: Method, n: int, target: float, eval_every: int,
                    speeds: Speeds | None = None, seed: int = 0,
                    order: Trace | None = None) -> Result:
    """One simulation of `method` at n workers (the module docstring), to the target or
    setup.run.steps per-worker steps; asp/ssp in `order` when given (a real run's pushes:
    verdict_check.py), else in arrivals.trace's."""
    if n < 1:
        raise ConfigError(f"N must be at least 1 (got {n})")
    if method.same_steps_as:
        raise ValueError(f"{method.label} has no run of its own: use "
                         f"{method.same_steps_as}'s")
    t = time.perf_counter()
    r = Run(setup, method, n, target, eval_every)
    if method.kind == "sync":
        run_sync(r)
    elif method.kind in ("asp", "ssp"):
        run_async(r, speeds or Speeds(), seed, order)
    elif method.kind in ("local", "diloco"):
        run_local(r)
    else:
        run_compressed(r)
    r.result.seconds = time.perf_counter() - t
    return r.result
