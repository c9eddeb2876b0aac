"""The outer optimizer of local SGD and DiLoCo, on flat buffers.

R replicas start an outer round from the global parameters theta; each takes H
inner steps with its own optimizer (models.optim, its state kept across rounds)
on its own data and ends at theta_r. The outer gradient is their mean change

    Delta = (1/R) sum_r (theta - theta_r)

and the outer optimizer steps theta with it as with a gradient:

    sgd        theta <- theta - L Delta
               L = 1 is model averaging, theta <- mean_r theta_r (Stich 2019, "Local SGD
               converges fast and communicates little"; Lin et al. 2020, "Don't use large
               mini-batches, use local SGD")
    sgd, M>0   v <- M v + Delta;  theta <- theta - L v
               heavy-ball outer momentum (SlowMo, Wang et al. 2020)
    nesterov   v <- M v + Delta;  theta <- theta - L (Delta + M v)
               DiLoCo (Douillard et al. 2023: inner AdamW, L = 0.7, M = 0.9); v starts at 0

These are models.optim.SGD's updates with lr L and momentum M (Sutskever et al.
2013's Nesterov form, as PyTorch's SGD(nesterov=True) that DiLoCo runs), so the
outer optimizer *is* that SGD (`make_outer`), its state and checkpoints included,
and a parameter server applies it as its optimizer (`OuterConfig.as_optim`).

Delayed Nesterov (Liu et al. 2024, "Asynchronous Local-SGD Training for Language
Modeling", Algorithm 3 with its momentum activation c = 0), for an asynchronous server
that steps once per worker's outer gradient g_t, t = 1, 2, ...: the outer gradients are
buffered, the momentum moves only at every N-th, and in between theta takes plain steps
of 1/N of each gradient (so N stale gradients move the momentum about as one
synchronous round's mean does):

    delayed-nesterov   Delta <- Delta + g_t
               t % N == 0:  v <- M v + Delta / N;  theta <- theta - L (M v + g_t / N);
                            Delta <- 0
               otherwise:   theta <- theta - L g_t / N           (v and Delta start at 0)

At N = 1 (Delta = g_t, divisions by 1 exact) it is nesterov above, bit for bit
(`DelayedNesterov`; --outer-period N).

Exactness. An inner step of SGD (with or without momentum, L2 decay) or Adam
subtracts one computed float: theta_1 = fl(theta - x). In round-to-nearest
binary arithmetic the round trip then gives it back exactly,
fl(theta - fl(theta - theta_1)) = theta_1 (Dekker's Fast2Sum when |theta| >= |x|,
a case analysis of the rounding error otherwise; tests/models/test_outer.py
checks it over 80 binades), and outer SGD at L = 1 multiplies by 1 exactly. So:

    R = 1, H = 1, outer SGD L = 1        == plain training, bit for bit, for those
                                          inner optimizers (AdamW with decay subtracts
                                          twice: not guaranteed)
    R > 1 or H > 1                       not guaranteed: Delta_r = theta - theta_r is x_r
                                          less theta_r's rounding error, so their mean is
                                          not the mean gradient's step (R = 4, H = 1: ~18%
                                          of float32 elements differ by an ulp), and two
                                          subtractions do not round trip (H = 2: ~0.3%);
                                          exact in dyadic arithmetic (integer values, lr a
                                          power of two, R a power of two), as the tests use

The sync trainer and the async worker run a replica's side as `LocalSGD`:

    local = LocalSGD(params.data, make_outer(cfg, params.data))    # anchor: the global copy
    ...H inner steps on params.data...
    delta = local.outer_gradient(params.data)   # (n,) theta - theta_r; the caller averages it
    local.step(params.data)                     # outer step on the anchor, copied to params
"""

from __future__ import annotations

from dataclasses import dataclass

from dtlab.models.backend import array_module
from dtlab.models.config import ConfigError, build, choice, described, positive
from dtlab.models.optim import SGD, OptimConfig, Optimizer


