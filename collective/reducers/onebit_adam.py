"""1-bit Adam on the sync topology: dtlab-sync --onebit-adam W (with --optimizer adam or
adamw).

Tang et al. 2021, "1-bit Adam: Communication Efficient Large-Scale Training with Adam's
Convergence Speed", Algorithm 1:

    steps 1..W (warm-up)  Adam / AdamW on the averaged gradient, exactly as plain data
                          parallelism runs it (the bucketed all-reduce); then v is frozen
    every later step t    each rank keeps its gradient g_r and, from the shared m,
                              m_r = b1 m + (1 - b1) g_r
                              p_r = m_r + e_r                  e_r: what it did not send
                              C(p_r) = (|p_r|_1 / n) sign(p_r)  1 bit an element + a scale
                              e_r <- p_r - C(p_r)
                          m = mean over the ranks of C(p_r)   (every payload all-gathered
                                                               over our ring, summed in
                                                               rank order)
                          theta <- theta - lr_t m / (sqrt(v) + eps_t)
                          (AdamW: theta <- theta - lr wd theta first; Adam: g_r + wd theta)

with Adam's bias corrections folded as models/optim.py folds them, v's frozen at step W:
lr_t = lr sqrt(1 - b2^W) / (1 - b1^t), eps_t = eps sqrt(1 - b2^W). Tang et al. compress
twice (on the workers and, after a reduce-scatter, on the servers, each with its own
error); the all-gather here lets every rank average the decompressed payloads itself, so
only the rank's error is needed, at (N - 1) payloads a rank on the wire instead of two.
The sign compressor and its error feedback are models/compress.py's `Sign`.

W >= --steps is plain data-parallel Adam bit for bit (tests/collective/test_onebit_adam.py).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from dtlab.collective.comm import Communicator
from dtlab.collective.reducers.exchange import Exchange
from dtlab.collective.zero.layout import RingTraffic
from dtlab.models.backend import array_module
from dtlab.models.compress import Sign, SignPayload
from dtlab.models.config import ConfigError, described
from dtlab.models.flag_rules import Conflicts, Flag, rules
from dtlab.models.optim import Adam, OptimConfig

# --optimizer other than Adam's: 1-bit and 0/1 Adam compress Adam's momentum
NOT_ADAM = Flag("optimizer", OptimConfig, test=lambda name: name not in ("adam", "adamw"))


@rules(Conflicts("onebit_adam", NOT_ADAM, why="1-bit Adam compresses Adam's momentum (give "
                                              "--optimizer adam or adamw)"))
@dataclass
class OneBitConfig:
    onebit_adam: int = described(0, "1-bit Adam (Tang et al. 2021): Adam on the averaged "
                                    "gradient for this many warm-up steps, then the variance "
                                    "frozen and the momentum all-gathered as signs with error "
                                    "feedback (--optimizer adam or adamw); 0: off")

    def validate(self) -> None:
        if self.onebit_adam < 0:
            raise ConfigError(f"--onebit-adam must not be negative (got {self.onebit_adam})")


class SignAllgather:
    """Each rank's vector p_r sent as C(p_r + e_r), its signs and a scale (models/compress.py's
    `Sign`, whose residual is e_r), every rank's payload all-gathered over our ring and
    their decompressed mean taken on every rank in rank order: the same bits everywhere.
    1-bit Adam's exchange of the momentum, and 0/1 Adam's (collective/reducers/zero_one_adam.py)."""

    def __init__(self, ring: Communicator, n: int, dtype, xp):
        self.ring = ring
        self.sign = Sign(n, dtype, xp)  # its residual is e_r
        self.nbytes = dtype.itemsize + -(-n // 8)  # a payload: the scale, then the bits
        self.send = xp.empty(self.nbytes, np.uint8)  # (payload,)
        self.every = xp.empty(self.nbytes * ring.size, np.uint8)  # (N payloads,)
        self.sent = RingTraffic(ring).allgather(  # bytes this rank sends in one exchange
            [r * self.nbytes for r in range(ring.size + 1)], 1)

    def mean(self, local, out) -> None:
        """out (n,) <- mean over the ranks of C(local + e_r); e_r <- what was not sent."""
        self._average(self.sign.compress(local), out)

    def _average(self, payload: SignPayload, out) -> None:
        """Every rank's payload all-gathered; `out` <- their decompressed mean."""
        scale = array_module(self.send).asarray(payload.scale).reshape(1).view(np.uint8)
        self.send[: scale.size] = scale
        self.send[scale.size:] = payload.bits
        self.ring.allgather(self.send, self.every)
        out.fill(0)
        b = scale.size
        for r in range(self.ring.size):  # in rank order: every rank sums the same way
            chunk = self.every[r * self.nbytes : (r + 1) * self.nbytes]  # (payload,)
            self.sign.accumulate(SignPayload(chunk[b:], chunk[:b].view(out.dtype)[0]), out)
        array_module(out).true_divide(out, self.ring.size, out=out)


