"""Parameters and gradients that exist only while a unit needs them (ZeRO stages 2 and 3).

    P = UnitParams(specs, offsets, dtype, xp, cast)
    hooks = UnitHooks(P, layout, stream, traffic, stage=3, ...)
    body = Sequential([ZeroUnit(m, u, hooks) for each unit's module m, ...])

The layers read parameters as P[name] and accumulate gradients into P.grads[name]
(models/layers.py); `UnitParams` offers that interface of FlatParams over buffers that
the hooks put in place around each unit's forward and backward (`ZeroUnit` wraps the
unit's module and calls them), as FSDP's pre- and post-forward and -backward hooks do
(Zhao et al. 2023, section 3.2):

    stage 3  before forward   all-gather the unit's parameters (wait for the prefetch),
                              then prefetch the next unit's
             after forward    free them (--zero-reshard-after-forward, the default)
             before backward  all-gather them again (prefetched by the unit after it),
                              prefetch the previous unit's, a zeroed gradient buffer
             after backward   reduce-scatter the gradient (average over the ranks) into
                              this rank's shard, free parameters and gradient buffer
    stage 2  the parameters stay whole; the gradient is made and reduce-scattered per
             unit as in stage 3, so only the shard persists (Rajbhandari et al. 2020,
             section 5.2)

With --zero-quantize-weights / --zero-quantize-grads (ZeRO++, collective/zero/quantized.py)
stage 3's gathers move int8 payloads and the reduce-scatters block-quantized ones.

Every collective runs on the Stream's helper thread (collective/zero/stream.py) in the
order asked for, the same on every rank. Buffers come from a `SlotPool`: a freed unit's
memory is the next unit's, so the pool holds what is in use at once (two units'
parameters, prefetched and current, and two gradients, in compute and in reduction)
and the ring's persistent requests stay bound to the same memory step after step.
With k micro-batches every micro-batch's gradient is reduce-scattered and added into
the shard (the order of the sums then differs from plain data parallelism's, which
accumulates locally first).
"""

from __future__ import annotations

import threading
import time

import numpy as np

from dtlab.models.layers import Module


class UnitParams:
    """FlatParams' interface as the layers use it, over per-unit buffers (see above)."""

    deferred = None  # no zero-bubble weight-gradient queue (a pipeline runs ZeRO 2 as 1)
    master = None  # no router nudges (--moe-bias-rate is refused under ZeRO)

    def __init__(self, specs, offsets: dict[str, tuple[int, int]], dtype, xp, cast=None):
        self.specs, self.offsets, self.xp, self.cast = list(specs), offsets, xp, cast
        self.dtype = np.dtype(dtype)
        self.size = max((hi for _, hi in offsets.values()), default=0)
        self._shapes = {s.name: s.shape for s in self.specs}
        self.params: dict = {}  # name -> view of its unit's gathered (or whole) buffer
        self.grads: dict = {}  # name -> view of its unit's gradient buffer, during backward

    def __getitem__(self, name: str):
        try:
            return self.params[name]
        except KeyError:
            raise RuntimeError(f"parameter {name} is not gathered: read outside its unit's "
                               "forward or backward") from None

    def __contains__(self, name: str) -> bool:
        return name in self._shapes

    def show(self, table: dict, names, buf, lo: int) -> None:
        """Put views of `buf` (which starts at flat offset `lo`) for `names` into `table`."""
        for name in names:
            a, b = self.offsets[name]
            table[name] = buf[a - lo : b - lo].reshape(self._shapes[name])

    @staticmethod
    def hide(table: dict, names) -> None:
        for name in names:
            table.pop(name, None)

    def zero_grad(self) -> None:
        """Nothing to do: each unit's gradient buffer is zeroed when its backward starts."""

    def add_weight_grad(self, name: str, x, dy) -> None:
        self.grads[name] += x.T @ dy  # (d_in, d_out)

    def first_offset(self, names) -> int:
        return min(self.offsets[n][0] for n in names)


class SlotPool:
    """Buffers of `elems` elements handed out and given back (from either thread)."""

    def __init__(self, elems: int, dtype, xp):
        self.elems, self.dtype, self.xp = elems, np.dtype(dtype), xp
        self._free: list = []
        self._lock = threading.Lock()
        self.made = 0

    def take(self):
        with self._lock:
            if self._free:
                return self._free.pop()
            self.made += 1
        return self.xp.empty(self.elems, dtype=self.dtype)  # (largest unit,)

    def give(self, slot) -> None:
        with self._lock:
            self._free.append(slot)

    @property
    def nbytes(self) -> int:
        return self.made * self.elems * self.dtype.itemsize


class ZeroUnit(Module):
    """A unit's module with the hooks around its forward and backward."""

    def __init__(self, module: Module, unit: int, hooks: UnitHooks):
        self.module, self.unit, self.hooks, self.name = module, unit, hooks, module.name

    def specs(self):
        return self.module.specs()

    def forward(self, P, x):
        self.hooks.before_forward(self.unit)
        y, ctx = self.module.forward(P, x)
        self.hooks.after_forward(self.unit)
        return y, ctx

    def backward(self, P, ctx, dy):
        self.hooks.before_backward(self.unit)
        dx = self.module.backward(P, ctx, dy)
        self.hooks.after_backward(self.unit)
        return dx


