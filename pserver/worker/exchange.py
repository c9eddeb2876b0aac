"""The parameter-server worker's exchange: what its step (models/run/trainer.py
`Trainer.step`, the one step of every topology) does with the servers
(models/run/exchange.py's interface).

One step of `PushPull` (Dean et al. 2012, Downpour SGD; Li et al. 2014, ps-lite):

    begin   pull every shard in parallel, into the flat parameter buffer, unless the last
            push brought the values; a shard whose version the worker already holds
            answers "not modified". Under SSP/BSP the server holds the pull until the
            worker may read.
    grads   Replica.compute_grads on this worker's slice of the global batch, then --clip
            on its gradient (its global norm); the optimizer does not run here
    finish  push every shard its slice of params.grad in parallel, each with the version
            it was read at; the servers run the optimizer. The next step's pull rides on
            the push (PSClient.push_pull): each shard serves it once the push is applied,
            by the same read rules, and answers both at once, so a step costs one round
            trip per shard; the last step pushes alone (a model-parallel group's pulls
            too: `pull_at_end`)

A step whose half-precision gradient overflowed pushes nothing (under BSP, whose round
waits for every worker, a zero gradient). The step's record carries the servers' lr, each
shard's staleness and version of the push (under BSP `late`: the shards that dropped it,
backup workers), pull_s and push_s (push_s includes the next step's pull where it rode on
the push), push_bytes and pull_bytes (the tensor bytes the push and its pull moved), and
with --moe-sparse-push expert_push_fraction (pserver.worker.expert_push).

`OuterPushPull` is local SGD / DiLoCo's (--local-steps H; models.outer): the worker's own
optimizer takes every step (the optimizer runs here) from the parameters it pulled; at a
round's end finish pushes the outer gradient, parameters pulled - local ones, and pulls
the servers' new parameters, the next round's start. Its records carry the inner lr;
a round's end also its push's staleness, version, outer_round, outer_lr and round_steps
(the inner steps of the round). With --dylu (pserver.worker.dylu: speed-aware local
steps) each round has its own H_i, set by the last push's answer, and its end's record
also step_time_s (this worker's median inner step time, which the push carried) and
fastest_step_s (the servers' fastest worker's).
"""

from __future__ import annotations

import time

import numpy as np

from dtlab.models import backend
from dtlab.models.outer import outer_gradient, round_ends
from dtlab.models.run.exchange import Single
from dtlab.models.run.session import Session
from dtlab.models.run.trace import Trace
from dtlab.protos import dtlab_ps_pb2 as pb
from dtlab.pserver.common.ranges import Ranges
from dtlab.pserver.worker.client import PSClient
from dtlab.pserver.worker.dylu import RecentStepTimes, fastest_of, speed_aware_steps
from dtlab.pserver.worker.expert_push import ExpertPush


class PushPull(Single):
    """A registered worker's exchange with the servers: `begin` pulls where the last push
    brought nothing, `finish` pushes the step's gradient with the next pull riding on it;
    the rest as one process's (Single: a worker's loss is its own batch's, nothing held)."""

    overlap = False  # the whole gradient goes after backward, clipped
    optimizer_here = False  # the servers run it on the pushed gradient

    def __init__(self, session: Session, client: PSClient, trace: Trace,
                 sparse_push: bool = False, pull_at_end: bool = False):
        self.params, self.client, self.trace = session.params, client, trace
        self.steps = session.setup.run.steps
        self.pull_at_end = pull_at_end  # whether the last step's push brings a pull too
        # --moe-sparse-push: which experts the step's tokens reached (pserver.worker.expert_push)
        self.experts = ExpertPush(session.model.moe, self.params.specs) if sparse_push else None
        self.on_device = not isinstance(self.params.data, np.ndarray)
        self.host = np.empty(self.params.size, self.params.dtype) if self.on_device \
            else self.params.data  # (n,) what pulls write
        self.pulled = False  # whether the parameters came with the last push
        self.late = 0  # BSP with backup workers: pushes some shard dropped as late

    @property
    def bsp(self) -> bool:
        return self.client.server.consistency == pb.BSP

    def loaded(self, changed: int) -> None:
        """The pulled host parameters onto the device, if they changed."""
        if changed and self.on_device:
            self.params.load(self.host)

    def pull_unless_brought(self) -> None:
        """The servers' parameters here, unless the last push brought them."""
        if not self.pulled:
            self.loaded(self.client.pull(self.host))
            self.pulled = True

    def refresh(self) -> None:
        self.pull_unless_brought()

    def begin(self, step: int) -> dict:
        t = time.perf_counter()
        self.pull_unless_brought()
        pulled = time.perf_counter()
        self.trace.span("pull", t, pulled, "comm")
        if self.experts is not None:
            self.experts.begin()
        return {"pull_s": pulled - t}

    def finish(self, step: int, applied: bool) -> dict:
        """Push the step's gradient (an overflowed one: nothing, or zeros under BSP) with
        the next step's pull riding on it, except after the last step."""
        t = time.perf_counter()
        if not applied and self.bsp:
            self.params.grad.fill(0)  # the round waits for every worker's push: this one adds 0
        grad = backend.to_host(self.params.grad)
        ranges, pushed = self.pushed()
        last = step == self.steps - 1 and not self.pull_at_end
        sent = (self.client.pushed_bytes, self.client.pulled_bytes)
        self.pulled = False
        if not applied and not self.bsp:
            replies = []  # an overflowed step pushes nothing; the next step pulls
        elif last:
            replies = self.client.push(grad, step, ranges)
        else:
            replies, changed = self.client.push_pull(grad, step, self.host, ranges)
            self.loaded(changed)
            self.pulled = True
        done = time.perf_counter()
        self.trace.span("push" if last else "push + next pull", t, done, "comm")
        return {"lr": replies[0].lr if replies else None, "push_s": done - t,
                **self.replied(replies), **self.moved(sent), **pushed}

    def replied(self, replies: list) -> dict:
        """Each shard's staleness and version of the push; under BSP also `late`, the shards
        that dropped it as late (backup workers: an accepted BSP push has staleness 0)."""
        out = {"staleness": [r.staleness for r in replies],
               "version": [r.version for r in replies]}
        if self.bsp:
            out["late"] = sum(r.staleness > 0 and not r.duplicate for r in replies)
            self.late += out["late"]
        return out

    def moved(self, sent: tuple[int, int]) -> dict:
        """The tensor bytes pushed and pulled since the counts `sent`."""
        return {"push_bytes": self.client.pushed_bytes - sent[0],
                "pull_bytes": self.client.pulled_bytes - sent[1]}

    def pushed(self) -> tuple[Ranges | None, dict]:
        """The model's ranges this step pushes (None: all of it) and, with
        --moe-sparse-push, the fraction of the expert parameters among them for the
        step's record."""
        if self.experts is None:
            return None, {}
        ranges, fraction = self.experts.ranges()
        return ranges, {"expert_push_fraction": fraction}


