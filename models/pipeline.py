"""Pipeline (inter-layer) model parallelism: one rank's layers and its schedule's executor.

    stage = PipelineStage(model, bounds, pp)          # modules [bounds[s], bounds[s+1])
    replica = PipelineReplica(stage, params, "1f1b")  # drives like any Replica
    loss = replica.compute_grads(micro_batches)       # the whole pipeline's mean loss

The dense model's body modules are cut into S = v p contiguous stages
(models/partition.py chooses them); every rank of the pipeline communicator
`pp` holds v of them, its model chunks, where the schedule's layout puts them
(models/schedule.py: one stage per rank for GPipe, 1F1B and ZB-H1; chunk c of
rank r is stage c p + r for interleaved 1F1B, stage r and 2p - 1 - r in a V).
A rank holds its chunks' parameters only, initialised to the dense model's
values (parameters are seeded by name). All ranks read the same
micro-batches: stage 0 uses the inputs, stage S - 1 the targets and the loss.

The executor runs this rank's list from models/schedule.py as given; for an op
on chunk c, holding stage g:

    F i    receive x from stage g - 1 (stage 0: the inputs), forward, keep the
           context, isend y to stage g + 1 (the last stage: loss and dlogits)
    B i    receive dy from stage g + 1 (the last stage: dlogits), backward
           with weight gradients deferred (FlatParams.deferring), isend dx
    W i    run micro-batch i's deferred weight gradients
    BW i   B and W in one pass; dx is sent after both

A neighbouring stage on the same rank (the bottom of a V, or p = 1) is handed
the array itself, as the dense model's next module would be. Sends are
non-blocking (MPI_Isend) and waited for only at the end of the step, so a
stage never blocks on a neighbour that is itself sending; receives block, and
the time they block is the rank's idle time. An activation is sent as a small
int64 header (its shape) and then its data, because a stage cannot know its
input's shape; a gradient has the shape of the output this stage sent, so it
needs none. The header goes only with the first micro-batch of a step of each
input shape: every stage reads the same micro-batches and runs its forwards in
the same order (models/schedule.py's `validate`), so sender and receiver agree
which micro-batches carry one, and an equal input shape gives an equal output
shape (checked by the sender). Tags follow the (micro-batch, receiving stage),
so every message matches its pass even where a schedule runs stages in
different orders.

Measured bubble (idle fraction) of a step: after a barrier over `pp`, each
rank counts its compute time and its idle time, the time it blocked in
receives and in completing its sends; the step's makespan is the slowest
rank's elapsed time, a rank that ends earlier idles for the rest, and

    bubble   = mean over ranks of (blocked + makespan - elapsed) / makespan
    overhead = mean over ranks of (elapsed - compute - blocked) / makespan

The bubble is what models/schedule.py's formulas predict for uniform stages;
the overhead is the executor's own time (posting sends, the shape headers,
bookkeeping, counting held bytes), reported beside it rather than counted as
idle, with its part in posting sends (`pipe_send_s`) and the number of messages
sent. Compute is timed per chunk and pass (`pass_times`: F with the loss, B, W;
a BW counted as B), what a replay with measured times needs. The step also
counts the bytes it sent and the peak bytes its in-flight micro-batches held
(contexts, then the inputs of deferred weight gradients;
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
from dtlab.models.schedule import LAYOUTS, make, validate, virtual_stage

MAX_NDIM = 7
HEADER, ACTIVATION, GRADIENT = 0, 1, 2
MAX_MESSAGES = 10_000  # (micro-batch, stage) pairs, 3 tags each, below the collectives'
#                        tags (collective/transport/link.py)


class PipelineStage(Model):
    """The chunks of `model` that rank pp.rank holds: of the S = len(bounds) - 1 stages
    (stage g: body modules [bounds[g], bounds[g + 1])), the S / p that `layout` puts
    on it, in chunk order."""

    def __init__(self, model: Model, bounds: Sequence[int], pp: Comm, layout: str = "loop"):
        S, p = len(bounds) - 1, pp.size
        if S % p or layout not in LAYOUTS or (layout == "v" and S != 2 * p):
            raise ValueError(f"{S} stage bounds for a pipeline of {p} ranks in a "
                             f"{layout!r} layout")
        v = S // p
        self.stages = [virtual_stage(layout, p, pp.rank, c) for c in range(v)]  # per chunk
        self.owner = {virtual_stage(layout, p, r, c): r for r in range(p) for c in range(v)}
        mods = model.body.modules
        self.chunks = [Sequential(mods[bounds[g]:bounds[g + 1]]) for g in self.stages]
        body = Sequential([m for chunk in self.chunks for m in chunk.modules])
        super().__init__(model.config, body, model.loss, model.tp)
        self.name, self.pp, self.ep, self.bounds = model.name, pp, model.ep, list(bounds)
        self.layout, self.n_stages = layout, S

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
        self._ops: dict[tuple[str, int], list] = {}  # (schedule, m) -> this rank's ops
        self.pass_times: list[dict[str, float]] = []  # the last step's, per chunk and pass
        # (chunk, "F" / "B", input shape) -> bytes a context / weight queue holds, where the
        # shapes fix it (no MoE layer, whose routing does not)
        self._held_bytes: dict[tuple, int] | None = None if stage.moe else {}

    def ops(self, m: int) -> list:
        """This rank's op list for m micro-batches: made and validated once per
        (schedule, m), not every step."""
        key = (self.schedule, m)
        if key not in self._ops:
            st = self.stage
            every = make(self.schedule, st.pp.size, m, v=len(st.chunks))
            validate(every, m, st.layout)
            self._ops[key] = every[st.pp.rank]
        return self._ops[key]

    def compute_grads(self, micro_batches: Sequence, grad_ready=None,
                      scale: float = 1.0, ops: list | None = None, before=None) -> float:
        """Zero the gradients, run this rank's list over the micro-batches; return
        the mean loss over them (computed by the last stage, broadcast to all).

        Each micro-batch's loss is scaled by scale/m, as in Replica.compute_grads (scale:
        a mixed-precision loss scale, models/precision.py).
        `grad_ready` is not called: gradients are final only at the end of the
        schedule, and the data-parallel reducer then covers the whole buffer.
        `ops` (validated by the caller) replaces the schedule's list and `before(passes,
        op)` is called before each op (passes: the step's `_Step`, whose `P` it may
        set): what runs several steps as one list needs (models/pipedream.py: the
        updates and weight versions of PipeDream-2BW; their time counts as the
        executor's overhead, neither compute nor idle).
        """
        st, P, pp = self.stage, self.params, self.stage.pp
        m = len(micro_batches)
        if m * st.n_stages > MAX_MESSAGES:
            raise ValueError(f"{m} micro-batches through {st.n_stages} stages: at most "
                             f"{MAX_MESSAGES} (micro-batch, stage) pairs per step")
        ops = self.ops(m) if ops is None else ops
        P.zero_grad()
        run = _Step(st, P, micro_batches, scale=scale, held_bytes=self._held_bytes)
        pp.barrier()
        t0 = time.perf_counter()
        self.spans = []
        for op in ops:
            if before is not None:
                before(run, op)
            start = time.perf_counter()
            getattr(run, op.kind)(op.micro, op.chunk)
            self.spans.append((f"{op.kind}{op.micro}" + (f".{op.chunk}" if op.chunk else ""),
                               start, time.perf_counter()))
        run.finish()
        elapsed = time.perf_counter() - t0
        loss = pp.broadcast(np.array([run.loss_sum]), root=st.owner[st.n_stages - 1])
        self.pass_times = run.pass_s
        every = pp.allgather(np.array([[run.compute_s, run.wait_s, elapsed]]))  # (p, 3)
        compute, blocked, spent = every.T  # (p,) each
        makespan = float(spent.max())
        self.timing = {"bubble": float((blocked + makespan - spent).mean()) / makespan,
                       "pipe_overhead": float((spent - compute - blocked).mean()) / makespan,
                       "pipe_compute_s": run.compute_s, "pipe_wait_s": run.wait_s,
                       "pipe_send_s": run.send_s, "pipe_messages": run.messages,
                       "pipe_makespan_s": makespan, "pipe_bytes_sent": run.bytes_sent,
                       "pipe_peak_activation_bytes": run.peak_held}
        return float(loss[0]) / m

    def evaluate(self, batches: Sequence) -> float:
        """The mean loss over `batches`: forwards only, through every stage in turn
        (each micro-batch through this rank's chunks in stage order)."""
        st = self.stage
        run = _Step(st, self.params, batches, forward_only=True)
        by_stage = sorted(range(len(st.chunks)), key=st.stages.__getitem__)
        for i in range(len(batches)):
            for c in by_stage:
                run.F(i, c)
        run.finish()
        loss = st.pp.broadcast(np.array([run.loss_sum]), root=st.owner[st.n_stages - 1])
        return float(loss[0]) / len(batches)


class _Step:
    """One step's passes on one rank: a method per op kind (F, B, W, BW), each on one
    micro-batch i and one of the rank's chunks c."""

    def __init__(self, stage: PipelineStage, P: FlatParams, micro_batches: Sequence,
                 forward_only: bool = False, scale: float = 1.0,
                 held_bytes: dict | None = None):
        self.st, self.P, self.batches, self.forward_only = stage, P, micro_batches, forward_only
        self.held_bytes = held_bytes  # shared across steps (PipelineReplica._held_bytes)
        self.in_shape: dict[tuple, tuple] = {}  # (micro, chunk) -> its input's shape
        self.scale = scale / len(micro_batches)
        self.ctx: dict[tuple, object] = {}  # (micro, chunk) -> context (+ dlogits on the last)
        self.out_shape: dict[tuple, tuple] = {}
        self.weights: dict[tuple, list] = {}  # (micro, chunk) -> deferred weight gradients
        self.local: dict[int, object] = {}  # tag -> an array handed to a stage of this rank
        # receiving stage -> {a micro-batch's input shape: the activation's shape}: the
        # shapes sent (to a stage of another rank) or received this step
        self.known: dict[int, dict[tuple, tuple]] = {}
        self.sends: list = []
        self.pass_s = [dict.fromkeys("FBW", 0.0) for _ in stage.chunks]  # per chunk
        self.loss_sum = self.wait_s = self.send_s = 0.0
        self.bytes_sent = self.messages = 0
        self.held: dict[tuple, int] = {}  # (micro, chunk) -> bytes its context / W queue holds
        self.peak_held = 0

    def F(self, i: int, c: int = 0) -> None:
        st = self.st
        g = st.stages[c]
        st.set_mode(self.scale, training=not self.forward_only)
        inputs, targets = st.prepare(self.batches[i], self.P)
        x = inputs if g == 0 else self._recv_activation(i, g)
        t = time.perf_counter()
        y, ctx = st.chunks[c].forward(self.P, x)
        last = g == st.n_stages - 1
        if last:
            loss, dlogits = st.score(self.P, y, targets, self.scale)
            self.loss_sum += loss
            ctx = (ctx, dlogits)
        else:
            ctx = (ctx, None)
            self.out_shape[i, c] = y.shape
        self.pass_s[c]["F"] += time.perf_counter() - t
        if not last:  # first: the next stage may be waiting for it
            self._send_activation(y, i, g + 1)
        if not self.forward_only:
            self.ctx[i, c], self.in_shape[i, c] = ctx, x.shape
            self._hold((i, c), "F", ctx)

    def B(self, i: int, c: int = 0) -> None:
        with self.P.deferring() as queue:
            self._backward(i, c)
        self.weights[i, c] = queue
        self._hold((i, c), "B", queue)

    def W(self, i: int, c: int = 0) -> None:
        t = time.perf_counter()
        self.P.run_weight_grads(self.weights.pop((i, c)))
        self.pass_s[c]["W"] += time.perf_counter() - t
        del self.held[i, c], self.in_shape[i, c]

    def BW(self, i: int, c: int = 0) -> None:
        self._backward(i, c)
        del self.held[i, c], self.in_shape[i, c]

    @property
    def compute_s(self) -> float:
        return sum(sum(t.values()) for t in self.pass_s)

    def _hold(self, key: tuple, kind: str, arrays) -> None:
        """Count what a micro-batch's chunk keeps alive now (its context after F, its
        queued weight gradients' inputs after B) and the step's peak of the sum. The
        count walks every array of the context (models/memory.py); where the input's
        shape fixes it, it is walked once per shape and remembered."""
        if self.held_bytes is None:
            self.held[key] = context_bytes(arrays)
        else:
            shape = (key[1], kind, self.in_shape[key])
            if shape not in self.held_bytes:
                self.held_bytes[shape] = context_bytes(arrays)
            self.held[key] = self.held_bytes[shape]
        self.peak_held = max(self.peak_held, sum(self.held.values()))

    def _backward(self, i: int, c: int) -> None:
        st, P = self.st, self.P
        g = st.stages[c]
        ctx, dlogits = self.ctx.pop((i, c))
        dy = dlogits if g == st.n_stages - 1 else \
            self._recv(self.out_shape.pop((i, c)), i, g, g + 1, GRADIENT)
        t = time.perf_counter()
        dx = st.chunks[c].backward(P, ctx, dy)
        self.pass_s[c]["B"] += time.perf_counter() - t  # BW: its weight gradients too
        if g > 0:
            self._send(dx, i, g - 1, GRADIENT)

    def _send(self, x, i: int, to_stage: int, kind: int) -> None:
        """Hand x to stage `to_stage`: the array itself on this rank, else an isend."""
        st = self.st
        tag = _tag(i, to_stage, st.n_stages, kind)
        dest = st.owner[to_stage]
        if dest == st.pp.rank:
            self.local[tag] = x
            return
        t = time.perf_counter()
        self.sends.append(st.pp.isend(x, dest, tag))
        self.send_s += time.perf_counter() - t
        self.bytes_sent += x.nbytes
        self.messages += 1

    def _send_activation(self, y, i: int, to_stage: int) -> None:
        """Send y to stage `to_stage`, preceded by its shape unless an earlier micro-batch
        of this step with the same input shape told the receiver already."""
        if self.st.owner[to_stage] != self.st.pp.rank:
            known = self.known.setdefault(to_stage, {})
            batch = np.shape(self.batches[i][0])
            if batch not in known:
                known[batch] = y.shape
                header = np.zeros(MAX_NDIM + 1, dtype=np.int64)
                header[0] = y.ndim
                header[1:1 + y.ndim] = y.shape
                self._send(header, i, to_stage, HEADER)
            elif known[batch] != y.shape:
                raise RuntimeError(f"stage {to_stage - 1}: micro-batch {i}'s output has shape "
                                   f"{y.shape}, an earlier one of input shape {batch} "
                                   f"{known[batch]}")
        self._send(y, i, to_stage, ACTIVATION)

    def _recv_activation(self, i: int, g: int):
        """Stage g's input of micro-batch i: its shape from the header, or from the
        earlier micro-batch of the same input shape (as the sender decides)."""
        st = self.st
        local = self.local.pop(_tag(i, g, st.n_stages, ACTIVATION), None)
        if local is not None:
            return local
        known = self.known.setdefault(g, {})
        batch = np.shape(self.batches[i][0])
        if batch not in known:
            header = np.empty(MAX_NDIM + 1, dtype=np.int64)
            self._wait(lambda: st.pp.recv(header, st.owner[g - 1],
                                          _tag(i, g, st.n_stages, HEADER)))
            known[batch] = tuple(int(n) for n in header[1:1 + header[0]])
        return self._recv(known[batch], i, g, g - 1, ACTIVATION)

    def _recv(self, shape: tuple, i: int, g: int, from_stage: int, kind: int):
        """Stage g's message `kind` of micro-batch i from stage `from_stage`."""
        st = self.st
        tag = _tag(i, g, st.n_stages, kind)
        if tag in self.local:
            return self.local.pop(tag)
        buf = self.P.xp.empty(shape, dtype=self.P.dtype)
        self._wait(lambda: st.pp.recv(buf, st.owner[from_stage], tag))
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
        if self.ctx or self.weights or self.local:
            raise RuntimeError(f"passes left over: forward contexts {sorted(self.ctx)}, "
                               f"weight gradients {sorted(self.weights)}, "
                               f"local messages {sorted(self.local)}")


def _tag(micro: int, stage: int, n_stages: int, kind: int) -> int:
    """The tag of message `kind` of micro-batch `micro` to stage `stage`."""
    return 3 * (micro * n_stages + stage) + kind