class UnitHooks:
    """Stage 2 and 3's gathers, frees and reduce-scatters around each unit (see above).

    master[master_ranges[u]]: this rank's segment of unit u's parameters (the gather's
    source, cast to the compute dtype); grad[layout.packed[u]]: its reduced gradient
    (the shard, in the master's dtype); full: the whole parameters (stage 2). `count`
    is told the bytes each collective sends. `wire`: the dtype the reduce-scatters move
    (--wire; None: the compute dtype), each unit's gradient cast into a buffer of it.
    `quant` (collective/zero/quantized.py, ZeRO++): its quantized gathers (weight_bits)
    and reduce-scatters (grad_bits) run in place of the plain ones."""

    def __init__(self, P: UnitParams, layout, stream, traffic, *, stage: int, reshard: bool,
                 master, master_ranges, grad, full=None, count=lambda nbytes: None,
                 wire=None, quant=None):
        self.P, self.layout, self.stream, self.traffic = P, layout, stream, traffic
        self.stage, self.reshard, self.count = stage, reshard, count
        self.qw = quant if quant is not None and quant.weight_bits else None
        self.qg = quant if quant is not None and quant.grad_bits else None
        self.master, self.master_ranges, self.grad = master, master_ranges, grad
        self.grad_pool = SlotPool(layout.largest, P.dtype, P.xp)
        self.param_pool = SlotPool(layout.largest, P.dtype, P.xp) if stage == 3 else None
        self.wire_pool = SlotPool(layout.largest, wire, P.xp) if wire is not None else None
        self.gathered: dict[int, tuple] = {}  # unit -> (slot, unit's buffer, gather job)
        self.written: set[int] = set()  # units whose shard segment holds this step's sum
        self.waited = 0.0  # seconds this step's compute was blocked on a unit's all-gather
        self._current = None  # (slot, buffer) of the gradient the running backward makes
        if stage == 2:
            for unit in layout.units:
                P.show(P.params, unit.names, full, 0)

    @property
    def nbytes(self) -> int:
        """Bytes the pools hold: the largest units in use at once."""
        return sum(pool.nbytes for pool in (self.grad_pool, self.param_pool, self.wire_pool)
                   if pool is not None)

    def begin_step(self) -> None:
        self.written.clear()
        self.waited = 0.0

    def fetch(self, u: int) -> None:
        """Start all-gathering unit u's parameters (stage 3), unless under way or held."""
        if self.param_pool is None or not 0 <= u < len(self.layout.units) or \
                u in self.gathered:
            return
        slot = self.param_pool.take()
        buf = slot[: self.layout.units[u].size]  # (unit,)
        lo, hi = self.layout.relative(u)
        at, end = self.master_ranges[u]
        counts, master, qw = self.layout.counts(u), self.master, self.qw

        def gather(comm) -> None:
            if qw is not None:  # every segment dequantize(quantize(its master values))
                qw.gather(comm, u, master[at:end], buf)
                return
            buf[lo:hi] = master[at:end]  # this rank's segment, in the compute dtype
            comm.allgather(buf[lo:hi], out=buf, counts=counts)

        self.gathered[u] = (slot, buf, self.stream.submit(gather))
        self.count(qw.gather_bytes(u) if qw is not None else
                   self.traffic.allgather(self.layout.bounds[u], buf.itemsize))

    def _use(self, u: int) -> None:
        self.fetch(u)
        _, buf, job = self.gathered[u]
        start = time.perf_counter()
        job.wait()
        self.waited += time.perf_counter() - start
        self.P.show(self.P.params, self.layout.units[u].names, buf, self.layout.units[u].lo)

    def release(self, u: int) -> None:
        slot, _, job = self.gathered.pop(u)
        job.wait()
        self.P.hide(self.P.params, self.layout.units[u].names)
        self.param_pool.give(slot)

    def release_all(self) -> None:
        for u in list(self.gathered):
            self.release(u)

    def before_forward(self, u: int) -> None:
        if self.stage == 3:
            self._use(u)
            self.fetch(u + 1)

    def after_forward(self, u: int) -> None:
        if self.stage == 3 and self.reshard:
            self.release(u)

    def before_backward(self, u: int) -> None:
        if self.stage == 3:
            self._use(u)
            self.fetch(u - 1)
        unit = self.layout.units[u]
        slot = self.grad_pool.take()
        buf = slot[: unit.size]  # (unit,)
        buf.fill(0)
        self.P.show(self.P.grads, unit.names, buf, unit.lo)
        self._current = (slot, buf)

    def after_backward(self, u: int) -> None:
        unit = self.layout.units[u]
        self.P.hide(self.P.grads, unit.names)
        (slot, buf), self._current = self._current, None
        first = u not in self.written
        self.written.add(u)
        at, end = self.layout.packed[u]
        grad, pool, wires, xp = self.grad, self.grad_pool, self.wire_pool, self.P.xp
        qg = self.qg

        def reduce(comm) -> None:
            held = wires.take() if wires is not None else None
            wire = buf if held is None else held[: unit.size]  # (unit,)
            if held is not None:
                wire[...] = buf  # rounded to the wire dtype
            if qg is not None:  # re-quantized at every hop of the ring
                mine = qg.reduce_scatter(comm, u, wire)  # (segment,) the ranks' mean
            else:
                mine = comm.reduce_scatter(wire, average=True)  # (segment,) the ranks' mean
            if first:
                grad[at:end] = mine
            else:  # (a wire dtype's segment cast up first)
                xp.add(grad[at:end], mine.astype(grad.dtype, copy=False), out=grad[at:end])
            pool.give(slot)
            if held is not None:
                wires.give(held)

        self.stream.submit(reduce)
        itemsize = buf.itemsize if wires is None else wires.dtype.itemsize
        self.count(qg.reduce_scatter_bytes(u) if qg is not None else
                   self.traffic.reduce_scatter(self.layout.bounds[u], itemsize))
        if self.stage == 3:
            self.release(u)
