"""Sync local SGD and DiLoCo: H inner steps on every rank, then one all-reduce.

    mpiexec -n 4 python -m dtlab.collective.train --model mlp --steps 400 --local-steps 10
    mpiexec -n 4 python -m dtlab.collective.train --model mlp --steps 400 --local-steps 50 \
        --optimizer adamw --outer-optimizer nesterov --outer-lr 0.7 --outer-momentum 0.9

Every dp rank takes H inner steps with its own optimizer (the optimizer flags, its
state never averaged) and lr schedule on its own data (models.data.ShardedLoader rank r
of W, as plain data parallelism reads it); the gradients are not reduced. At the end
of each round of H steps (and at the last step: a shorter last round) the ranks
all-reduce their outer gradient Delta_r = theta - theta_r (our ring, average) and
apply the outer optimizer to theta (models.outer: Stich 2019 / Lin et al. 2020 local
SGD with outer SGD lr 1, the default; Douillard et al. 2023 DiLoCo with inner AdamW
and outer Nesterov lr 0.7, momentum 0.9), so every rank starts the next round from
the same theta. A round costs one all-reduce of the parameters instead of H of the
gradients: each step's record carries `comm_rounds` (1 at a round's end, else 0),
`sent_bytes` (what this rank sent in it, from our ring's schedule) and `outer_s`.

Exactness (models.outer's docstring): one rank, H = 1, inner SGD and outer SGD lr 1
is plain training bit for bit; with W ranks the mean of the outer gradients is the
step of the mean gradient only up to an ulp per element (tests/collective/
test_local_sgd.py states the tolerance); at H > 1 a single process running the W
replicas one after another is the same bits at W = 2, where the ring's sum is a + b
(at W = 3 the ring adds in another order than the twin: 8e-18 relative, float64).

The trainer (models/run/trainer.py) drives this as it drives plain data parallelism:
`LocalReducer` stands in for the gradient reducer (nothing to reduce), `LocalOptimizer`
(collective/reducers/streaming.py) for the optimizer (the inner step, then at a round's end the
outer one; with Streaming DiLoCo's flags one fragment of the parameters at a time). The ranks meet
only at round ends: the stop agreement too (collective/reducers/methods.py, agreement), and the
logged training loss, the mean over the ranks as for every method, is averaged and
written for the whole round at its end.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from dtlab.collective.comm import Communicator
from dtlab.collective.reducers.exchange import Exchange
from dtlab.collective.reducers.streaming import LocalOptimizer, StreamingConfig
from dtlab.models.config import ConfigError, described
from dtlab.models.flag_rules import Flag, MultipleOf, NoEffectWithout, rules
from dtlab.models.outer import OuterConfig
from dtlab.models.run.session import RunConfig


@rules(
    NoEffectWithout(Flag("outer_optimizer", OuterConfig), "local_steps"),
    NoEffectWithout(tuple(Flag(f.name, StreamingConfig)
                          for f in dataclasses.fields(StreamingConfig)), "local_steps"),
    MultipleOf(Flag("eval_every", RunConfig), "local_steps",
               why="the held-out loss is of the averaged parameters, which exist once per "
                   "outer round"),
)
@dataclass
class LocalConfig:
    local_steps: int = described(0, "local SGD / DiLoCo: inner steps per outer round; each "
                                    "rank steps its own optimizer on its own data, then the "
                                    "ranks all-reduce their parameter change once, for the "
                                    "outer optimizer (without --outer-optimizer: SGD lr 1, "
                                    "model averaging); 0: off, plain data parallelism")

    def validate(self):
        if self.local_steps < 0:
            raise ConfigError(f"--local-steps must not be negative (got {self.local_steps})")


def outer_config(local: LocalConfig, outer: OuterConfig) -> OuterConfig:
    """The outer optimizer a run with `local` uses: as given, or outer SGD lr 1 (model
    averaging) when --local-steps comes without --outer-optimizer (LocalConfig's rules
    refuse the outer flags without --local-steps)."""
    if not local.local_steps or outer.enabled:
        return outer
    return OuterConfig(outer_optimizer="sgd")


class LocalReducer(Exchange):
    """The trainer's gradient reducer under --local-steps: every rank keeps its own
    gradient. The ranks meet only at a round's end, so the step records of a round wait
    for it: then one all-reduce averages the round's losses, and the records go out with
    `loss` the mean over the global batch, as every other method logs it (`settled`).
    The held-out loss, at round ends, is of the averaged parameters."""

    averages_every_step = False  # the losses meet at round ends: no step scalars to carry

    def __init__(self, ring: Communicator, optimizer=None):
        super().__init__(ring)
        self.ring = ring  # the outer all-reduce's, freed in close
        self.optimizer = optimizer  # closed with it (an overlapping exchange's thread)
        self.pending: list[dict] = []  # this round's records, their losses this rank's

    def ready(self, offset: int) -> None:
        """Nothing to start: the gradient stays on this rank."""

    def wait(self) -> dict:
        return {"comm_s": 0.0, "wait_s": 0.0, "wire_bytes": 0}

    def average(self, value: float) -> float:
        """This rank's own: the mean waits for the round's end (`settled`)."""
        return value

    def settled(self, record: dict) -> list[dict]:
        """The round's records once `record` ends it (its outer all-reduce ran: comm_rounds
        1), each loss replaced by its mean over the ranks; nothing before."""
        self.pending.append(record)
        if not record.get("comm_rounds"):
            return []
        losses = np.array([r["loss"] for r in self.pending])  # (steps in the round,)
        self.ring.allreduce(losses, average=True, algo="mpi")
        done, self.pending = self.pending, []
        for r, loss in zip(done, losses.tolist(), strict=True):
            r["loss"] = loss
        return done

    def plan(self) -> list[dict]:
        return []

    def close(self) -> None:
        if self.optimizer is not None:
            self.optimizer.close()
        self.ring.free()


def local_session(session, comm: Communicator, local: LocalConfig, outer: OuterConfig,
                  streaming: StreamingConfig | None = None):
    """The session with its optimizer wrapped (collective/reducers/streaming.py's LocalOptimizer:
    one fragment unless Streaming DiLoCo's flags say more) and the reducer to go with it;
    `comm` is the dp communicator (a ring-only duplicate is made of it)."""
    ring = comm.dup("local-sgd", ours="ring")
    params = session.params
    tensors = [params.offsets[spec.name] for spec in params.specs]  # in buffer order
    session.optimizer = LocalOptimizer(session.optimizer, ring, outer, params.data, tensors,
                                       local.local_steps, session.setup.run.steps,
                                       streaming or StreamingConfig(), session.replica.timing)
    return session, LocalReducer(ring, session.optimizer)
