"""The outer training loop, written once for every topology, and the summary it ends with.

    with StopSignals() as stop:
        for i in iterations:                     # steps; a simulated run's pushes
            record = method.step(i)              # compute, exchange, update: the method's
            if method.eval_due(i):               # held-out loss, timed apart (eval_s)
                record["eval_loss"] = method.evaluate()
            record["elapsed_s"] = ...
            for done in method.report(i, record):  # the records now final, written
                losses.append(done["loss"])
            saved = method.checkpoint(i)         # a checkpoint after this step, when due
            if stop.agreed(agree):               # every rank stops after the same step
                method.stopped(stop.name, i, saved)
                break

The trainer (`models/run/trainer.py`: dtlab-train, dtlab-sync, and as its subclasses
`pserver/worker/loop.py`'s Worker, dtlab-worker, and `models/run/simulated.py`'s
simulated workers: one step for every topology, what differs is its exchange,
models/run/exchange.py) says what a step, an evaluation, a report, a checkpoint and a
stop are; the loop around them, the finite-loss check and the summary are here.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from dtlab.models.run.stop import StopSignals


class Method(Protocol):
    """What the loop asks of the program it runs."""

    def step(self, i: int) -> dict: ...  # one step's record, with its "loss"

    def eval_due(self, i: int) -> bool: ...  # evaluate after step i?

    def evaluate(self) -> float: ...  # the held-out loss of the parameters now

    def report(self, i: int, record: dict) -> list[dict]: ...  # final ones written

    def checkpoint(self, i: int) -> bool: ...  # save after step i if due; saved?

    def stopped(self, signal_name: str, i: int, saved: bool) -> None: ...  # say it


def check_finite(loss: float, where: str) -> None:
    """A FloatingPointError naming where the loss stopped being a number."""
    if not math.isfinite(loss):
        raise FloatingPointError(f"loss is {loss} at {where}; lower --lr or enable --clip")


def eval_due(done: int, every: int, total: int) -> bool:
    """--eval-every: after every `every`-th of `total` steps and after the last one."""
    return bool(every) and (done % every == 0 or done == total)


@dataclass
class Summary:
    """What a run did: steps this launch ran, their time, and the loss at its end."""

    steps: int
    seconds: float
    final_loss: float  # mean training loss of the last `tail` steps
    tail: int
    floor: float | None
    samples_per_s: float
    stopped_by: str = ""  # the signal that stopped the run early, agreed by every rank
    exit_code: int = 0  # 0, or 130 after SIGINT
    extra_lines: list[str] = dataclasses.field(default_factory=list)  # e.g. the MoE table

    @property
    def gap(self) -> float | None:
        return None if self.floor is None else self.final_loss - self.floor

    @classmethod
    def of(cls, losses: list[float], seconds: float, floor: float | None,
           samples_per_step: int) -> Summary:
        """Final loss = mean of the last 10% of the steps' losses (at least one step)."""
        tail = losses[-max(1, len(losses) // 10):]
        return cls(len(losses), seconds, sum(tail) / len(tail) if tail else math.nan,
                   len(tail), floor, len(losses) * samples_per_step / seconds if seconds else 0.0)

    def lines(self, flops_per_step: float | None = None) -> list[str]:
        """The summary a trainer prints at the end."""
        if not self.steps:
            return ["no steps run: the run had already reached --steps"]
        seconds = max(self.seconds, 1e-9)
        speed = f"steps {self.steps} in {seconds:.2f} s, {self.samples_per_s:,.0f} samples/s"
        if flops_per_step is not None:
            speed += f", {flops_per_step * self.steps / seconds / 1e9:.1f} GFLOP/s"
        last = "the last step" if self.tail == 1 else f"mean of the last {self.tail} steps"
        loss = f"final training loss {self.final_loss:.4f} ({last})"
        if self.floor is not None:
            loss += f"  floor {self.floor:.4f}  gap {self.gap:+.4f} nats"
        return [speed, loss, *self.extra_lines]


Agree = Callable[[np.ndarray], np.ndarray]


def train(method: Method, iterations: Iterable[int], floor: float | None,
          samples_per_step: int, agree: Agree | None = None,
          stop: StopSignals | None = None) -> Summary:
    """Run `method` over `iterations` (the loop above) or until SIGTERM / SIGINT, agreed
    over the ranks by `agree` (a sum of a small count array; None: this process alone);
    `stop`: the signals to catch (a trainer's own, whose steps read them), else new ones."""
    start = time.perf_counter()
    losses: list[float] = []
    with stop or StopSignals() as stop:
        for i in iterations:
            record = method.step(i)
            if method.eval_due(i):
                t = time.perf_counter()
                record["eval_loss"] = method.evaluate()
                record["eval_s"] = time.perf_counter() - t  # not training time
            record["elapsed_s"] = time.perf_counter() - start
            losses += [done["loss"] for done in method.report(i, record)]
            saved = method.checkpoint(i)
            if stop.agreed(agree):
                method.stopped(stop.name, i, saved)
                break
    summary = Summary.of(losses, time.perf_counter() - start, floor, samples_per_step)
    summary.stopped_by, summary.exit_code = stop.name, stop.exit_code
    return summary