class OneBitAdam:
    """session.optimizer under --onebit-adam W: `inner` (Adam or AdamW) for the first W
    steps, then the compressed momentum step of the module docstring on its m and v."""

    def __init__(self, inner: Adam, ring: Communicator, warmup: int, timing: dict):
        if not isinstance(inner, Adam):
            raise ConfigError("--onebit-adam needs --optimizer adam or adamw")
        xp = array_module(inner.m)
        n, dtype = inner.m.size, inner.m.dtype
        self.inner, self.ring, self.warmup, self.timing = inner, ring, warmup, timing
        self.signs = SignAllgather(ring, n, dtype, xp)
        self.local = xp.empty(n, dtype)  # (n,) m_r
        self.nbytes, self.sent = self.signs.nbytes, self.signs.sent

    @property
    def steps(self) -> int:
        return self.inner.steps

    @property
    def warming(self) -> bool:
        """Whether the next step is one of the warm-up's (the gradient is all-reduced)."""
        return self.inner.steps < self.warmup

    def step(self, param, grad, lr: float | None = None) -> None:
        if self.warming:
            self.inner.step(param, grad, lr)
            self.timing.update(onebit=0)
            return
        t = time.perf_counter()
        a, xp = self.inner, array_module(param)
        lr = a.lr if lr is None else lr
        a.steps += 1
        grad = a.decayed(param, grad, lr)
        b1, b2 = a.beta1, a.beta2
        xp.multiply(a.m, b1, out=self.local)
        self.local += xp.multiply(grad, 1 - b1, out=a._tmp)  # (n,) m_r
        self.signs.mean(self.local, a.m)  # m = mean_r C(m_r + e_r)
        lr_t = lr * math.sqrt(1 - b2**self.warmup) / (1 - b1**a.steps)
        eps_t = a.eps * math.sqrt(1 - b2**self.warmup)
        xp.sqrt(a.v, out=a._tmp)
        a._tmp += eps_t
        xp.divide(a.m, a._tmp, out=a._tmp)
        a._tmp *= lr_t
        param -= a._tmp
        self.timing.update(onebit=1, comm_rounds=1, sent_bytes=self.sent,
                           onebit_s=time.perf_counter() - t)

    def state_dict(self) -> dict:
        return {**self.inner.state_dict(), "onebit_error": self.signs.sign.residual}


class OneBitReducer(Exchange):
    """The trainer's reducer under --onebit-adam: plain data parallelism's (`plain`) while
    the optimizer warms up; afterwards nothing to reduce (the momentum travels in the
    optimizer's step)."""

    def __init__(self, plain, optimizer: OneBitAdam):
        super().__init__(plain.comm)
        self.plain, self.optimizer = plain, optimizer
        self.overlap = plain.overlap

    def ready(self, offset: int) -> None:
        if self.optimizer.warming:
            self.plain.ready(offset)

    def wait(self) -> dict:
        if self.optimizer.warming:
            return self.plain.wait()
        return {"comm_s": 0.0, "wait_s": 0.0, "wire_bytes": 0}

    def plan(self) -> list[dict]:
        return self.plain.plan() + [{"algorithm": "ring allgather (1-bit momentum)",
                                     "bytes": self.optimizer.nbytes}]

    def close(self) -> None:
        self.plain.close()
        self.optimizer.ring.free()


def onebit_session(session, comm: Communicator, warmup: int, plain):
    """The session with its optimizer wrapped (OneBitAdam) and the reducer to go with it;
    `plain` the data-parallel reducer of the warm-up, `comm` the dp communicator."""
    ring = comm.dup("onebit-adam", ours="ring")
    session.optimizer = OneBitAdam(session.optimizer, ring, warmup, session.replica.timing)
    return session, OneBitReducer(plain, session.optimizer)
