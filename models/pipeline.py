"""Pipeline (inter-layer) model parallelism: one stage's layers and its schedule's executor.

    stage = PipelineStage(model, bounds, pp)          # modules [bounds[s], bounds[s+1])
    replica = PipelineReplica(stage, params, "1f1b")  # drives like any Replica
    loss = replica.compute_grads(micro_batches)       # the whole pipeline's mean loss

Every rank of the pipeline communicator `pp` holds one stage: a contiguous
run of the dense model's body modules (models/partition.py chooses them), its
parameters only, initialised to the dense model's values (parameters are
seeded by name). All stages read the same micro-batches: the first uses the
inputs, the last the targets and the loss.

The executor runs this stage's list from models/schedule.py as given:

    F i    receive x (stage 0: the inputs), forward, keep the context,
           isend y to the next stage (the last stage: loss and dlogits)
    B i    receive dy from the next stage (the last stage: dlogits), backward
           with weight gradients deferred (FlatParams.deferring), isend dx
    W i    run micro-batch i's deferred weight gradients
    BW i   B and W in one pass; dx is sent after both

Sends are non-blocking (MPI_Isend) and waited for only at the end of the
step, so a stage never blocks on a neighbour that is itself sending; receives
block, and the time they block is the stage's idle time. An activation is
sent as a small int64 header (its shape) and then its data, because a stage
cannot know its input's shape; a gradient has the shape of the output this
stage sent, so it needs none. Tags follow the micro-batch, so every message
matches its pass even where a schedule runs stages in different orders.

Measured bubble (idle fraction) of a step: after a barrier over `pp`, each
stage counts its compute time and its idle time, the time it blocked in
receives and in completing its sends; the step's makespan is the slowest
stage's elapsed time, a stage that ends earlier idles for the rest, and

    bubble   = mean over stages of (blocked + makespan - elapsed) / makespan
    overhead = mean over stages of (elapsed - compute - blocked) / makespan

The bubble is what models/schedule.py's formulas predict for uniform stages;
the overhead is the executor's own time (posting sends, the shape headers,
bookkeeping), reported beside it rather than counted as idle. The
step also counts the bytes it sent and the peak bytes its in-flight
micro-batches held (contexts, then the inputs of deferred weight gradients;
models/memory.py's measure).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np

from dtlab.models.comm import Comm
from dtlab.models.layers import Sequential
from dtlab.models.memory import context_bytes
from dtlab.models.model import Model, Replica
from dtlab.models.params import FlatParams
from dtlab.models.schedule import make, validate

MAX_NDIM = 7
HEADER, ACTIVATION, GRADIENT = 0, 1, 2
MAX_MICRO_BATCHES = 10_000  # 3 tags each, below the collectives' tags (collective/link.py)


class PipelineStage(Model):
    """Body modules [bounds[s], bounds[s + 1]) of `model` on stage s = pp.rank."""

    def __init__(self, model: Model, bounds: Sequence[int], pp: Comm):
        if len(bounds) != pp.size + 1:
            raise ValueError(f"{len(bounds) - 1} stage bounds for a pipeline of {pp.size}")
        s = pp.rank
        body = Sequential(model.body.modules[bounds[s]:bounds[s + 1]])
        super().__init__(model.config, body, model.loss, model.tp)
        self.name, self.pp, self.ep, self.bounds = model.name, pp, model.ep, list(bounds)
        self.first, self.last = s == 0, s == pp.size - 1

    def clip_grad_norm(self, P: FlatParams, max_norm: float) -> float:
        """Clip to the norm of the whole model's gradient: every stage's squares
        (each over its tensor-parallel shards or expert-parallel ranks) summed over
        the pipeline."""
        norm = super().clip_grad_norm(P, 0.0)  # this stage's part, nothing clipped
        total = self.pp.allreduce(np.array([norm * norm]))  # (1,) sum of squares
        norm = float(np.sqrt(total[0]))
        if max_norm > 0 and norm > max_norm:
            P.grad *= max_norm / (norm + 1e-6)
        return norm


class PipelineReplica(Replica):
    """A Replica whose step runs schedule `schedule` across the pipeline."""

    def __init__(self, stage: PipelineStage, params: FlatParams, schedule: str):
        super().__init__(stage, params)
        self.stage, self.schedule = stage, schedule
        self._ops: dict[tuple[str, int], list] = {}  # (schedule, m) -> this stage's ops

    def ops(self, m: int) -> list:
        """This stage's op list for m micro-batches: made and validated once per
        (schedule, m), not every step."""
        key = (self.schedule, m)
        if key not in self._ops:
            every = make(self.schedule, self.stage.pp.size, m)
            validate(every, m)
            self._ops[key] = every[self.stage.pp.rank]
        return self._ops[key]

    def compute_grads(self, micro_batches: Sequence, grad_ready=None,
                      scale: float = 1.0) -> float:
        """Zero the gradients, run this stage's list over the micro-batches; return
        the mean loss over them (computed by the last stage, broadcast to all).

        Each micro-batch's loss is scaled by scale/m, as in Replica.compute_grads (scale:
        a mixed-precision loss scale, models/precision.py).
        `grad_ready` is not called: gradients are final only at the end of the
        schedule, and the data-parallel reducer then covers the whole buffer.
        """
        st, P, pp = self.stage, self.params, self.stage.pp
        m = len(micro_batches)
        if m > MAX_MICRO_BATCHES:
            raise ValueError(f"{m} micro-batches: at most {MAX_MICRO_BATCHES} per step")
        ops = self.ops(m)
        P.zero_grad()
        run = _Step(st, P, micro_batches, scale=scale)
        pp.barrier()
        t0 = time.perf_counter()
        self.spans = []
        for op in ops:
            start = time.perf_counter()
            getattr(run, op.kind)(op.micro)
            self.spans.append((f"{op.kind}{op.micro}", start, time.perf_counter()))
        run.finish()
        elapsed = time.perf_counter() - t0
        loss = pp.broadcast(np.array([run.loss_sum]), root=pp.size - 1)  # the last stage's
        every = pp.allgather(np.array([[run.compute_s, run.wait_s, elapsed]]))  # (p, 3)
        compute, blocked, spent = every.T  # (p,) each
        makespan = float(spent.max())
        self.timing = {"bubble": float((blocked + makespan - spent).mean()) / makespan,
                       "pipe_overhead": float((spent - compute - blocked).mean()) / makespan,
                       "pipe_compute_s": run.compute_s, "pipe_wait_s": run.wait_s,
                       "pipe_makespan_s": makespan, "pipe_bytes_sent": run.bytes_sent,
                       "pipe_peak_activation_bytes": run.peak_held}
        return float(loss[0]) / m

    def evaluate(self, batches: Sequence) -> float:
        """The mean loss over `batches`: forwards only, through every stage in turn."""
        pp = self.stage.pp
        run = _Step(self.stage, self.params, batches, forward_only=True)
        for i in range(len(batches)):
            run.F(i)
        run.finish()
        loss = pp.broadcast(np.array([run.loss_sum]), root=pp.size - 1)  # the last stage's
        return float(loss[0]) / len(batches)


class _Step:
    """One step's passes on one stage: a method per op kind (F, B, W, BW)."""

    def __init__(self, stage: PipelineStage, P: FlatParams, micro_batches: Sequence,
                 forward_only: bool = False, scale: float = 1.0):
        self.st, self.P, self.batches, self.forward_only = stage, P, micro_batches, forward_only
        self.scale = scale / len(micro_batches)
        self.ctx: dict[int, object] = {}  # micro -> forward context (+ dlogits on the last)
        self.out_shape: dict[int, tuple] = {}
        self.weights: dict[int, list] = {}  # micro -> deferred weight gradients
        self.sends: list = []
        self.loss_sum = self.compute_s = self.wait_s = 0.0
        self.bytes_sent = 0
        self.held: dict[int, int] = {}  # micro -> bytes its context (then its W queue) holds
        self.peak_held = 0

    def F(self, i: int) -> None:
        st = self.st
        st.set_mode(self.scale, training=not self.forward_only)
        inputs, targets = st.prepare(self.batches[i], self.P)
        x = inputs if st.first else self._recv_activation(i)
        t = time.perf_counter()
        y, ctx = st.body.forward(self.P, x)
        if st.last:
            loss, dlogits = st.score(self.P, y, targets, self.scale)
            self.loss_sum += loss
            ctx = (ctx, dlogits)
        else:
            ctx = (ctx, None)
            self.out_shape[i] = y.shape
        self.compute_s += time.perf_counter() - t
        if not self.forward_only:
            self.ctx[i] = ctx
            self._hold(i, ctx)
        if not st.last:
            self._send_activation(y, i)

    def B(self, i: int) -> None:
        with self.P.deferring() as queue:
            self._backward(i)
        self.weights[i] = queue
        self._hold(i, queue)

    def W(self, i: int) -> None:
        t = time.perf_counter()
        self.P.run_weight_grads(self.weights.pop(i))
        self.compute_s += time.perf_counter() - t
        del self.held[i]

    def BW(self, i: int) -> None:
        self._backward(i)
        del self.held[i]

    def _hold(self, i: int, arrays) -> None:
        """Count what micro-batch i keeps alive now (its context, or its queued weight
        gradients' inputs) and the step's peak of the sum."""
        self.held[i] = context_bytes(arrays)
        self.peak_held = max(self.peak_held, sum(self.held.values()))

    def _backward(self, i: int) -> None:
        st, P = self.st, self.P
        ctx, dlogits = self.ctx.pop(i)
        dy = dlogits if st.last else self._recv(self.out_shape.pop(i), i, GRADIENT)
        t = time.perf_counter()
        dx = st.body.backward(P, ctx, dy)
        self.compute_s += time.perf_counter() - t
        if not st.first:
            self.sends.append(st.pp.isend(dx, st.pp.rank - 1, _tag(i, GRADIENT)))
            self.bytes_sent += dx.nbytes

    def _send_activation(self, y, i: int) -> None:
        pp = self.st.pp
        header = np.zeros(MAX_NDIM + 1, dtype=np.int64)
        header[0] = y.ndim
        header[1:1 + y.ndim] = y.shape
        self.sends.append(pp.isend(header, pp.rank + 1, _tag(i, HEADER)))
        self.sends.append(pp.isend(y, pp.rank + 1, _tag(i, ACTIVATION)))
        self.bytes_sent += header.nbytes + y.nbytes

    def _recv_activation(self, i: int):
        header = np.empty(MAX_NDIM + 1, dtype=np.int64)
        self._wait(lambda: self.st.pp.recv(header, self.st.pp.rank - 1, _tag(i, HEADER)))
        return self._recv(tuple(int(n) for n in header[1:1 + header[0]]), i, ACTIVATION)

    def _recv(self, shape: tuple, i: int, kind: int):
        pp = self.st.pp
        source = pp.rank - 1 if kind == ACTIVATION else pp.rank + 1
        buf = self.P.xp.empty(shape, dtype=self.P.dtype)
        self._wait(lambda: pp.recv(buf, source, _tag(i, kind)))
        return buf

    def _wait(self, receive) -> None:
        t = time.perf_counter()
        receive()
        self.wait_s += time.perf_counter() - t

    def finish(self) -> None:
        """Complete every send (their buffers may then go)."""
        t = time.perf_counter()
        for req in self.sends:
            req.wait()
        self.sends.clear()
        self.wait_s += time.perf_counter() - t
        if self.ctx or self.weights:
            raise RuntimeError(f"passes left over: forward contexts {sorted(self.ctx)}, "
                               f"weight gradients {sorted(self.weights)}")


def _tag(micro: int, kind: int) -> int:
    return 3 * micro + kind

