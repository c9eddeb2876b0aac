"""Sharded data parallelism: ZeRO stages 1-3 (Rajbhandari et al. 2020, "ZeRO: Memory
Optimizations Toward Training Trillion Parameter Models"; Zhao et al. 2023, "PyTorch FSDP")
over our ring reduce-scatter and all-gather.

    mpiexec -n 4 python -m dtlab.collective.train --model transformer --zero 1|2|3 \
        [--no-zero-reshard-after-forward] [--grad-accum 2] [--precision bf16] [--wire bf16]
    mpiexec -n 4 python -m dtlab.collective.train --dp 2 --tp 2 --zero 1|2|3
    mpiexec -n 4 python -m dtlab.collective.train --dp 2 --pp 2 --zero 1|2 --grad-accum 4

The flat buffer is cut into units (each body module holding parameters: an MLP layer,
the embedding, a transformer block, the final norm, the head) and each unit into one
segment per dp rank (collective/zero/layout.py); rank r's shard is its segments. It
holds the optimizer state of its shard only, and the master parameters of it (under
--precision fp16/bf16 a float32 copy; in full precision the parameters themselves):

    stage 1  parameters and gradients whole; as backward finishes a unit (the last
             micro-batch's), its gradient is reduce-scattered (averaged) on a helper
             thread; each rank steps its shard and all-gathers every unit's segments
    stage 2  the gradient made per unit and reduce-scattered into the shard during
             backward, so only the shard persists (collective/zero/params.py)
    stage 3  the parameters too: each unit all-gathered before its forward and its
             backward (the next one's prefetched), freed after use

With --tp and --pp the same runs within each (pp, tp) shard, over its dp communicator
(ProcessGrid.dp_comm), as Megatron-LM's distributed optimizer does (Narayanan et al. 2021,
"Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM"): the
shard's flat buffer cut into its units, their gradients reduce-scattered over dp, each
rank's slice stepped and all-gathered. A pipeline stage runs its schedule's micro-batches
into one whole gradient and reduce-scatters it after the last backward, so stage 2 there
runs as stage 1 (the gradient cannot be sliced before the step's last backward, ZB-H1's
deferred weight gradients included); stage 3 does not run pipelines. The clip norm is
the whole model's: the dp slices' squares, then the tensor-split ones' over tp (the
replicated tensors, equal on every tp rank, counted once, as models/optim.py does), then
over the stages. With --wire fp16|bf16 each unit's gradient is cast to that dtype for
its reduce-scatter and the rank's mean segment cast back, as plain DP's buckets are.
With --zero-quantize-weights int8 (stage 3) and --zero-quantize-grads int8|int4 (stages 2
and 3) the gathers and reduce-scatters move block-quantized payloads instead, as ZeRO++
does (collective/zero/quantized.py); the master shard stays in its own dtype.

Each rank's update is the plain optimizer's, elementwise on its segments (one optimizer
per unit segment), so the shards step exactly as the whole buffer would; what can differ
from plain data parallelism is only the order of sums: the ring adds a segment's
contributions starting from its owner's neighbour, so a segmentation other than the
all-reduce buckets' changes the order for N > 2 (N = 2: a + b = b + a), accumulation
over micro-batches happens after the reduction in stages 2 and 3, and the global norm
for clipping is the sum over ranks of the shards' squares. The trainer drives it through
its usual calls (collective/zero/trainer.py): `ZeroReplica` (compute_grads, finish_grads,
evaluate), `ShardedModel.clip_grad_norm`, `ZeroOptimizer.step`, `ZeroReducer` (wait,
average).
"""

from __future__ import annotations

import copy
import dataclasses
import math
import zlib

import numpy as np

