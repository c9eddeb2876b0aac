"""0/1 Adam on the sync topology: dtlab-sync --zero-one-adam W (with --optimizer adam or
adamw).

Lu et al. 2022, "Maximizing Communication Efficiency for Large-scale Training via 0/1
Adam" (arXiv 2202.06009), Algorithm 1: the variance updated only at the steps of a set
T_v and frozen after W; the momentum exchanged as 1-bit signs with error feedback; after
W, local steps, the exchange skipped between the steps of a set T_u. Each step is one of
three kinds (`zero_one_schedule`, steps counted from 1):

    variance  t in T_v (t <= W): Adam / AdamW on the averaged gradient g (plain data
              parallelism's bucketed all-reduce, full precision): m <- b1 m + (1 - b1) g,
              v <- b2 v + (1 - b2) g^2, the k-th update of v
    sync      t in T_u: the round's exchange. A round is the steps since the last
              exchange; on each of them a rank takes m_r <- b1 m_r + (1 - b1) g_r from its
              own gradient and step size c_t = lr sqrt(1 - b2^k) / (1 - b1^t) (the bias
              corrections of models/optim.py, v's counting its k updates; eps_t =
              eps sqrt(1 - b2^k)), and at the round's end sends the round's mean momentum
              a_r = sum_t c_t m_r,t / lam (lam = sum_t c_t; kept as a running weighted
              mean) with 1-bit Adam's exchange: C(a_r + e_r) = (|.|_1 / n) sign(.), e_r
              its residual, all-gathered over our ring (collective/reducers/onebit_adam.py's
              `SignAllgather`, the same code). Then on every rank
                  m <- mean_r C(a_r + e_r)
                  theta <- theta_0 - lam m / (sqrt(v) + eps_t)
              theta_0 the parameters at the round's start (AdamW's decay applied to them
              as to theta at every step): the paper's x_{t'} - u / sqrt(v) with m = u /
              sum gamma, u = lam m; the error kept in momentum units (the paper keeps it in
              u's: the signs are the same, the scale differs by lam)
    local     the other steps after W: the rank's own step, no exchange (comm_rounds 0):
              m_r as above, theta_r <- theta_r - c_t m_r / (sqrt(v) + eps_t)

The policies, as implemented:
- T_v, the paper's exponential rule of adaptive variance freezing (kappa; DeepSpeed's
  ZeroOneAdam calls it var_update_scaler, and W var_freeze_step): the interval between
  updates of v starts at 1 and doubles after every kappa updates, up to step W; v is
  frozen after W. The steps up to W outside T_v are sync steps: every step exchanges.
  kappa >= W updates v at every step up to W.
- T_u, "1-bit sync with local steps" (DeepSpeed's local_step_scaler S and
  local_step_clipper H; its S, 32678, follows BERT's long lr schedule): after W, a round
  starting at step t lasts min(H, 2^floor((t - W - 1) / S)) steps: one step at first,
  twice as many every S steps, at most H. A round also ends at every evaluation
  (--eval-every: the held-out loss is of the shared parameters) and at the last step,
  so every rank ends with the same parameters.

Exact reductions (tests/collective/test_zero_one_adam.py): with kappa and W at least
--steps every step is a variance step, plain data-parallel Adam bit for bit (1-bit Adam's
warm-up); with kappa >= W and H = 1 it is 1-bit Adam --onebit-adam W bit for bit. Each
step's record carries comm_rounds (0 on a local step), sent_bytes (the all-reduce's, the
payload's all-gather's, 0) and variance_update. As under local SGD the logged loss's mean
over the ranks waits for the next exchange; the stop agreement still meets every step.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from dtlab.collective.comm import Communicator
from dtlab.collective.reducers.local_sgd import LocalReducer
from dtlab.collective.reducers.onebit_adam import NOT_ADAM, SignAllgather
from dtlab.models.backend import array_module
from dtlab.models.config import ConfigError, described
from dtlab.models.flag_rules import Conflicts, NoEffectWithout, rules
from dtlab.models.optim import Adam
from dtlab.models.run.loop import eval_due

VARIANCE, SYNC, LOCAL = "variance", "sync", "local"  # a step's kind


@rules(Conflicts("zero_one_adam", NOT_ADAM, why="0/1 Adam compresses Adam's momentum (give "
                                                "--optimizer adam or adamw)"),
       NoEffectWithout(("zero_one_variance_doubling", "zero_one_local_doubling",
                        "zero_one_local_max"), "zero_one_adam"))
@dataclass
class ZeroOneConfig:
    zero_one_adam: int = described(0, "0/1 Adam (Lu et al. 2022): up to this step the variance "
                                      "updated on a growing interval (the gradient all-reduced "
                                      "then) and the momentum all-gathered as signs with error "
                                      "feedback in between; after it the variance frozen and "
                                      "local steps, the signs exchanged on a growing interval "
                                      "(--optimizer adam or adamw); 0: off")
    zero_one_variance_doubling: int = described(16, "0/1 Adam's kappa: the variance's update "
                                                    "interval starts at 1 step and doubles after "
                                                    "every this many updates (DeepSpeed's 16); "
                                                    "at least --zero-one-adam: every step")
    zero_one_local_doubling: int = described(32, "0/1 Adam: after the freeze the interval "
                                                 "between exchanges starts at 1 step and doubles "
                                                 "every this many steps (DeepSpeed's "
                                                 "local_step_scaler, 32678 for BERT's long "
                                                 "runs)")
    zero_one_local_max: int = described(16, "0/1 Adam's H: the longest interval between "
                                            "exchanges (DeepSpeed's 16; 1: every step, 1-bit "
                                            "Adam's)")

    def validate(self) -> None:
        if self.zero_one_adam < 0:
            raise ConfigError(f"--zero-one-adam must not be negative (got {self.zero_one_adam})")
        for name in ("zero_one_variance_doubling", "zero_one_local_doubling",
                     "zero_one_local_max"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1 (got "
                                  f"{getattr(self, name)})")


def zero_one_schedule(cfg: ZeroOneConfig, steps: int, eval_every: int) -> list[str]:
    """The kind of each of steps 1..`steps` (VARIANCE, SYNC or LOCAL): the module
    docstring's T_v and T_u."""
    W, kappa = cfg.zero_one_adam, cfg.zero_one_variance_doubling
    S, H = cfg.zero_one_local_doubling, cfg.zero_one_local_max
    updates, t, gap = set(), 1, 1
    while t <= W:
        updates.add(t)
        if len(updates) % kappa == 0:
            gap *= 2
        t += gap
    kinds, left = [], 0  # left: the steps of this round still to come
    for t in range(1, steps + 1):
        if t <= W:
            kinds.append(VARIANCE if t in updates else SYNC)
            continue
        if not left:
            left = min(H, 2 ** min((t - W - 1) // S, H.bit_length()))
        left -= 1
        if t == steps or eval_due(t, eval_every, steps):
            left = 0
        kinds.append(LOCAL if left else SYNC)
    return kinds


class ZeroOneAdam:
    """session.optimizer under --zero-one-adam: `inner` (Adam or AdamW) at the variance's
    steps, the module docstring's sync and local steps on its m and v otherwise."""

    def __init__(self, inner: Adam, ring: Communicator, kinds: list[str], timing: dict,
                 full_bytes: int | None):
        if not isinstance(inner, Adam):
            raise ConfigError("--zero-one-adam needs --optimizer adam or adamw")
        xp = array_module(inner.m)
        n, dtype = inner.m.size, inner.m.dtype
        self.inner, self.ring, self.kinds, self.timing = inner, ring, kinds, timing
        self.full = {} if full_bytes is None else {"sent_bytes": full_bytes}
        self.signs = SignAllgather(ring, n, dtype, xp)
        self.nbytes = self.signs.nbytes
        self.mean_m = xp.empty(n, dtype)  # (n,) a_r: the round's c-weighted mean momentum
        self.start = xp.empty(n, dtype) if LOCAL in kinds else None  # (n,) theta_0
        self.updates = 0  # k: v's updates so far
        self.weight = 0.0  # lam: the round's sum of step sizes c_t
        self.taken = 0  # steps taken in this round

    @property
    def steps(self) -> int:
        return self.inner.steps

    @property
    def full_precision(self) -> bool:
        """Whether the next step updates the variance (the gradient is all-reduced)."""
        return self.kinds[self.inner.steps] == VARIANCE

    def step(self, param, grad, lr: float | None = None) -> None:
        t = time.perf_counter()
        kind = self.kinds[self.inner.steps]
        lr = self.inner.lr if lr is None else lr
        if kind == VARIANCE:
            self._variance_step(param, grad, lr)
            self.timing.pop("sent_bytes", None)
            self.timing.update(variance_update=1, comm_rounds=1, **self.full)
        else:
            self._momentum_step(param, grad, lr, kind == SYNC)
            self.timing.update(variance_update=0, comm_rounds=int(kind == SYNC),
                               sent_bytes=self.signs.sent if kind == SYNC else 0)
        self.timing["zero_one_s"] = time.perf_counter() - t

    def _variance_step(self, param, grad, lr: float) -> None:
        a = self.inner
        self.updates += 1
        if self.updates == a.steps + 1:  # v updated at every step so far: Adam's own step
            a.step(param, grad, lr)
            return
        xp, b1, b2 = array_module(param), a.beta1, a.beta2
        a.steps += 1
        grad = a.decayed(param, grad, lr)
        a.m *= b1
        a.m += xp.multiply(grad, 1 - b1, out=a._tmp)
        a.v *= b2
        xp.multiply(grad, grad, out=a._tmp)
        a._tmp *= 1 - b2
        a.v += a._tmp
        self._descend(param, a.m, *self._sizes(lr))

    def _momentum_step(self, param, grad, lr: float, sync: bool) -> None:
        a, xp, b1 = self.inner, array_module(param), self.inner.beta1
        a.steps += 1
        first, self.taken = self.taken == 0, self.taken + 1
        alone = first and sync  # a one-step round: theta_0 is param itself
        if first and not sync:
            self.start[...] = param
        grad = a.decayed(param, grad, lr)
        if not alone and a.decoupled and a.weight_decay:
            a.decayed(self.start, grad, lr)  # AdamW: theta_0 decays as theta does
        a.m *= b1
        a.m += xp.multiply(grad, 1 - b1, out=a._tmp)  # (n,) m_r
        c, eps_t = self._sizes(lr)
        self.weight += c
        if first:
            self.mean_m[...] = a.m
        else:  # a_r += (c_t / lam) (m_r - a_r)
            xp.subtract(a.m, self.mean_m, out=a._tmp)
            a._tmp *= c / self.weight
            self.mean_m += a._tmp
        if not sync:
            self._descend(param, a.m, c, eps_t)
            return
        self.signs.mean(self.mean_m, a.m)  # m = mean_r C(a_r + e_r)
        base = param if alone else self.start
        self._descend(base, a.m, self.weight, eps_t)
        if not alone:
            param[...] = base
        self.taken, self.weight = 0, 0.0

    def _sizes(self, lr: float) -> tuple[float, float]:
        """(c_t, eps_t): the step size and epsilon with the bias corrections folded in."""
        a, k = self.inner, self.updates
        return (lr * math.sqrt(1 - a.beta2**k) / (1 - a.beta1**a.steps),
                a.eps * math.sqrt(1 - a.beta2**k))

    def _descend(self, param, m, size: float, eps_t: float) -> None:
        """param -= size m / (sqrt(v) + eps_t), in 1-bit Adam's order of operations."""
        a, xp = self.inner, array_module(param)
        xp.sqrt(a.v, out=a._tmp)
        a._tmp += eps_t
        xp.divide(m, a._tmp, out=a._tmp)
        a._tmp *= size
        param -= a._tmp

    def state_dict(self) -> dict:
        return {**self.inner.state_dict(), "zero_one_error": self.signs.sign.residual}


class ZeroOneReducer(LocalReducer):
    """The trainer's reducer under --zero-one-adam: plain data parallelism's (`plain`) at
    the variance's steps; otherwise nothing to reduce (the momentum travels in the
    optimizer's step, or stays). The step records wait for the next exchange, where one
    all-reduce averages their losses, as under local SGD (LocalReducer.settled)."""

    def __init__(self, plain, ring: Communicator, optimizer: ZeroOneAdam):
        super().__init__(ring)
        self.plain, self.zero_one = plain, optimizer
        self.overlap = plain.overlap

    def ready(self, offset: int) -> None:
        if self.zero_one.full_precision:
            self.plain.ready(offset)

    def wait(self) -> dict:
        return self.plain.wait() if self.zero_one.full_precision else super().wait()

    def plan(self) -> list[dict]:
        return self.plain.plan() + [{"algorithm": "ring allgather (1-bit momentum)",
                                     "bytes": self.zero_one.nbytes}]

    def close(self) -> None:
        self.plain.close()
        super().close()


def zero_one_session(session, comm: Communicator, cfg: ZeroOneConfig, plain):
    """The session with its optimizer wrapped (ZeroOneAdam) and the reducer to go with it;
    `plain` the data-parallel reducer of the variance's steps, `comm` the dp communicator."""
    run = session.setup.run
    kinds = zero_one_schedule(cfg, run.steps, run.eval_every)
    ring = comm.dup("zero-one-adam", ours="ring")
    session.optimizer = ZeroOneAdam(session.optimizer, ring, kinds, session.replica.timing,
                                    plain.sent_bytes)
    return session, ZeroOneReducer(plain, ring, session.optimizer)
