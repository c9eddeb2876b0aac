"""Flat parameter and gradient buffers with named views.

Every model replica (or one rank's shard of it) keeps all its parameters in
one contiguous buffer and its gradients in a second buffer of the same
layout:

    data: [ embed.W | pos.W | h0.ln1.g | h0.ln1.b | h0.attn.qkv.W | ... ]
    grad: [   same offsets, same shapes, zeroed before each step       ]

so that a gradient can be all-reduced in buckets, a parameter server can own
a byte range of it, and a checkpoint can write it in one piece.

Initial values depend only on (run seed, parameter name, element index in the
full tensor): a tensor-split shard or a pipeline stage initialises exactly
the slice of its dense twin, whatever the topology.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from dtlab.models import backend
from dtlab.models.backend import array_module


@dataclass(frozen=True)
class ParamSpec:
    """One named tensor of a model.

    shape: the tensor this process holds.
    init: "normal" (mean 0, `std`), "zeros" or "ones".
    decay: whether weight decay applies (matrices yes; biases, gains no).
    full_shape, index: for a shard of a larger logical tensor, the logical
        shape and the index (a tuple of slices) this shard takes from it, so
        the shard starts from the dense tensor's values.
    view: the shape the logical tensor is viewed as before `index` applies,
        when the shard is not one slice of it (a fused qkv shard is the q, k
        and v columns of its heads: full (d, 3d), view (d, 3, heads, d_head),
        index [:, :, h0:h1, :]); the indexed part is reshaped to `shape`.
    split: the grid dimension the logical tensor is split over ("tp"), or ""
        for a tensor every rank of that dimension holds whole (replicated).
    """

    name: str
    shape: tuple[int, ...]
    init: str = "normal"
    std: float = 0.02
    decay: bool = True
    full_shape: tuple[int, ...] | None = None
    index: tuple[slice, ...] | None = None
    view: tuple[int, ...] | None = None
    split: str = ""

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def full_size(self) -> int:
        """Elements of the logical (dense) tensor."""
        return int(np.prod(self.full_shape or self.shape, dtype=np.int64))


def initial_value(spec: ParamSpec, seed: int) -> np.ndarray:
    """The seeded initial value of `spec` as a float64 host array."""
    shape = spec.full_shape or spec.shape
    if spec.init == "zeros":
        full = np.zeros(shape)
    elif spec.init == "ones":
        full = np.ones(shape)
    elif spec.init == "normal":
        rng = np.random.default_rng([seed, zlib.crc32(spec.name.encode())])
        full = rng.standard_normal(shape) * spec.std
    else:
        raise ValueError(f"parameter {spec.name}: unknown init {spec.init!r}")
    if spec.index is None:
        value = full
    elif spec.view is None:
        value = full[spec.index]
    else:
        part = full.reshape(spec.view)[spec.index]
        if part.size != spec.size:
            raise ValueError(f"parameter {spec.name}: index of view {spec.view} gives "
                             f"{part.shape}, {part.size} elements, spec says {spec.shape}")
        value = part.reshape(spec.shape)
    if value.shape != tuple(spec.shape):
        raise ValueError(
            f"parameter {spec.name}: index gives shape {value.shape}, spec says {spec.shape}"
        )
    return value


class FlatParams:
    """Parameters and gradients of one model (or shard) in two flat buffers.

    params[name] / grads[name] are views into `data` / `grad`; writing to a
    view writes the buffer. Backward passes accumulate (+=) into grads.

    Weight gradients of matmuls go through `add_weight_grad`, so that a
    zero-bubble pipeline schedule (Qi et al. 2024) can split a backward pass
    in two: inside `deferring()` they are queued (the B pass: input gradients
    only) and `run_weight_grads` computes them later (the W pass). A weight
    gradient still zero since `zero_grad` takes the product written in place
    (`matmul(..., out=)`, as autograd's first gradient is stored, not added):
    no (d_in, d_out) temporary and no add pass; later ones (further
    micro-batches) go through one scratch buffer. 0 + a == a, so the values
    are those of `+=`; only add_weight_grad may write a weight's gradient.
    """

    deferred: list | None = None  # the queue while deferring, else None
    cast = None  # a half-precision working copy's compute-dtype policy (models/precision.py)
    master = None  # that copy's float32 master parameters (state nudged outside backprop)

    def __init__(
        self,
        specs: Iterable[ParamSpec],
        seed: int = 0,
        dtype=np.float32,
        xp=None,
    ):
        self.specs: list[ParamSpec] = list(specs)
        self.dtype = np.dtype(dtype)
        self.xp = xp or backend.xp()
        names = [s.name for s in self.specs]
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"duplicate parameter names: {dup}")

        self.offsets: dict[str, tuple[int, int]] = {}
        start = 0
        for spec in self.specs:
            self.offsets[spec.name] = (start, start + spec.size)
            start += spec.size
        self.size = start

        host = np.empty(self.size, dtype=self.dtype)
        for spec in self.specs:
            lo, hi = self.offsets[spec.name]
            host[lo:hi] = initial_value(spec, seed).ravel()
        self.data = self.xp.asarray(host)
        self.grad = self.xp.zeros(self.size, dtype=self.dtype)
        self.params = self._views(self.data)
        self.grads = self._views(self.grad)
        # names whose gradient is zero since zero_grad: one set, changed in place, so that
        # shallow copies sharing the gradient buffer (PipeDream's second weights) share it
        self._zero = set(self.offsets)
        self._scratch = None  # add_weight_grad's product when it must be added

    def _views(self, buf) -> dict:
        return {
            s.name: buf[self.offsets[s.name][0] : self.offsets[s.name][1]].reshape(s.shape)
            for s in self.specs
        }

    def __getitem__(self, name: str):
        return self.params[name]

    def __contains__(self, name: str) -> bool:
        return name in self.params

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    @property
    def dense_size(self) -> int:
        """Elements of the dense model these parameters are (a shard of)."""
        return sum(s.full_size for s in self.specs)

    def ranges(self, *splits: str) -> list[tuple[int, int]]:
        """(lo, hi) buffer ranges of the parameters whose split label is one of `splits`
        ("tp", "ep", "ep+tp": the grid dimensions a tensor is split over)."""
        return [self.offsets[s.name] for s in self.specs if s.split in splits]

    def nudge(self, name: str, step) -> None:
        """Add `step` to parameter `name` outside backprop (state such as an MoE router's
        selection bias). On a half-precision working copy the float32 master's value takes
        it, so that steps far below half's resolution still add up, and is copied down."""
        target = (self if self.master is None else self.master)[name]  # a view of the buffer
        target += step.astype(target.dtype)
        if self.master is not None:
            self[name][...] = self.master[name]

    def zero_grad(self) -> None:
        self.grad.fill(0)
        self._zero.update(self.offsets)

    def decay_mask(self):
        """1.0 where weight decay applies, 0.0 elsewhere, in the buffer layout."""
        mask = np.zeros(self.size, dtype=self.dtype)
        for spec in self.specs:
            if spec.decay:
                lo, hi = self.offsets[spec.name]
                mask[lo:hi] = 1
        return self.xp.asarray(mask)

    def load(self, values) -> None:
        """Overwrite all parameters from a flat array of the same size."""
        if values.shape != (self.size,):
            raise ValueError(f"expected a flat array of {self.size} values, got {values.shape}")
        self.data[...] = self.xp.asarray(values, dtype=self.dtype)

    def checksum(self) -> int:
        """CRC32 of the parameter bytes, to check that replicas agree."""
        return zlib.crc32(backend.to_host(self.data).tobytes())

    def add_weight_grad(self, name: str, x, dy) -> None:
        """grads[name] += x^T dy, x (N, d_in), dy (N, d_out): now, or queued while
        deferring. Queued arrays must not be written until the queue runs."""
        if self.deferred is None:
            self._weight_grad(name, x, dy)
        else:
            self.deferred.append((name, x, dy))

    def _weight_grad(self, name: str, x, dy) -> None:
        """grads[name] += x^T dy: written in place while it is zero, else added from the
        scratch buffer (the same values as `+= x.T @ dy`, without its temporary)."""
        g = self.grads[name]  # (d_in, d_out)
        xp = array_module(g)
        if xp.result_type(x, dy) != g.dtype:  # a cast on the way in: the plain form
            g += x.T @ dy
        elif name in self._zero:
            xp.matmul(x.T, dy, out=g)
        else:
            if self._scratch is None or self._scratch.size < g.size:
                self._scratch = xp.empty(g.size, dtype=g.dtype)
            product = xp.matmul(x.T, dy, out=self._scratch[: g.size].reshape(g.shape))
            g += product
        self._zero.discard(name)

    @contextmanager
    def deferring(self) -> Iterator[list]:
        """Queue every add_weight_grad made inside the block; yields the queue."""
        if self.deferred is not None:
            raise RuntimeError("weight gradients are already being deferred")
        self.deferred = queue = []
        try:
            yield queue
        finally:
            self.deferred = None

    def run_weight_grads(self, queue: list) -> None:
        """The W pass: the queued weight gradients, in the order they were made."""
        for name, x, dy in queue:
            self._weight_grad(name, x, dy)
        queue.clear()

    def first_offset(self, names: Sequence[str]) -> int:
        """The lowest buffer offset among `names` (for bucket readiness)."""
        return min(self.offsets[n][0] for n in names)