@dataclass
class OuterConfig:
    outer_optimizer: str = choice("none", "none", "sgd", "nesterov", "delayed-nesterov",
                                  help="local SGD / DiLoCo: the optimizer of the outer "
                                       "gradient (the replicas' mean parameter change over "
                                       "their inner steps); delayed-nesterov: its momentum "
                                       "every --outer-period gradients (Liu et al. 2024); "
                                       "none: off")
    outer_lr: float = described(1.0, "outer learning rate L (sgd with 1: model averaging; "
                                     "DiLoCo: 0.7)")
    outer_momentum: float = described(0.0, "outer momentum M (nesterov needs it; DiLoCo: 0.9)")
    outer_period: int = described(1, "delayed-nesterov: the momentum moves at every N-th "
                                     "outer gradient, plain steps of L/N in between (1: "
                                     "nesterov)")

    @property
    def enabled(self) -> bool:
        return self.outer_optimizer != "none"

    def validate(self):
        positive(self, "outer_lr")
        if not 0 <= self.outer_momentum < 1:
            raise ConfigError(f"--outer-momentum must be in [0, 1) (got {self.outer_momentum})")
        if "nesterov" in self.outer_optimizer and self.outer_momentum == 0:
            raise ConfigError(f"--outer-optimizer {self.outer_optimizer} needs "
                              "--outer-momentum > 0 (DiLoCo: 0.9)")
        positive(self, "outer_period")
        if self.outer_period != 1 and self.outer_optimizer != "delayed-nesterov":
            raise ConfigError(f"--outer-period {self.outer_period} needs --outer-optimizer "
                              "delayed-nesterov")
        if self.outer_optimizer == "none" and (self.outer_lr != 1.0 or self.outer_momentum):
            raise ConfigError("--outer-lr / --outer-momentum need --outer-optimizer sgd or "
                              "nesterov")

    def as_optim(self) -> OptimConfig:
        """The models.optim config of the same update: SGD at lr L with momentum M
        (Nesterov's for nesterov), no decay, no clipping, no warm-up, constant lr. For
        delayed-nesterov: nesterov's, its N = 1 case (its lr schedule and what a worker
        checks); the optimizer itself is `make_outer`'s DelayedNesterov."""
        if not self.enabled:
            raise ConfigError("no outer optimizer: give --outer-optimizer sgd or nesterov")
        return build(OptimConfig, {
            "optimizer": "sgd", "lr": self.outer_lr, "momentum": self.outer_momentum,
            "nesterov": "nesterov" in self.outer_optimizer, "weight_decay": 0.0, "clip": 0.0,
            "warmup": 0, "schedule": "constant"})


class DelayedNesterov(Optimizer):
    """Liu et al. 2024's Delayed Nesterov outer update (the module docstring's formula):
    momentum M applied at every `period`-th step, plain steps of lr/period in between.
    State: the velocity v, the buffer Delta of the outer gradients since the last momentum
    step, and the step count (which says where in the period it is)."""

    state_names = ("velocity", "buffer")

    def __init__(self, param_template, lr: float, momentum: float, period: int, **kw):
        super().__init__(param_template, lr, **kw)
        if period < 1:
            raise ValueError(f"period {period}: at least 1")
        self.momentum, self.period = momentum, period

    def step(self, param, grad, lr: float | None = None) -> None:
        """One step; `grad` is an array or anything sliced like one (a received stream)."""
        super().step(param, grad[0 : grad.shape[0]], lr)

    def _update(self, p, g, lr):  # (n,) each
        xp, N, t = array_module(p), self.period, self._tmp
        self.buffer += g  # Delta <- Delta + g_t
        if self.steps % N:  # theta <- theta - L g_t / N
            xp.divide(g, N, out=t)
        else:  # v <- M v + Delta / N;  theta <- theta - L (M v + g_t / N);  Delta <- 0
            v = self.velocity
            v *= self.momentum
            v += self.buffer / N
            xp.multiply(v, self.momentum, out=t)
            t += g / N
            self.buffer[...] = 0
        t *= lr
        p -= t


def make_outer(cfg: OuterConfig, param_template) -> SGD | DelayedNesterov:
    """The outer optimizer `cfg` names, for a flat array shaped like `param_template`."""
    o = cfg.as_optim()
    if cfg.outer_optimizer == "delayed-nesterov":
        return DelayedNesterov(param_template, o.lr, o.momentum, cfg.outer_period)
    return SGD(param_template, o.lr, o.momentum, o.nesterov)


def outer_gradient(global_params, local_params, out=None):
    """Delta = global - local, elementwise (into `out` if given)."""  # (n,)
    if global_params.shape != local_params.shape:
        raise ValueError(f"global shape {global_params.shape} != local shape "
                         f"{local_params.shape}")
    return array_module(global_params).subtract(global_params, local_params, out=out)


def round_ends(step: int, local_steps: int, total: int) -> bool:
    """Whether inner step `step` (0-based) of `total` ends an outer round of `local_steps`
    (the last step always does: a shorter last round)."""
    return (step + 1) % local_steps == 0 or step + 1 == total


class LocalSGD:
    """One replica's side of local SGD: the global parameters it started the round from
    (the anchor, a copy of `params`), the outer optimizer over them and the outer
    gradient's buffer, which the caller averages over the replicas in place between
    `outer_gradient` and `step`."""

    def __init__(self, params, outer: SGD):
        xp = array_module(params)
        self.anchor = params.copy()  # (n,) theta
        self.delta = xp.empty_like(params)  # (n,) theta - theta_r, then its mean
        self.outer = outer

    def outer_gradient(self, params):
        """theta - params into the buffer, returned (average it over the replicas there)."""
        return outer_gradient(self.anchor, params, out=self.delta)

    def step(self, params) -> None:
        """The outer step with the (averaged) buffer, then params <- the new global."""
        self.outer.step(self.anchor, self.delta)
        params[...] = self.anchor

    def state_dict(self) -> dict:
        return {"anchor": self.anchor, **self.outer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if state["anchor"].shape != self.anchor.shape:
            raise ValueError(f"outer anchor: shape {state['anchor'].shape} != "
                             f"{self.anchor.shape}")
        self.outer.load_state_dict({k: v for k, v in state.items() if k != "anchor"})
        self.anchor[...] = array_module(self.anchor).asarray(state["anchor"])
