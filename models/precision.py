"""Mixed-precision training: half-precision activations and gradients, float32 master
weights, dynamic loss scaling (Micikevicius et al. 2018, "Mixed Precision Training").

    --precision fp32   everything in --dtype (the default)
    --precision fp16   IEEE half: 10 mantissa bits, largest finite 65504, so the loss
                       is scaled (S) to keep small gradients above half's underflow
    --precision bf16   bfloat16: 7 mantissa bits, float32's exponent range, no scaling

One step of a `MixedReplica`:

    work.data  = half(master.data)                         one cast per step
    loss, ctx  = forward(work, batch)                      activations stored in half
    backward with dlogits * S                              gradients produced in half
    (the sync trainer all-reduces work.grad here)
    master.grad = float32(work.grad) / S                   unscaled in float32
    finite?  yes: clip, optimizer on master (float32 state); S grows x `growth` after
                  `window` finite steps in a row
             no:  the step is skipped, S shrinks x `backoff`   (section 3.3 of the paper)

`Cast` is the compute-dtype policy, the one place the dtypes are chosen.
Every `Sequential` (models/layers.py) runs each of its modules through it
when the parameters it is handed carry one (`FlatParams.cast`): the module's
input is upcast to float32, the module computes in float32 (matmuls with
float32 accumulation, as tensor cores do; softmax, norms, the loss's
reductions), and its output and the arrays of its context are rounded to
the half dtype, which is what is kept between modules and for backward.
Backward mirrors it: context and output gradient upcast, the module's
backward in float32, its input gradient rounded to half; weight gradients
are rounded to half as they are accumulated into the half gradient buffer.
NumPy has no BLAS for float16 and ml_dtypes' bfloat16 matmul is not one
either, so on the CPU this emulation is also the fast path. CuPy runs the
same policy (float32 compute on upcast values: its native half GEMMs are not
used); it has no bfloat16, so bf16 is refused on the GPU.

A context that is a list holds the contexts of a Sequential's modules,
already cast by that Sequential: the policy leaves lists alone, so a
nest of Sequentials casts each leaf module's context once. Dicts (an MoE
layer's routing record) are kept as computed, in float32.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial

import ml_dtypes
import numpy as np

from dtlab.models.backend import array_module
from dtlab.models.config import ConfigError
from dtlab.models.model import Replica
from dtlab.models.params import FlatParams

# --precision -> the storage dtype of activations and gradients (None: the parameters')
PRECISIONS = {"fp32": None, "fp16": np.dtype(np.float16), "bf16": np.dtype(ml_dtypes.bfloat16)}
# unit roundoff 2^-(mantissa bits + 1): the relative error of one rounding
UNIT_ROUNDOFF = {"fp16": 2.0**-11, "bf16": 2.0**-8}
MIN_SCALE = 2.0**-24  # still overflowing below this scale: the gradients are not finite at all


def storage_dtype(precision: str, xp=np) -> np.dtype | None:
    """The half dtype `precision` stores activations and gradients in; None for fp32.
    ConfigError naming the flag for an unknown name or a dtype the array module lacks."""
    if precision not in PRECISIONS:
        raise ConfigError(f"--precision {precision!r}: choose from {', '.join(PRECISIONS)}")
    dtype = PRECISIONS[precision]
    if precision == "bf16" and xp is not np:
        raise ConfigError("--precision bf16 needs NumPy arrays (DTLAB_DEVICE=cpu): CuPy has no "
                          "bfloat16 dtype")
    return dtype


class Cast:
    """Half storage, float32 compute, at the boundary of every module a Sequential runs."""

    compute = np.dtype(np.float32)

    def __init__(self, storage):
        self.storage = np.dtype(storage)

    def up(self, a):
        """`a` in float32 if it is stored in half; anything else as it is."""
        return a.astype(self.compute) if getattr(a, "dtype", None) == self.storage else a

    def down(self, a):
        """A float32 array rounded to the half dtype; anything else as it is."""
        return a.astype(self.storage) if getattr(a, "dtype", None) == self.compute else a

    def forward(self, module, P: FlatParams, x):
        x32 = self.up(x)
        y, ctx = module.forward(P, x32)
        return self.down(y), self._stored(ctx, x32, x)

    def backward(self, module, P: FlatParams, ctx, dy):
        return self.down(module.backward(P, self._loaded(ctx), self.up(dy)))

    def _stored(self, ctx, x32, x):
        """The context with float32 arrays rounded to half; the upcast input is the half
        input it came from (no second copy; a container hands its modules float32)."""
        if ctx is x32:
            return self.down(x)
        if isinstance(ctx, tuple):
            items = [self._stored(c, x32, x) for c in ctx]
            return type(ctx)(*items) if hasattr(ctx, "_fields") else tuple(items)
        return self.down(ctx)

    def _loaded(self, ctx):
        if isinstance(ctx, tuple):
            items = [self._loaded(c) for c in ctx]
            return type(ctx)(*items) if hasattr(ctx, "_fields") else tuple(items)
        return self.up(ctx)


@dataclass
class LossScaler:
    """Dynamic loss scaling (Micikevicius et al. 2018, section 3.3): the loss is
    multiplied by `scale` before backward so that small gradients survive half's
    underflow, the gradients divided by it after. A step whose gradients hold an inf or
    NaN is skipped and the scale multiplied by `backoff`; after `window` finite steps in a
    row it is multiplied by `growth`. `dynamic=False` keeps the scale fixed (bf16: 1)."""

    scale: float = 2.0**16
    growth: float = 2.0
    backoff: float = 0.5
    window: int = 2000
    dynamic: bool = True
    good_steps: int = 0  # finite steps since the scale last changed
    skipped: int = 0  # steps skipped in all

    def update(self, finite: bool) -> None:
        """Account for one step whose gradients were (not) all finite."""
        if not finite:
            self.skipped += 1
            self.good_steps = 0
            if self.dynamic:
                if self.scale * self.backoff < MIN_SCALE:
                    raise FloatingPointError(
                        f"the gradients overflow at loss scale {self.scale:g}: they are not "
                        "finite whatever the scale (lower --lr, or --precision bf16)")
                self.scale *= self.backoff
            return
        self.good_steps += 1
        if self.dynamic and self.good_steps >= self.window:
            self.scale *= self.growth
            self.good_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped": self.skipped}

    def load_state_dict(self, state: dict) -> None:
        self.scale = float(state["scale"])
        self.good_steps, self.skipped = int(state["good_steps"]), int(state["skipped"])


def make_scaler(run) -> LossScaler:
    """The loss scaler a RunConfig asks for: dynamic from --loss-scale for fp16, fixed at
    1 for bf16 (float32's range needs none)."""
    if run.precision == "fp16":
        return LossScaler(scale=run.loss_scale, growth=run.loss_scale_growth,
                          backoff=run.loss_scale_backoff, window=run.loss_scale_window)
    return LossScaler(scale=1.0, dynamic=False)


def finite(a) -> bool:
    """Whether every element of `a` is finite (NumPy or CuPy)."""
    return bool(array_module(a).isfinite(a).all())


class MixedReplica(Replica):
    """A Replica (models/model.py) whose forward and backward run on a half copy of its
    float32 master parameters (`work`), under `scaler`'s loss scale.

    `params` are the master weights and the float32 gradient the optimizer reads;
    `work.grad` (half) is what backward writes and what a data-parallel reducer averages
    (`compute_params`); `finish_grads` unscales it into `params.grad`. `runner(work)`
    makes the Replica that runs the steps on the half copy (default the plain one; a
    pipeline stage's PipelineReplica runs its schedule there)."""

    def __init__(self, model, params: FlatParams, precision: str, scaler: LossScaler,
                 runner=None):
        if params.dtype != np.float32:
            raise ConfigError(f"--precision {precision} keeps float32 master weights: "
                              f"--dtype {params.dtype} does not go with it")
        storage = storage_dtype(precision, params.xp)
        super().__init__(model, params)
        self.precision, self.scaler = precision, scaler
        self.work = FlatParams(params.specs, dtype=storage, xp=params.xp)
        self.work.cast, self.work.master = Cast(storage), params
        self.compute_params = self.work
        self.inner = (runner or partial(Replica, model))(self.work)
        self._scale_used = scaler.scale

    def _refresh(self) -> None:
        """The half copy of the master weights, made once per step."""
        self.work.data[...] = self.params.data

    def compute_grads(self, micro_batches: Sequence, grad_ready=None) -> float:
        """The inner replica's compute_grads on the half copy, each micro-batch's loss
        scaled by scale / k; work.grad then holds the scaled mean gradient in half."""
        self._refresh()
        self._scale_used = self.scaler.scale
        with np.errstate(over="ignore", invalid="ignore"):  # an overflow is finish_grads' to see
            loss = self.inner.compute_grads(micro_batches, grad_ready, scale=self._scale_used)
        self.timing, self.spans = self.inner.timing, self.inner.spans
        return loss

    def finish_grads(self) -> tuple[bool, dict]:
        """params.grad = float32(work.grad) / scale; whether it is finite (then the
        optimizer may step), the scaler updated, and the step's record fields. Runs after
        any all-reduce, so every data-parallel rank sees the same gradient and decides
        the same."""
        g = self.params.grad
        g[...] = self.work.grad
        g *= 1.0 / self._scale_used
        ok = self._agreed(finite(g))
        self.scaler.update(ok)
        return ok, {"loss_scale": self._scale_used, "skipped": not ok,
                    "skipped_steps": self.scaler.skipped}

    def _agreed(self, ok: bool) -> bool:
        """`ok` on every rank of the model-parallel groups (tp, ep, pp), which hold
        different gradients: a step is skipped where any one overflowed. (Data-parallel replicas
        need no agreement: they check the same all-reduced gradient.)"""
        for comm in (self.model.tp, self.model.ep, self.model.pp):
            if comm is not None and comm.size > 1:
                xp = self.params.xp
                bad = comm.allreduce(xp.asarray([0.0 if ok else 1.0]))  # ranks that overflowed
                ok = float(bad[0]) == 0.0
        return ok

    def evaluate(self, batches: Sequence) -> float:
        """The mean loss over `batches` at this precision (forward only)."""
        self._refresh()
        return self.inner.evaluate(batches)

    def summary_line(self) -> str:
        """What the scaler did, for the trainer's summary."""
        if not self.scaler.dynamic:
            return f"{self.precision}: {self.scaler.skipped} step(s) skipped (non-finite gradients)"
        return (f"{self.precision}: {self.scaler.skipped} step(s) skipped on overflow, loss scale "
                f"now {self.scaler.scale:g}")
