"""The outer loop of sync local SGD, DiLoCo and Streaming DiLoCo: --local-steps H, with
Streaming DiLoCo's --fragments F, --overlap-steps tau, --mix alpha and
--outer-precision fp32|int8|int4.

    mpiexec -n 4 python -m dtlab.collective.train --model transformer --steps 600 \
        --optimizer adamw --local-steps 30 --outer-optimizer nesterov --outer-lr 0.7 \
        --outer-momentum 0.9 --fragments 3 --overlap-steps 1 --outer-precision int4

Every rank takes inner steps with its own optimizer on its own data, as under local SGD
(collective/reducers/local_sgd.py); the schedule of models/streaming.py says which fragment of
the parameters synchronises after which step. A fragment's sync: its outer gradient
Delta_f = theta_f - theta_r,f, its mean over the ranks (fp32: our ring's all-reduce;
int8 / int4: every rank's block-quantized Delta_f all-gathered over our ring, then
dequantized and averaged in rank order, models/quantize.py: the bits on the wire are the
few, the sum is not), the outer optimizer's step on the fragment (one outer optimizer per
fragment: its momentum is that fragment's), and after tau more inner steps the merge of
the new global fragment into the local one. With tau > 0 the exchange runs on a helper
thread (collective/zero/stream.py), so it overlaps those steps' compute.

Each step's record carries comm_rounds (fragments whose exchange started), sent_bytes
(what this rank sent for them, from the ring's own schedule) and outer_s.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from dtlab.collective.comm import Communicator
from dtlab.collective.zero.layout import RingTraffic
from dtlab.collective.zero.stream import Job, Stream
from dtlab.models import quantize
from dtlab.models.backend import array_module
from dtlab.models.config import ConfigError, choice, described
from dtlab.models.outer import LocalSGD, OuterConfig, make_outer
from dtlab.models.streaming import fragment_ranges, syncing

BITS = {"int8": 8, "int4": 4}


@dataclass
class StreamingConfig:
    fragments: int = described(1, "Streaming DiLoCo (with --local-steps H): the parameters "
                                  "in F fragments of whole tensors, one synchronised every "
                                  "H / F inner steps (Douillard et al. 2025); 1: DiLoCo")
    overlap_steps: int = described(0, "Streaming DiLoCo: a fragment's outer exchange "
                                      "overlaps this many inner steps (tau < H / F); its "
                                      "result is merged that many steps late")
    mix: float = described(0.0, "Streaming DiLoCo: the merge theta_local <- alpha "
                                "theta_local + (1 - alpha) theta_global of a fragment's "
                                "new global values (alpha; 0: take them)")
    outer_precision: str = choice("fp32", "fp32", "int8", "int4",
                                  help="the outer gradients on the wire: fp32 (our ring's "
                                       "all-reduce) or block-quantized int8 / 4 bits with a "
                                       "float32 scale per 256 values (all-gathered, "
                                       "averaged at full precision)")

    @property
    def enabled(self) -> bool:
        return self != StreamingConfig()

    def validate(self) -> None:
        if self.fragments < 1:
            raise ConfigError(f"--fragments must be at least 1 (got {self.fragments})")
        if self.overlap_steps < 0:
            raise ConfigError(f"--overlap-steps must not be negative (got "
                              f"{self.overlap_steps})")
        if not 0.0 <= self.mix < 1.0:
            raise ConfigError(f"--mix must be in [0, 1) (got {self.mix})")

    def check(self, local_steps: int) -> None:
        """The schedule's rules against --local-steps H (given: LocalConfig's rules refuse
        these flags without it), each refusal naming both flags."""
        H, F = local_steps, self.fragments
        if H % F:
            raise ConfigError(f"--fragments {F} must divide --local-steps {H}: one "
                              "fragment synchronises every H / F steps")
        if self.overlap_steps >= H // F:
            raise ConfigError(f"--overlap-steps {self.overlap_steps} must be below "
                              f"--local-steps {H} / --fragments {F} = {H // F}: a "
                              "fragment's exchange ends before the next one starts")


class LocalOptimizer:
    """session.optimizer under --local-steps (local SGD, DiLoCo, Streaming DiLoCo: the
    module docstring): the inner step, then the fragments' merges that are due and the
    exchanges that start. One fragment, no overlap, fp32 is DiLoCo's round: the outer
    gradient all-reduced, the outer step, the new global parameters copied in."""

    def __init__(self, inner, ring: Communicator, outer: OuterConfig, params, tensors,
                 local_steps: int, total_steps: int, cfg: StreamingConfig, timing: dict):
        self.inner, self.ring, self.cfg = inner, ring, cfg
        self.H, self.total, self.timing = local_steps, total_steps, timing
        self.ranges = fragment_ranges(tensors, cfg.fragments)
        # each fragment's anchor (its global values), outer gradient and outer optimizer
        self.local = [LocalSGD(params[lo:hi], make_outer(outer, params[lo:hi]))
                      for lo, hi in self.ranges]
        self.bits = BITS.get(cfg.outer_precision)
        xp = array_module(params)
        self.stream = Stream(ring) if cfg.overlap_steps else None
        self.pending: list[tuple[int, int, Job | None]] = []  # (fragment, merge at, job)
        traffic = RingTraffic(ring)
        self.sent, self.buffers = [], []
        for lo, hi in self.ranges:
            if self.bits is None:
                self.sent.append(traffic.allreduce(hi - lo, params.dtype.itemsize))
                self.buffers.append(None)
                continue
            nbytes = quantize.payload_bytes(hi - lo, self.bits)
            self.sent.append(traffic.allgather([r * nbytes for r in range(ring.size + 1)], 1))
            self.buffers.append((xp.empty(nbytes, np.uint8),  # (payload,) this rank's
                                 xp.empty(nbytes * ring.size, np.uint8)))  # every rank's

    @property
    def steps(self) -> int:
        return self.inner.steps

    def step(self, param, grad, lr: float | None = None) -> None:
        self.inner.step(param, grad, lr)
        step = self.inner.steps - 1  # 0-based, as the schedule counts
        t = time.perf_counter()
        last = step + 1 == self.total
        for f, at, job in list(self.pending):
            if at == step or last:
                self._merge(f, param, job, last)
        started = syncing(step, self.H, self.cfg.fragments, self.total)
        for f in started:
            lo, hi = self.ranges[f]
            self.local[f].outer_gradient(param[lo:hi])  # (n_f,) theta_f - theta_r,f
            if self.stream is not None and not last:
                job = self.stream.submit(lambda comm, f=f: self._exchange(f, comm))
                self.pending.append((f, step + self.cfg.overlap_steps, job))
            else:
                self._exchange(f, self.ring)
                self._merge(f, param, None, last)
        self.timing.update(comm_rounds=len(started),
                           sent_bytes=sum(self.sent[f] for f in started),
                           outer_s=time.perf_counter() - t)

    def _exchange(self, f: int, comm: Communicator) -> None:
        """Fragment f's outer gradient averaged over the ranks, in place in `delta`."""
        lo, hi = self.ranges[f]
        delta = self.local[f].delta  # (n_f,)
        if self.bits is None:
            comm.allreduce(delta, average=True)
            return
        send, every = self.buffers[f]
        quantize.pack(quantize.quantize(delta, self.bits), send)
        comm.allgather(send, every)
        delta.fill(0)
        for r in range(comm.size):  # in rank order: every rank sums the same way
            part = every[r * send.size : (r + 1) * send.size]  # (payload,)
            delta += quantize.dequantize(quantize.unpack(part, hi - lo, self.bits))
        array_module(delta).true_divide(delta, comm.size, out=delta)

    def _merge(self, f: int, param, job: Job | None, last: bool) -> None:
        """The outer step on fragment f with its averaged outer gradient, then the new
        global values into the local ones (alpha-mixed, but copied at the last step: every
        replica ends on the global parameters)."""
        if job is not None:
            job.wait()
            self.pending = [p for p in self.pending if p[0] != f]
        lo, hi = self.ranges[f]
        local = self.local[f]
        if last or not self.cfg.mix:
            local.step(param[lo:hi])  # the outer step, then theta_r,f <- theta_f
            return
        local.outer.step(local.anchor, local.delta)
        a = self.cfg.mix
        param[lo:hi] *= a
        param[lo:hi] += (1 - a) * local.anchor

    def at_round_ends(self, agree):
        """`agree` called after the steps where an exchange starts (the ranks meet then),
        zeros in between: a signal stops every rank after the same sync."""
        def agreed(counts):
            if syncing(self.inner.steps - 1, self.H, self.cfg.fragments, self.total):
                return agree(counts)
            return np.zeros_like(counts)
        return agreed

    def state_dict(self) -> dict:
        """The inner optimizer's state and each fragment's outer state and anchor."""
        outer = {f"outer{f}_{k}": v for f, local in enumerate(self.local)
                 for k, v in local.state_dict().items() if k != "steps"}
        return {**self.inner.state_dict(), **outer}

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()


