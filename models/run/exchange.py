"""The exchange: what one way of training does between a rank and the others, as the one
step every topology runs (models/run/trainer.py `Trainer.step`) sees it.

    record |= exchange.begin(step)               # pull the parameters, or nothing
    loss = replica.compute_grads(batches, exchange.ready)  # ready(o): [o, end) final
    record |= exchange.wait()                    # the reduced gradient in place, or nothing
    loss = exchange.average(loss)                # the logged loss: over the global batch
                                                 # (a data-parallel exchange's `scalars`:
                                                 # with the stop agreement, one all-reduce)
    applied = replica.finish_grads(); clip       # unscale, overflow check, --clip
    if exchange.optimizer_here:                  # else the servers run it (finish)
        optimizer.step(params, grad, lr)
    record |= exchange.finish(step, applied)     # a push that brings the next pull, or nothing
    written = exchange.settled(record)           # the records now final (local SGD: a round's)

Implemented once per method and handed to the trainer, so that models/run imports none of
them: `Single` below (one process, dtlab-train); the data-parallel exchanges of dtlab-sync
on the base collective/reducers/exchange.py (bucketed all-reduce, ZeRO, local SGD /
DiLoCo, compression, 1-bit Adam, the quantized ring); the parameter-server worker's in
pserver/worker/exchange.py (`PushPull`, and `OuterPushPull` for local SGD / DiLoCo);
the simulated workers' `StaleExchange` (models/run/simulated.py: the gradient computed
on values S updates back, the server's update of the live ones in finish).
"""

from __future__ import annotations

from typing import Protocol


class Exchange(Protocol):
    """The whole contract between the trainer and a method's exchange.

    overlap         whether ready() starts communicating while backward still runs
    optimizer_here  whether the trainer's optimizer steps the parameters (False: the
                    servers run it on what finish() pushed)
    begin(step)     before step `step` reads the parameters: make them current (a pull
                    where the last push brought none; nothing where every rank holds
                    them); its fields of the step's record
    refresh()       the same before an evaluation reads them (no record)
    ready(offset)   during backward: the gradients at [offset, end) are final
    wait()          after backward: the reduced gradient in place (or nothing to
                    reduce); its fields of the step's record
    finish(step, applied)
                    after the update (`applied`: False when finish_grads skipped the
                    step); a push that brings the next pull, or nothing; its fields of
                    the step's record (they override the trainer's, e.g. the servers' lr)
    average(value)  a logged scalar (the loss) as the mean over the step's global batch
                    (where its ranks are the whole job, a data-parallel exchange's
                    `scalars` carries the stop agreement in the same all-reduce:
                    collective/reducers/exchange.py, handed to the trainer apart)
    settled(record) the step records final after this one, their losses averaged
    plan()          what each of its collectives runs, for the metrics header
    close()         threads and communicators freed
    """

    overlap: bool
    optimizer_here: bool

    def begin(self, step: int) -> dict: ...

    def refresh(self) -> None: ...

    def ready(self, offset: int) -> None: ...

    def wait(self) -> dict: ...

    def finish(self, step: int, applied: bool) -> dict: ...

    def average(self, value: float) -> float: ...

    def settled(self, record: dict) -> list[dict]: ...

    def plan(self) -> list[dict]: ...

    def close(self) -> None: ...


class Single:
    """The exchange of one process training alone (dtlab-train): nothing to exchange."""

    overlap = False
    optimizer_here = True

    def begin(self, step: int) -> dict:
        return {}

    def refresh(self) -> None:
        """Nothing: this process holds the only copy of the parameters."""

    def ready(self, offset: int) -> None:
        """Nothing to start: no other rank."""

    def wait(self) -> dict:
        return {}

    def finish(self, step: int, applied: bool) -> dict:
        return {}

    def average(self, value: float) -> float:
        return value

    def settled(self, record: dict) -> list[dict]:
        return [record]

    def plan(self) -> list[dict]:
        return []

    def close(self) -> None:
        """Nothing held."""
