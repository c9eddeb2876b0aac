"""Optimizers, gradient clipping and learning-rate schedules on flat buffers.

Each optimizer updates one flat parameter array in place from a flat
gradient array of the same size; it may be a whole model or one parameter
server shard's range of it. The same code runs in the single-process, sync
and async trainers. State (moments, step) is exposed for checkpoints.

    SGD:   v <- mu v + g;  p <- p - lr (g + mu v if nesterov else v)   (Sutskever et al. 2013)
    Adam:  m <- b1 m + (1-b1) g;  v <- b2 v + (1-b2) g^2
           p <- p - lr m/(1-b1^t) / (sqrt(v/(1-b2^t)) + eps)           (Kingma & Ba 2015)
    AdamW: as Adam, with decay applied to p directly: p <- p - lr wd p (Loshchilov & Hutter 2019)

SGD and Adam add weight decay to the gradient (L2); AdamW decouples it.
`decay_mask` (1 where decay applies, 0 for biases and norm gains) restricts it.

On NumPy arrays the update after weight decay runs in one pass of C
(models/_fused.c, where it was built): the same operations in the same
order, bit-identical to the array lines below, which run on CuPy and
wherever the kernels are missing. A 64 MB float32 SGD step reads and writes
memory once instead of twice (Adam: once instead of ten times). A long
buffer's pass is split in blocks over the process's compute threads
(layers.in_blocks, as PyTorch's fused AdamW splits its loop over its threads);
each element's update is the same, so the results are too.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dtlab.models.backend import array_module
from dtlab.models.config import ConfigError, choice, described, non_negative, positive
from dtlab.models.layers import in_blocks

try:
    from dtlab.models import _fused
except ImportError:
    _fused = None


def _fusable(*arrays) -> bool:
    """Whether models/_fused.c can take these arrays: NumPy, one float dtype, contiguous
    and aligned (anything else takes the array lines)."""
    dtype = arrays[0].dtype
    return (_fused is not None and dtype in (np.float32, np.float64)
            and all(type(a) is np.ndarray and a.dtype == dtype and a.flags.c_contiguous
                    and a.flags.aligned for a in arrays))


THREAD_BLOCK = 1 << 18  # elements a thread's block of an update has at least (1 MB float32)


def _spread(kernel, arrays, *scalars) -> None:
    """kernel(*blocks of arrays, *scalars) over blocks of the contiguous `arrays` (one
    size), on the compute threads."""
    flat = [a.reshape(-1) for a in arrays]
    in_blocks(lambda lo, hi: kernel(*(a[lo:hi] for a in flat), *scalars), flat[0].size,
              THREAD_BLOCK)


@dataclass
class OptimConfig:
    optimizer: str = choice("adamw", "sgd", "adam", "adamw", help="update rule")
    lr: float = described(1e-2, "peak learning rate (after warm-up)")
    momentum: float = described(0.0, "SGD momentum (0: plain SGD)")
    nesterov: bool = described(False, "Nesterov momentum (SGD with --momentum)")
    beta1: float = described(0.9, "Adam first-moment decay")
    beta2: float = described(0.99, "Adam second-moment decay")
    eps: float = described(1e-8, "Adam denominator epsilon")
    weight_decay: float = described(0.0, "decoupled weight decay (AdamW) or L2 (SGD, Adam); "
                                             "never on biases and norms")
    clip: float = described(1.0, "clip the global gradient norm to this (0: off)")
    warmup: int = described(50, "steps of linear lr warm-up from 0")
    schedule: str = choice("cosine", "cosine", "constant", help="lr after warm-up")
    min_lr_ratio: float = described(0.1, "cosine ends at this fraction of --lr")

    def validate(self):
        positive(self, "lr", "eps")
        non_negative(self, "momentum", "weight_decay", "clip", "warmup", "min_lr_ratio")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ConfigError(f"--{name} must be in [0, 1) (got {getattr(self, name)})")
        if self.nesterov and self.momentum == 0:
            raise ConfigError("--nesterov needs --momentum > 0")
        if self.min_lr_ratio > 1:
            raise ConfigError(f"--min-lr-ratio must be at most 1 (got {self.min_lr_ratio})")


class Optimizer:
    """Base: holds lr, weight decay, the decay mask and a scratch buffer.

    `scratch` (shaped like the parameters) may be shared by optimizers that
    never step at the same time, so that it stays in cache between them.
    """

    state_names: tuple[str, ...] = ()

    def __init__(self, param_template, lr: float, weight_decay: float = 0.0, decay_mask=None,
                 scratch=None):
        xp = array_module(param_template)
        self.lr, self.weight_decay, self.decay_mask = lr, weight_decay, decay_mask
        self.steps = 0
        if scratch is not None and scratch.shape != param_template.shape:
            raise ValueError(f"scratch shape {scratch.shape} != param shape "
                             f"{param_template.shape}")
        self._tmp = xp.empty_like(param_template) if scratch is None else scratch
        for name in self.state_names:
            setattr(self, name, xp.zeros_like(param_template))

    def _decay(self, p):
        """wd * p (masked) in the scratch buffer."""
        t = self._tmp
        array_module(p).multiply(p, self.weight_decay, out=t)
        if self.decay_mask is not None:
            t *= self.decay_mask
        return t

    def step(self, param, grad, lr: float | None = None) -> None:
        if param.shape != grad.shape:
            raise ValueError(f"param shape {param.shape} != grad shape {grad.shape}")
        self.steps += 1
        self._update(param, grad, self.lr if lr is None else lr)

    def step_ranges(self, param, packed, ranges: Sequence[tuple[int, int]],
                    lr: float | None = None) -> None:
        """One step that updates only the elements [lo, hi) of each of `ranges` (sorted,
        disjoint), `packed` holding their gradients back to back; every other element and
        its state (velocity, moments) is left exactly as it is. This is the lazy update of
        sparse optimizers (TensorFlow's LazyAdamOptimizer; PyTorch's SparseAdam: "only the
        moments that show up in the gradient get updated"), for a gradient known to be zero
        elsewhere; for plain SGD it equals the dense step. The step still counts (Adam's
        bias correction uses the step number, as LazyAdam's does)."""
        total = sum(hi - lo for lo, hi in ranges)
        if total != packed.shape[0]:
            raise ValueError(f"ranges hold {total} elements, the packed gradient "
                             f"{packed.shape[0]}")
        self.steps += 1
        lr = self.lr if lr is None else lr
        at = 0
        for lo, hi in ranges:
            self._part(lo, hi)._update(param[lo:hi], packed[at : at + hi - lo], lr)
            at += hi - lo

    def _part(self, lo: int, hi: int) -> Optimizer:
        """This optimizer over elements [lo, hi) only: its state, decay mask and scratch
        are views of this one's, its step count this one's."""
        part = copy.copy(self)
        for name in self.state_names:
            setattr(part, name, getattr(self, name)[lo:hi])
        part.decay_mask = None if self.decay_mask is None else self.decay_mask[lo:hi]
        part._tmp = self._tmp[: hi - lo]
        return part

    def _update(self, p, g, lr):
        raise NotImplementedError

    def state_dict(self) -> dict:
        return {"steps": self.steps, **{n: getattr(self, n) for n in self.state_names}}

    def load_state_dict(self, state: dict) -> None:
        for name in self.state_names:
            buf = getattr(self, name)
            if state[name].shape != buf.shape:
                raise ValueError(
                    f"optimizer state {name}: shape {state[name].shape} != {buf.shape}")
            buf[...] = array_module(buf).asarray(state[name])
        self.steps = int(state["steps"])


class SGD(Optimizer):
    def __init__(self, param_template, lr, momentum=0.0, nesterov=False, **kw):
        self.state_names = ("velocity",) if momentum else ()
        super().__init__(param_template, lr, **kw)
        self.momentum, self.nesterov = momentum, nesterov

    def _update(self, p, g, lr):
        xp = array_module(p)
        if self.weight_decay:
            g = g + self._decay(p)
        if not self.momentum:
            if _fusable(p, g):
                _spread(_fused.sgd, (p, g), lr)
            else:
                p -= xp.multiply(g, lr, out=self._tmp)
            return
        v = self.velocity
        if _fusable(p, g, v):
            _spread(_fused.momentum, (p, g, v), self.momentum, lr, self.nesterov)
            return
        v *= self.momentum
        v += g
        if self.nesterov:  # p -= lr (g + mu v)
            xp.multiply(v, self.momentum, out=self._tmp)
            self._tmp += g
        else:
            self._tmp[...] = v
        self._tmp *= lr
        p -= self._tmp


class Adam(Optimizer):
    state_names = ("m", "v")
    decoupled = False

    def __init__(self, param_template, lr, beta1=0.9, beta2=0.999, eps=1e-8, **kw):
        super().__init__(param_template, lr, **kw)
        self.beta1, self.beta2, self.eps = beta1, beta2, eps

    def decayed(self, p, g, lr):
        """Weight decay: AdamW shrinks p by lr x decay now and returns g as it is; Adam
        returns g + decay (L2)."""
        if self.weight_decay and self.decoupled:
            decay = self._decay(p)
            decay *= lr
            p -= decay
        elif self.weight_decay:
            g = g + self._decay(p)
        return g

    def _update(self, p, g, lr):
        xp = array_module(p)
        g = self.decayed(p, g, lr)
        b1, b2, t = self.beta1, self.beta2, self.steps
        # p -= lr_t * m / (sqrt(v) + eps_t), bias corrections folded into lr_t and eps_t
        lr_t = lr * math.sqrt(1 - b2**t) / (1 - b1**t)
        eps_t = self.eps * math.sqrt(1 - b2**t)
        if _fusable(p, g, self.m, self.v):
            _spread(_fused.adam, (p, g, self.m, self.v), b1, 1 - b1, b2, 1 - b2, eps_t, lr_t)
            return
        self.m *= b1
        self.m += xp.multiply(g, 1 - b1, out=self._tmp)
        self.v *= b2
        xp.multiply(g, g, out=self._tmp)
        self._tmp *= 1 - b2
        self.v += self._tmp
        xp.sqrt(self.v, out=self._tmp)
        self._tmp += eps_t
        xp.divide(self.m, self._tmp, out=self._tmp)
        self._tmp *= lr_t
        p -= self._tmp


class AdamW(Adam):
    decoupled = True


def make_optimizer(cfg: OptimConfig, param_template, decay_mask=None, scratch=None) -> Optimizer:
    """The optimizer `cfg` names, for a flat array shaped like `param_template`."""
    kw = {"weight_decay": cfg.weight_decay, "decay_mask": decay_mask, "scratch": scratch}
    if cfg.optimizer == "sgd":
        return SGD(param_template, cfg.lr, cfg.momentum, cfg.nesterov, **kw)
    cls = Adam if cfg.optimizer == "adam" else AdamW
    return cls(param_template, cfg.lr, cfg.beta1, cfg.beta2, cfg.eps, **kw)


def clip_grad_norm(grad, max_norm: float, split: Sequence[tuple[int, int]] = (),
                   comm=None) -> float:
    """Scale `grad` in place so its global L2 norm is at most `max_norm`.

    Returns the norm before clipping. max_norm <= 0 disables clipping.
    With `comm` (a tensor-parallel group, models/comm.py) the norm is the
    whole model's: the squares of the `split` ranges of `grad` (this rank's
    shards of split tensors) are summed over the ranks, those of the rest
    (replicated tensors, whose gradients are equal on every rank) counted once:

        norm^2 = sum_ranks |g_split|^2 + |g_replicated|^2
    """
    if comm is None:
        norm = math.sqrt(squares(grad, [(0, grad.size)]))
    else:
        split_sq = np.array([squares(grad, split)])  # (1,) split squares: summed over comm
        replicated_sq = squares(grad, complement(split, grad.size))
        comm.allreduce(split_sq)
        norm = math.sqrt(float(split_sq[0]) + replicated_sq)
    return clip_to(grad, norm, max_norm)


def squares(grad, ranges: Sequence[tuple[int, int]]) -> float:
    """Sum of squares of `grad` over the (lo, hi) ranges.

    The ranges' dot products are summed in float64 on the device, in order (the sum of
    their Python floats, bit for bit), and read once: one device synchronisation, not one
    per range (a tensor-split model has dozens of ranges)."""
    xp = array_module(grad)
    parts = [xp.dot(grad[lo:hi], grad[lo:hi]).astype(np.float64) for lo, hi in ranges]  # 0-d
    return float(sum(parts)) if parts else 0.0


def complement(ranges: Sequence[tuple[int, int]], size: int) -> list[tuple[int, int]]:
    """The (lo, hi) ranges of [0, size) outside the disjoint `ranges`."""
    edges = [0, *(e for lo_hi in sorted(ranges) for e in lo_hi), size]
    return [(edges[i], edges[i + 1]) for i in range(0, len(edges) - 1, 2)
            if edges[i + 1] > edges[i]]


def clip_to(grad, norm: float, max_norm: float) -> float:
    """Scale `grad` in place by max_norm / norm when its norm exceeds max_norm > 0;
    return the norm."""
    if max_norm > 0 and norm > max_norm:
        grad *= max_norm / (norm + 1e-6)
    return norm


def divided_lr(lr: float, stalenesses: list[int], rule: str) -> float:
    """The lr of an update of gradients this stale: `lr`, or with rule "divide" lr / the
    largest staleness (at least 1): Zhang et al. 2016, "Staleness-aware Async-SGD". The
    parameter servers' rule (pserver.server.store) and the simulated workers'
    (models.run.simulated)."""
    return lr / max(1, *stalenesses) if rule == "divide" else lr


class Schedule:
    """Linear warm-up to `lr`, then cosine decay to `min_lr_ratio * lr` at `total` steps.

        lr(t) = lr * (t + 1) / warmup                                  t < warmup
        lr(t) = lr_min + (lr - lr_min) (1 + cos(pi p)) / 2,  p = (t - warmup) / (total - warmup)
    """

    def __init__(self, cfg: OptimConfig, total_steps: int):
        self.cfg, self.total = cfg, total_steps

    def __call__(self, step: int) -> float:
        c = self.cfg
        if step < c.warmup:
            return c.lr * (step + 1) / c.warmup
        if c.schedule == "constant" or self.total <= c.warmup:
            return c.lr
        progress = min(1.0, (step - c.warmup) / (self.total - c.warmup))
        lr_min = c.lr * c.min_lr_ratio
        return lr_min + (c.lr - lr_min) * 0.5 * (1 + math.cos(math.pi * progress))
