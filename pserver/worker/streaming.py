"""Streaming DiLoCo on the parameter servers (dtlab-worker --local-steps H --fragments F):
Douillard et al. 2025, "Streaming DiLoCo with overlapping communication", its schedule
models.streaming's (shared with dtlab-sync's collective/reducers/streaming.py).

The parameters are F fragments of whole tensors (`fragment_ranges`); fragment f
synchronises after the inner steps `syncing` names (one fragment every H / F steps, each
every H, all of them after the last step). Synchronising it is a ranged push
(pserver.common.ranges) of its outer gradient, global_f - local_f, which each shard that
holds part of it applies with its outer optimizer to those ranges alone (a lazy step: the
other fragments' values and state untouched), and the pull riding on it; the new global
values of that fragment, and only those, become the worker's anchor and its local
parameters. The other fragments keep their anchors and their local progress. No overlap
(tau = 0) and full precision: the exchange of a fragment is done before the next step.

Exact reductions (tests/pserver/test_pserver_streaming.py): one worker with F fragments
on servers running outer Nesterov is the per-fragment schedule replayed in one process
(each fragment its own outer SGD over its slice) bit for bit; F = 1 is async DiLoCo's
run (`OuterPushPull`) bit for bit.

The held-out loss is of the servers' parameters, as async DiLoCo's: `refresh` pulls them
into the parameters for the evaluation, the local ones kept aside and put back by the
next step's `begin`.
"""

from __future__ import annotations

import time

import numpy as np

from dtlab.models import backend
from dtlab.models.outer import outer_gradient
from dtlab.models.run.session import Session
from dtlab.models.run.trace import Trace
from dtlab.models.streaming import fragment_ranges, syncing
from dtlab.pserver.common.ranges import merged
from dtlab.pserver.worker.client import PSClient
from dtlab.pserver.worker.exchange import OuterPushPull


class StreamingPushPull(OuterPushPull):
    """--fragments F: each fragment's outer gradient pushed in its turn, as a ranged push."""

    def __init__(self, session: Session, client: PSClient, trace: Trace, local_steps: int,
                 fragments: int):
        super().__init__(session, client, trace, local_steps)
        params = session.params
        tensors = [params.offsets[spec.name] for spec in params.specs]  # in buffer order
        self.F, self.fragments = fragments, fragment_ranges(tensors, fragments)
        self.latest = np.empty_like(self.host)  # (n,) what the last pull brought
        self.kept = None  # (n,) the local parameters while an evaluation reads the global

    def begin(self, step: int) -> dict:
        """The first step: every fragment's anchor pulled. After an evaluation: the local
        parameters put back."""
        t = time.perf_counter()
        if not self.pulled:
            self.client.pull(self.latest)
            self.host[...] = self.latest
            self.params.load(self.host)
            self.pulled = True
        elif self.kept is not None:
            self.params.load(self.kept)
        self.kept = None
        pulled = time.perf_counter()
        self.trace.span("pull", t, pulled, "comm")
        return {"pull_s": pulled - t}

    def refresh(self) -> None:
        """The servers' parameters into the buffer for an evaluation, the local ones kept
        aside until the next step's begin."""
        if self.kept is None:
            self.kept = backend.to_host(self.params.data).copy()
        self.client.pull(self.latest)
        self.params.load(self.latest)

    def finish(self, step: int, applied: bool) -> dict:
        """After the steps where fragments synchronise: their ranged push, with the next
        pull riding on it (the last step's alone), and their new global values taken."""
        t = time.perf_counter()
        due = syncing(step, self.H, self.F, self.steps)
        replies, record = [], {}
        sent = (self.client.pushed_bytes, self.client.pulled_bytes)
        if due:
            outer_gradient(self.host, backend.to_host(self.params.data), out=self.outer_grad)
            ranges = None if len(due) == self.F else merged(self.fragments[f] for f in due)
            if step == self.steps - 1:
                replies = self.client.push(self.outer_grad, step, ranges)
            else:
                replies, _ = self.client.push_pull(self.outer_grad, step, self.latest, ranges)
                self.take(due)
            self.rounds += 1
            record = {"outer_round": self.rounds, "outer_lr": replies[0].lr,
                      "fragments": due}
            self.trace.span("fragment push + pull", t, time.perf_counter(), "comm")
        return {"push_s": time.perf_counter() - t, **self.replied(replies), **record,
                **self.moved(sent)}

    def take(self, due: list[int]) -> None:
        """The pulled global values of fragments `due` as their anchor and local values."""
        xp = self.params.xp
        for f in due:
            lo, hi = self.fragments[f]
            self.host[lo:hi] = self.latest[lo:hi]
            self.params.data[lo:hi] = xp.asarray(self.latest[lo:hi])