class OuterPushPull(PushPull):
    """--local-steps H: every step an inner step of this worker's own optimizer; a round's
    last also pushes the outer gradient and pulls the next round's start. The pulled
    parameters stay in `host` (never the buffer the inner steps change), so a shard that
    answers "not modified" leaves the right values there. `speed_aware`: --dylu, each
    round's steps H_i from this worker's speed against the fastest's."""

    optimizer_here = True  # the inner steps'; the servers run the outer optimizer

    def __init__(self, session: Session, client: PSClient, trace: Trace, local_steps: int,
                 speed_aware: bool = False):
        super().__init__(session, client, trace)
        self.H, self.rounds = local_steps, 0
        # this round's first step (None: this launch's first, a rejoining worker's too), H_i
        self.round_start, self.round_steps = None, local_steps
        self.step_times = RecentStepTimes(local_steps) if speed_aware else None
        if not self.on_device:
            self.host = np.empty(self.params.size, self.params.dtype)  # (n,) the pulled global
        self.outer_grad = np.empty_like(self.host)  # (n,) pulled - local
        self.at_round_start = True  # the parameters are the pulled ones: no inner step since
        self.kept = None  # (n,) the local weights while an evaluation inside a round reads

    def ends_round(self, step: int) -> bool:
        """Whether inner step `step` ends a round: after H steps (--dylu: this round's
        H_i), and the last."""
        if self.step_times is None:
            return round_ends(step, self.H, self.steps)
        return step + 1 - self.round_start >= self.round_steps or step + 1 == self.steps

    def begin(self, step: int) -> dict:
        """PushPull's (the launch's first step pulls), the local weights an evaluation
        inside the round set aside put back first."""
        if self.kept is not None:
            self.params.load(self.kept)
            self.kept = None
        return super().begin(step)

    def refresh(self) -> None:
        """The servers' parameters for an evaluation. At a round's end its pull brought
        them (after the last round: pulled now). Inside a --dylu round, whose end follows
        this worker's H_i and not the evaluation cadence, the local weights are set aside
        until the next step's `begin` and the servers' read whole beside the round's start
        (`PSClient.pull_whole`): the round goes on as if nobody had looked."""
        if not self.pulled or self.at_round_start:
            self.pull_unless_brought()
            return
        self.kept = backend.to_host(self.params.data).copy()  # (n,) the local weights
        self.params.load(self.client.pull_whole(np.empty_like(self.host)))

    def settled(self, record: dict) -> list[dict]:
        if self.step_times is not None:
            self.step_times.observe(record)
        return [record]

    def next_round(self, step: int, replies: list, own: float | None) -> dict:
        """After the push ending the round at `step` (--dylu: carrying `own`, this worker's
        step time, None before any was measured): the next round's start and steps; the
        record's round_steps (and --dylu's step times)."""
        record = {"round_steps": step + 1 - self.round_start}
        self.round_start = step + 1
        if own is not None:
            fastest = fastest_of(replies)
            self.round_steps = speed_aware_steps(self.H, fastest, own)
            record |= {"step_time_s": own, "fastest_step_s": fastest}
        return record

    def loaded(self, changed: int) -> None:
        """The pulled global parameters into the (locally changed) ones, always."""
        self.params.load(self.host)

    def finish(self, step: int, applied: bool) -> dict:
        """At a round's end: push the outer gradient with the next round's pull riding on
        it (the last round's alone); nothing otherwise."""
        t = time.perf_counter()
        replies, record = [], {}
        sent = (self.client.pushed_bytes, self.client.pulled_bytes)
        if self.round_start is None:
            self.round_start = step
        ended = self.ends_round(step)
        self.at_round_start = ended
        if ended:
            own = None if self.step_times is None else self.step_times.median()
            if own is not None:
                self.client.report_step_s(own)  # carried by this push (--dylu)
            outer_gradient(self.host, backend.to_host(self.params.data), out=self.outer_grad)
            last = step == self.steps - 1
            if last:
                replies, self.pulled = self.client.push(self.outer_grad, step), False
            else:
                replies, changed = self.client.push_pull(self.outer_grad, step, self.host)
                self.loaded(changed)
            self.rounds += 1
            record = {"outer_round": self.rounds, "outer_lr": replies[0].lr,
                      **self.next_round(step, replies, own)}
            self.trace.span("outer push" if last else "outer push + next pull", t,
                            time.perf_counter(), "comm")
        return {"push_s": time.perf_counter() - t, **self.replied(replies), **record,
                **self.moved(sent)}
