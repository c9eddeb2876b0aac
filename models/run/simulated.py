"""Asynchronous workers simulated in one process: what staleness does, without the systems.

    dtlab-train --model mlp --steps 200 --simulate-workers 4                 # 3 versions stale
    dtlab-train --model mlp --steps 200 --simulate-workers 4 --staleness 0   # the same, fresh
    dtlab-train --model mlp --steps 200 --simulate-workers 4 --staleness-lr divide

W equal-speed ASP workers (Dean et al. 2012, Downpour SGD) against a parameter
server take turns: worker w's step s is push p = s W + w. Each worker pulls
right after its own push is applied, so by its next push the other W - 1 have
pushed: every gradient is W - 1 versions stale (the first round's 0, 1, ...,
W - 1, all workers having read the initial values). Here push p

    reads   the parameters as they were before push max(0, p - S)    (S = W - 1 default)
    grads   on worker w's batch of its step s: ShardedLoader(rank w, world W), the
            loader pserver.worker.loop gives worker w, so the data is an ASP run's
    clip    --clip on that gradient, as the worker clips before pushing
    apply   one optimizer step on the current parameters, at the server's lr:
            Schedule(W x --steps updates)(updates so far) (the span `pserver serve
            --config` gives --steps x --num-workers; the index pserver.server.store
            uses), with --staleness-lr divide / max(1, staleness)
            (Zhang et al. 2016, "Staleness-aware Async-SGD"), staleness = updates now -
            updates in the values read (pserver.server.store's rule)

The step is the trainer's (models/run/trainer.py `Trainer.step`, every topology's)
on the W loaders taking turns; what differs is its exchange, `StaleExchange`: begin
reads the stale values, finish is the server's update (the optimizer runs there).
S = 0 is the same W-way sharded run without staleness; W = 1, S = 0 is plain
dtlab-train bit for bit. A push whose half-precision gradient overflowed
applies nothing (an ASP worker pushes nothing). --steps and --eval-every count
rounds (one push per worker, a worker's steps); each metrics record is one
push: "step" (its number, 1 .. W x --steps), "round", "worker", "update" (the
updates applied after it), "read_version" and "staleness"; the header adds
simulate_workers, staleness, staleness_lr and schedule_steps.
"""

from __future__ import annotations

import argparse
import sys
from collections import deque
from dataclasses import dataclass

from dtlab.models.config import ConfigError, add_flags, choice, described, from_namespace
from dtlab.models.data import ShardedLoader
from dtlab.models.optim import Schedule, divided_lr
from dtlab.models.run import loop
from dtlab.models.run.exchange import Single
from dtlab.models.run.loop import Summary
from dtlab.models.run.metrics import MetricsLog
from dtlab.models.run.session import RunConfig, Session, Setup
from dtlab.models.run.trace import Trace
from dtlab.models.run.trainer import Trainer


@dataclass
class SimulateConfig:
    simulate_workers: int = described(0, "train as W equal-speed asynchronous workers would "
                                         "against a parameter server, in this one process "
                                         "(models/run/simulated.py; left out: plain training)")
    staleness: int = described(-1, "with --simulate-workers: each gradient is computed on the "
                                   "parameters this many updates back (-1: W - 1, as W "
                                   "equal-speed ASP workers; 0: none)")
    staleness_lr: str = choice("none", "none", "divide",
                               help="with --simulate-workers: divide the lr by the gradient's "
                                    "staleness (Zhang et al. 2016), as the servers' "
                                    "--staleness-lr")

    @property
    def stale(self) -> int:
        """S, the updates each gradient is behind (-1 resolved to W - 1)."""
        return self.simulate_workers - 1 if self.staleness == -1 else self.staleness

    def validate(self):
        W = self.simulate_workers
        if W < 0:
            raise ConfigError(f"--simulate-workers must be at least 1 (got {W})")
        if self.staleness < -1:
            raise ConfigError(f"--staleness must not be negative (got {self.staleness}; "
                              "-1 is W - 1)")
        if not W and (self.staleness != -1 or self.staleness_lr != "none"):
            raise ConfigError("--staleness and --staleness-lr need --simulate-workers W")
        if W == 1 and self.stale:
            raise ConfigError(f"--staleness {self.stale} with --simulate-workers 1: one "
                              "worker reads its own last update, its gradients are never "
                              "stale; give --staleness 0 or more workers")
        if W and self.stale > W - 1:
            raise ConfigError(f"--staleness {self.stale} exceeds W - 1 = {W - 1}: {W} "
                              f"equal-speed workers' gradients are at most {W - 1} updates "
                              "stale")

    def header(self, run: RunConfig) -> dict:
        """The metrics header's fields of a simulated run."""
        return {"simulate_workers": self.simulate_workers, "staleness": self.stale,
                "staleness_lr": self.staleness_lr,
                "schedule_steps": run.steps * self.simulate_workers}


# Run flags a simulated run cannot take, and why.
REFUSED = {
    ("checkpoint_dir", "checkpoint_every", "resume", "keep"):
        "a simulated run keeps no checkpoints (its state is W loaders and S past versions)",
    ("straggler", "delay_ms"):
        "the simulated workers are equal-speed and take turns; no time passes between them",
}


def add_simulate_flags(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, SimulateConfig, "simulated asynchronous workers")