from dtlab.collective.comm import Communicator
from dtlab.collective.reducers.buckets import WIRE_DTYPES
from dtlab.collective.zero.layout import Layout, RingTraffic, split_in_shard, units_of
from dtlab.collective.zero.params import UnitHooks, UnitParams, ZeroUnit
from dtlab.collective.zero.quantized import QuantizedUnits, ZeroQuantConfig
from dtlab.collective.zero.stream import Stream
from dtlab.models import backend
from dtlab.models.layers import Sequential
from dtlab.models.optim import clip_to, squares
from dtlab.models.params import FlatParams
from dtlab.models.precision import Cast, make_scaler, storage_dtype
from dtlab.models.tensor_parallel import SPLIT

STAGES = (1, 2, 3)


@dataclasses.dataclass
class ZeroParams:
    """What the trainer hands the optimizer under ZeRO (session.params): `data` holds this
    rank's master parameters, `grad` its reduced gradient; unit u's segment is
    data[data_ranges[u]] and grad[grad_ranges[u]] (views of whole buffers, or a shard)."""

    data: object
    data_ranges: list[tuple[int, int]]
    grad: object
    grad_ranges: list[tuple[int, int]]
    size: int  # elements of the whole (unsharded) model


class Zero:
    """One rank's sharded state, built from a session's model and initial parameters."""

    def __init__(self, session, comm: Communicator, stage: int, reshard: bool = True,
                 overlap: bool = True, wire: str = "fp32", quant: ZeroQuantConfig | None = None):
        if stage not in STAGES:
            raise ValueError(f"ZeRO stage must be one of {STAGES}, not {stage}")
        init, model, run = session.params, session.model, session.setup.run
        xp = init.xp
        self.comm, self.stage, self.reshard = comm, stage, reshard
        # the model-parallel groups a (pp, tp) shard's norm and overflow check span
        self.tp = model.tp if model.tp is not None and model.tp.size > 1 else None
        self.pp = model.pp if model.pp is not None and model.pp.size > 1 else None
        if stage == 3 and model.pp is not None:
            raise ValueError("ZeRO stage 3 does not run pipeline stages: a schedule runs a "
                             "unit's forward and backward for several micro-batches at once")
        # a pipeline stage accumulates the step's micro-batches in one whole gradient
        # before it reduces (Megatron's distributed optimizer): stage 2 runs stage 1's code
        self.runs_as = stage = 1 if stage == 2 and model.pp is not None else stage
        self.layout = layout = Layout(units_of(model.body.modules, init.offsets, init.size),
                                      comm.rank, comm.size)
        self.half = storage_dtype(run.precision, xp)
        compute = self.half or init.dtype
        self.wire = wire_dtype(wire, compute, comm, xp)  # None: reduced in the compute dtype
        self.stream = Stream(comm, overlap, persistent_buffers=4 * len(layout.units) + 4)
        self.traffic = RingTraffic(comm)
        self.quant = quant if quant is not None and quant.enabled else None
        if self.quant is not None and (stage < 3 and quant.weight_bits or stage < 2):
            raise ValueError(f"ZeRO stage {stage} (as run) quantizes no gathers or "
                             "reduce-scatters: quantized weights need stage 3, quantized "
                             "gradients stage 2 or 3 (collective/zero/quantized.py RULES)")
        self.precision = run.precision
        # the last step's figures (ZeroReplica.timing): bytes this rank sent, seconds of
        # the all-gathers after the optimizer step (stages 1, 2), bytes of the per-unit
        # buffer pools and seconds compute waited for a unit's all-gather (stages 2, 3)
        self.timing: dict = {"sent_bytes": 0, "allgather_s": 0.0, "working_bytes": 0,
                             "gather_wait_s": 0.0}
        mine, packed = layout.mine, layout.packed
        separate = self.half is not None or stage == 3  # a master shard of its own
        if separate:
            self.master = xp.empty(layout.shard_size, dtype=init.dtype)  # (shard,)
            for (lo, hi), (at, end) in zip(mine, packed, strict=True):
                self.master[at:end] = init.data[lo:hi]
        self.work = None  # stage 1: FlatParams backward writes into, whole
        self.full = None  # stages 1 and 2: the whole parameters in the compute dtype
        if stage == 1:
            self.work = init if self.half is None else FlatParams(init.specs, dtype=compute, xp=xp)
            if self.half is not None:
                self.work.data[...] = init.data
                self.work.cast = Cast(self.half)
            self.full, P = self.work.data, self.work
        else:
            if stage == 2:
                self.full = init.data if self.half is None else init.data.astype(compute)
            P = UnitParams(init.specs, init.offsets, compute, xp,
                           Cast(self.half) if self.half is not None else None)
        if not separate:
            self.master = self.full
        # stage 1 under --wire: the whole gradient's copy in the wire dtype, unit by unit
        self.shadow = xp.empty(init.size, dtype=self.wire) if stage == 1 and self.wire else None
        if stage == 1 and self.half is None:
            grad, grad_ranges = self.work.grad, mine
        else:
            grad, grad_ranges = xp.zeros(layout.shard_size, dtype=init.dtype), packed
        self.params = ZeroParams(self.master, packed if separate else mine, grad, grad_ranges,
                                 init.size)
        # this shard's gradient ranges of tensor-split parameters and of replicated ones
        self.split_ranges, self.rest_ranges = split_in_shard(mine, grad_ranges,
                                                             init.ranges(SPLIT))
        self.hooks = None
        if stage > 1:
            self.hooks = UnitHooks(P, layout, self.stream, self.traffic, stage=stage,
                                   reshard=reshard, master=self.master,
                                   master_ranges=self.params.data_ranges, grad=grad,
                                   full=self.full, count=self.count, wire=self.wire,
                                   quant=None if self.quant is None else
                                   QuantizedUnits(self.quant, layout, self.traffic, xp))
            model = hooked(model, layout, self.hooks)
        self.P, self.model = P, model
        self.scaler = make_scaler(run) if self.half is not None else None

    def count(self, nbytes: int) -> None:
        self.timing["sent_bytes"] += nbytes

    def begin_step(self) -> None:
        self.timing["sent_bytes"] = 0
        if self.hooks is not None:
            self.hooks.begin_step()

    def reduce_unit(self, u: int) -> None:
        """Stage 1: reduce-scatter unit u of the whole gradient in place (its segment here
        then holds the ranks' mean; under --wire reduced in the wire dtype, cast back)."""
        unit = self.layout.units[u]
        buf = self.work.grad[unit.lo:unit.hi]  # (unit,)
        wire = buf if self.shadow is None else self.shadow[unit.lo:unit.hi]  # (unit,)
        a, b = self.layout.relative(u)

        def reduce(comm) -> None:
            if wire is not buf:
                wire[...] = buf  # rounded to the wire dtype
            mine = comm.reduce_scatter(wire, average=True)  # (segment,)
            if wire is not buf:
                buf[a:b] = mine

        self.stream.submit(reduce)
        self.count(self.traffic.reduce_scatter(self.layout.bounds[u], wire.itemsize))

    def publish(self, u: int) -> None:
        """Stages 1 and 2, after unit u's segment stepped: the segment into the whole
        parameters (cast to the compute dtype) and the unit all-gathered."""
        unit, (lo, hi) = self.layout.units[u], self.layout.mine[u]
        if self.master is not self.full:
            at, end = self.params.data_ranges[u]
            self.full[lo:hi] = self.master[at:end]
        buf = self.full[unit.lo:unit.hi]  # (unit,)
        a, b = self.layout.relative(u)
        counts = self.layout.counts(u)
        self.stream.submit(lambda comm: comm.allgather(buf[a:b], out=buf, counts=counts))
        self.count(self.traffic.allgather(self.layout.bounds[u], buf.itemsize))

    def shard(self):
        """This rank's master parameters, its segments back to back (the packed layout)."""
        if self.master.size == self.layout.shard_size:  # a shard of its own (or dp 1)
            return self.master
        xp = backend.array_module(self.master)
        return xp.concatenate([self.master[lo:hi] for lo, hi in self.layout.mine])

    def load(self, shard) -> None:
        """Put `shard` (packed, as shard() gives it) in place as this rank's master
        parameters and, stages 1 and 2, all-gather every unit into the whole parameters
        (collective)."""
        xp = backend.array_module(self.master)
        for (a, b), (at, end) in zip(self.params.data_ranges, self.layout.packed, strict=True):
            self.master[a:b] = xp.asarray(shard[at:end])
        if self.runs_as < 3:
            for u in range(len(self.layout.units)):
                self.publish(u)
            self.stream.drain()
            self.stream.take_seconds()

    def clip(self, max_norm: float) -> float:
        """Clip the shards' gradient to the global norm of the whole model's gradient;
        return the norm before clipping. Squares summed over the dp ranks' shards, then
        (a tensor-split model) those of split tensors over the tp shards, replicated ones
        counted once (models/optim.py clip_grad_norm), then over the pipeline's stages:

            norm^2 = sum_pp ( sum_tp sum_dp |g_split|^2 + sum_dp |g_replicated|^2 )
        """
        P = self.params
        sq = np.array([squares(P.grad, self.split_ranges),
                       squares(P.grad, self.rest_ranges)])  # (2,) this shard's squares
        sq = self.comm.allreduce(sq, algo="mpi")  # over dp
        split = float(sq[0]) if self.tp is None else \
            float(self.tp.allreduce(np.array([sq[0]]), algo="mpi")[0])
        total = split + float(sq[1])
        if self.pp is not None:
            total = float(self.pp.allreduce(np.array([total]), algo="mpi")[0])
        return clip_to(P.grad, math.sqrt(total), max_norm)

    def agreed(self, ok: bool) -> bool:
        """`ok` on every rank of the dp, tp and pp groups (each checked its own shard)."""
        bad = np.array([0.0 if ok else 1.0])
        for comm in (self.comm, self.tp, self.pp):
            if comm is not None:
                bad = comm.allreduce(bad, algo="mpi")
        return float(bad[0]) == 0.0

    def unit_values(self, u: int):
        """Unit u's whole master parameters, on every rank (collective; after a step)."""
        xp = backend.array_module(self.master)
        a, b = self.layout.relative(u)
        at, end = self.params.data_ranges[u]
        out = xp.empty(self.layout.units[u].size, dtype=self.master.dtype)  # (unit,)
        out[a:b] = self.master[at:end]
        return self.comm.allgather(out[a:b], out=out, counts=self.layout.counts(u))

    def full_values(self):
        """The whole master parameters, on every rank (collective)."""
        xp = backend.array_module(self.master)
        return xp.concatenate([self.unit_values(u) for u in range(len(self.layout.units))])

    def checksum(self) -> int:
        """CRC32 of the whole parameters' bytes (FlatParams.checksum's), one unit gathered at
        a time (collective): every rank's is the same."""
        crc = 0
        for u in range(len(self.layout.units)):
            crc = zlib.crc32(backend.to_host(self.unit_values(u)).tobytes(), crc)
        return crc

    def close(self) -> None:
        self.stream.close()


def wire_dtype(wire: str, compute, comm: Communicator, xp):
    """--wire as the dtype the gradient reduce-scatters move (None: the compute dtype's
    own), as collective/reducers/buckets.py's BucketReducer casts its buckets."""
    dtype = WIRE_DTYPES[wire]
    if dtype is None or np.dtype(dtype) == np.dtype(compute) or comm.size == 1:
        return None
    if xp is not np and wire == "bf16":
        raise ValueError("--wire bf16 needs NumPy arrays: CuPy has no bfloat16")
    return np.dtype(dtype)


def hooked(model, layout: Layout, hooks: UnitHooks):
    """A shallow copy of `model` whose body runs each unit's module through the hooks."""
    unit_of = {unit.module: u for u, unit in enumerate(layout.units)}
    out = copy.copy(model)
    out.body = Sequential([ZeroUnit(m, unit_of[i], hooks) if i in unit_of else m
                           for i, m in enumerate(model.body.modules)])
    return out