def simulate_config(setup: Setup) -> SimulateConfig | None:
    """The --simulate-workers flags (None: plain training); ConfigError naming the flag
    for a bad value or a run flag that does not combine with them."""
    if getattr(setup.extra, "simulate_workers", None) == 0:
        raise ConfigError("--simulate-workers must be at least 1 (got 0); leave it out for "
                          "plain training")
    cfg = from_namespace(SimulateConfig, setup.extra)
    if not cfg.simulate_workers:
        return None
    run = setup.run
    for names, why in REFUSED.items():
        for name in names:
            if getattr(run, name) != getattr(RunConfig, name):
                raise ConfigError(f"--simulate-workers does not combine with "
                                  f"--{name.replace('_', '-')}: {why}")
    return cfg


class TakingTurns:
    """The W workers' loaders as one: the n-th batch is worker n mod W's next (push n's)."""

    def __init__(self, loaders: list[ShardedLoader]):
        self.loaders, self.turn = loaders, 0

    def next(self):
        batch = self.loaders[self.turn % len(self.loaders)].next()
        self.turn += 1
        return batch


class StaleExchange(Single):
    """The exchange (models/run/exchange.py) of W simulated workers, each gradient S
    updates stale: `begin` reads the values before push max(0, p - S) into params.data,
    `finish` is the server's update of the live parameters at its lr (the optimizer runs
    there, not in the trainer's step); the rest as one process's (one push, one worker's
    batch; nothing held)."""

    optimizer_here = False  # the simulated server steps the live parameters in finish

    def __init__(self, session: Session, cfg: SimulateConfig):
        s, run = session, session.setup.run
        self.s, self.cfg = s, cfg
        self.W, self.S = cfg.simulate_workers, cfg.stale
        self.schedule = Schedule(s.setup.optim, run.steps * self.W)
        # The optimizer steps `live`; the replica computes on params.data, which holds the
        # values read (S = 0: they are the live ones, nothing copied). `past` holds
        # (updates, values) before each of the last S + 1 pushes; past[0] is what the
        # next push reads.
        self.live = s.params.data if self.S == 0 else s.params.data.copy()
        self.past = deque([(0, self.live.copy())], maxlen=self.S + 1) if self.S else None
        self.updates = 0
        self.read_version = 0  # the updates in the values the push in progress read

    def begin(self, p: int) -> dict:
        """Push p is worker p mod W's step p // W: it reads the values S updates back."""
        if self.past is None:
            self.read_version = self.updates
        else:
            self.read_version, values = self.past[0]
            self.s.params.data[...] = values
        return {"round": p // self.W + 1, "worker": p % self.W,
                "read_version": self.read_version}

    def refresh(self) -> None:
        """The live parameters into params.data (what a pull would read now)."""
        if self.past is not None:
            self.s.params.data[...] = self.live

    def finish(self, p: int, applied: bool) -> dict:
        """One optimizer step on the live parameters at the server's lr (an overflowed
        push applies nothing), by pserver.server.store's staleness rule."""
        s = self.s
        staleness = self.updates - self.read_version
        lr = divided_lr(self.schedule(s.optimizer.steps), [staleness], self.cfg.staleness_lr)
        if applied:
            s.optimizer.step(self.live, s.params.grad, lr)
            self.updates += 1
        if self.past is not None:
            self.past.append((self.updates, self.live.copy() if applied else self.past[-1][1]))
        return {"update": self.updates, "staleness": staleness, "lr": lr}


class SimulatedWorkers(Trainer):
    """The pushes of W workers taking turns, each gradient S updates stale: the trainer's
    step (models/run/trainer.py) on the workers' loaders in turn, with `StaleExchange`.
    The loop's step p is push p; eval, progress and the stop go by rounds of W."""

    def __init__(self, session: Session, log: MetricsLog, cfg: SimulateConfig):
        run = session.setup.run
        self.cfg, self.W = cfg, cfg.simulate_workers
        session.loader = TakingTurns([
            ShardedLoader(session.dataset, run.batch_size, rank=w, world=self.W, seed=run.seed,
                          micro_batches=run.grad_accum) for w in range(self.W)])
        super().__init__(session, log, StaleExchange(session, cfg),
                         trace=Trace(run.trace, pid=0, process=f"{self.W} simulated workers"))

    @property
    def live(self):
        """The live parameters (the server's)."""
        return self.exchange.live

    def iterations(self) -> range:
        return range(self.s.setup.run.steps * self.W)

    def run(self) -> Summary:
        """W x --steps pushes, or until SIGTERM / SIGINT (after the push in progress);
        params.data ends holding the live parameters."""
        summary = super().run()
        self.exchange.refresh()
        summary.extra_lines.insert(0, self.describe())
        return summary

    def eval_due(self, p: int) -> bool:
        """At the end of a round of W pushes, every --eval-every rounds and the last."""
        run = self.s.setup.run
        return p % self.W == self.W - 1 and loop.eval_due(p // self.W + 1, run.eval_every,
                                                          run.steps)

    def report(self, p: int, record: dict) -> list[dict]:
        self.log.write(record)
        if p % self.W == self.W - 1:
            self.progress.update(p // self.W, record["loss"],
                                 f"update {self.exchange.updates}  lr {record['lr']:.2e}")
        return [record]

    def stopped(self, signal_name: str, p: int, saved: bool) -> None:
        print(f"stopped by {signal_name} after push {p + 1}; a simulated run keeps no "
              "checkpoint", file=sys.stderr)

    def describe(self) -> str:
        """The summary's line that says the run was simulated, and how."""
        x = self.exchange
        lr = ", lr / staleness" if self.cfg.staleness_lr == "divide" else ""
        return (f"simulated: {self.W} asynchronous worker(s) in one process taking turns, "
                f"each gradient {x.S} update(s) stale (ASP steady state: {self.W - 1}); "
                f"{x.updates} updates{lr}")
