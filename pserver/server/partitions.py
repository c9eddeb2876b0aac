"""Model-parallel worker groups on a shard server: one store per partition, calls routed.

A worker may be a group of tp x pp ranks holding one model replica between
them (Shoeybi et al. 2019's tensor split, Huang et al. 2019's pipeline
stages): one worker id for the whole group, each rank pulling and pushing
only its own partition, its stage's tensor-split shard (models.params
FlatParams). Partition k = pp_rank * tp + tp_rank; the servers' parameter
vector is the concatenation of the partitions in k order, and shard s of S
holds the balanced slice

    [s * n_k // S, (s + 1) * n_k // S)        of every partition k (n_k elements)

so every rank of a group talks to every shard, and every shard's work grows
with the whole model, not with one stage.

The servers learn the partitions at Register (RegisterRequest.partition:
id, group size, the rank's ParamSpecs as JSON). The first registration of
partition k makes its store here: the specs are checked against the dense
model this server was started with (every name one of its tensors, the
same logical shape, init and decay), the values built exactly as the rank
builds its own buffer (FlatParams(specs, seed): each tensor seeded by
(seed, name) through models.params.initial_value, then its index / view
applied), sliced to this shard's range, with the same optimizer and decay
mask. A later registration of k must bring the same specs, and every group
the same size, else FAILED_PRECONDITION naming the partition.

Each partition's slice lives in its own ShardStore with its own servicer,
so every rule of a worker's push and pull holds per partition unchanged:
dedup by (worker, step) within the partition, staleness under the store's
lock, ASP/SSP apply, the BSP round. Worker ids are groups: partition k's
store counts one worker per group (the group's rank k), so SSP clocks and
BSP rounds count groups, not ranks, and --num-workers is the number of
groups. A partition's update depends only on that partition's gradients
(the optimizer is elementwise), so under BSP the per-partition rounds give
exactly the update of one round over the concatenated vector: a group is
in partition k's round once its rank k has pushed, and the group's step is
applied everywhere once all its ranks have. Under ASP and SSP each
partition orders the groups' pushes by arrival on its own.

A server holds either the dense model (workers of one process) or
partitions, never both: a group is refused once a dense worker registered
or the dense state moved (a resumed checkpoint), and a dense worker once a
partition is known. Checkpoints (SaveCheckpoint, SIGTERM, periodic) of a
server holding partitions write each partition's store into its own
directory (pserver.server.checkpoint: shard-<i>-of-<S>/partition-<k>-of-<K>/), its
specs in the meta; `--resume` makes every saved partition again from its
specs and loads its state, before any group registers.

Calls are routed by the partition they name (PullRequest, PushHeader,
ShmRequest, DeregisterRequest, StatsRequest: field `partition`); a call
without one goes to the dense store. A Session is routed by its first
message; its later messages stay with that partition's servicer.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable, Iterator

import grpc
import numpy as np

from dtlab.models.params import FlatParams, ParamSpec
from dtlab.models.run.checkpoint import CheckpointError
from dtlab.protos import dtlab_ps_pb2 as pb
from dtlab.pserver.common import codec as wire
from dtlab.pserver.common.errors import FailedPrecondition, InvalidArgument, PSError, Unavailable
from dtlab.pserver.common.partition_specs import specs_from_json
from dtlab.pserver.server import checkpoint
from dtlab.pserver.server.servicer import ParameterServerServicer
from dtlab.pserver.server.store import ShardLayout, ShardStore

log = logging.getLogger(__name__)


def check_against_dense(specs: list[ParamSpec], dense: list[ParamSpec]) -> None:
    """Every partition tensor is a tensor of the dense model (same logical shape, init,
    std and decay); ValueError naming the first that is not."""
    by_name = {s.name: s for s in dense}
    for s in specs:
        d = by_name.get(s.name)
        if d is None:
            raise ValueError(f"{s.name} is not a tensor of the server's model")
        logical = tuple(s.full_shape or s.shape)
        if logical != tuple(d.shape):
            raise ValueError(f"{s.name}: logical shape {logical}, the server's model has "
                             f"{tuple(d.shape)}")
        if (s.init, s.std, s.decay) != (d.init, d.std, d.decay):
            raise ValueError(f"{s.name}: init {s.init}/{s.std} decay {s.decay}, the server's "
                             f"model has {d.init}/{d.std} decay {d.decay}")


def partition_of(kind: str, value) -> int | None:
    """The partition a session's (or push's) first message names, None for none."""
    if kind in ("pull", "shm_pull", "header", "shm_request"):
        m = value
    elif kind in ("push_whole", "shm_push"):
        m = value.header
    else:
        return None
    return m.partition if m.HasField("partition") else None


# -- the router ----------------------------------------------------------------------------

class Known:
    """A partition this server has learnt: its specs' text and its servicer."""

    def __init__(self, layout: pb.PartitionLayout, servicer: ParameterServerServicer):
        self.specs, self.count, self.servicer = layout.specs, layout.count, servicer


class Partitions:
    """The methods of dtlab.ps.v1.ParameterServer routed to the dense servicer or to a
    partition's. `make(flat)`: a servicer over a new store holding this shard's
    slice of `flat` (the partition's initial values); `dense_specs()`: the specs of the
    model the server was started with."""

    def __init__(self, dense: ParameterServerServicer,
                 make: Callable[[FlatParams], ParameterServerServicer],
                 dense_specs: Callable[[], list[ParamSpec]], seed: int, dtype: str):
        self.dense, self._make, self._dense_specs = dense, make, dense_specs
        self.seed, self.dtype = seed, dtype
        self.known: dict[int, Known] = {}
        self._lock = threading.Lock()
        self._closed = False

    @property
    def held(self) -> bool:
        """Whether any partition is known (then checkpoints hold the partitions)."""
        return bool(self.known)

    @property
    def busy(self) -> int:
        return self.dense.busy + sum(k.servicer.busy for k in list(self.known.values()))

    def close(self) -> None:
        """Shutting down: every partition's store closes, and no new one is made."""
        with self._lock:
            self._closed = True
            for k in self.known.values():
                k.servicer.store.close()

    def _abort(self, context, err: PSError):
        self.dense.store.reject(err.reason)
        context.abort(grpc.StatusCode[err.status], str(err))

    def _servicer(self, partition: int | None) -> ParameterServerServicer:
        if partition is None:
            return self.dense
        known = self.known.get(partition)
        if known is None:
            raise FailedPrecondition(
                f"partition {partition} is not registered with shard "
                f"{self.dense.store.layout.shard}; call Register first", reason="worker")
        return known.servicer

    # -- Register --------------------------------------------------------------------------

    def Register(self, raw: bytes, context) -> pb.RegisterReply:
        try:
            req = wire.parse(pb.RegisterRequest, memoryview(raw))
            with self._lock:
                target = self._learn(req) if req.HasField("partition") else self._dense_only()
                return target.Register(raw, context)
        except PSError as e:
            self._abort(context, e)

    def _dense_only(self) -> ParameterServerServicer:
        if self.known:
            raise FailedPrecondition(
                f"this server holds the {len(self.known)} partitions of model-parallel worker "
                "groups (dtlab-worker --tp/--pp): a dense worker cannot join them; start the "
                "servers afresh for a dense run", reason="partition")
        return self.dense

    def _learn(self, req: pb.RegisterRequest) -> ParameterServerServicer:
        p, store = req.partition, self.dense.store
        if self._closed:
            raise Unavailable("server is shutting down", reason="shutdown")
        if not req.HasField("worker_id"):
            raise InvalidArgument("a worker group's rank registers with its group's id "
                                  "(worker_id)", reason="worker")
        if p.count < 1 or p.id >= p.count:
            raise InvalidArgument(f"partition.id {p.id} of partition.count {p.count}: the id "
                                  "must be below the count", reason="partition")
        if store.clocks.workers or store.version:
            raise FailedPrecondition(
                f"this server trains the dense model (version {store.version}, "
                f"{len(store.clocks.workers)} dense workers): worker group {req.worker_id} "
                "cannot join with partitions; start the servers afresh", reason="partition")
        sizes = {k.count for k in self.known.values()}
        if sizes and p.count not in sizes:
            raise FailedPrecondition(
                f"worker group {req.worker_id} has {p.count} partitions (tp x pp); the "
                f"servers hold groups of {sizes.pop()}: give every group the same --tp and "
                "--pp", reason="partition")
        known = self.known.get(p.id)
        if known is not None:
            if known.specs != p.specs:
                raise FailedPrecondition(
                    f"partition {p.id} of worker group {req.worker_id} differs from the "
                    f"partition {p.id} the servers hold: {layout_difference(known.specs, p.specs)}"
                    ". Give every group the same model flags, --tp, --pp and --stages",
                    reason="partition")
            return known.servicer
        return self._add(p, f"partition {p.id} of worker group {req.worker_id}",
                         (req.model_size, req.layout_crc32))

    def _add(self, p: pb.PartitionLayout, who: str,
             size_crc: tuple[int, int] | None = None) -> ParameterServerServicer:
        """Partition p's store and servicer here, from its specs (checked against the dense
        model, and against the (model_size, layout crc) its rank sent, if given)."""
        try:
            specs = specs_from_json(p.specs)
            check_against_dense(specs, self._dense_specs())
            flat = FlatParams(specs, seed=self.seed, dtype=self.dtype, xp=np)
        except (ValueError, KeyError, TypeError) as e:
            raise InvalidArgument(f"{who}: specs: {e}", reason="partition") from None
        if size_crc is not None and (flat.size, wire.layout_crc(specs)) != size_crc:
            raise InvalidArgument(
                f"partition {p.id}: model_size {size_crc[0]} / layout {size_crc[1]:#010x} "
                f"do not match its specs ({flat.size} / {wire.layout_crc(specs):#010x})",
                reason="partition")
        if self.dense.store.layout.num_shards > flat.size:
            raise InvalidArgument(f"partition {p.id} has {flat.size} parameters, fewer than "
                                  f"the {self.dense.store.layout.num_shards} shards",
                                  reason="partition")
        servicer = self._make(flat)
        self.known[p.id] = Known(p, servicer)
        lay = servicer.store.layout
        log.info("partition %d of %d: %d parameters, elements [%d, %d) here", p.id, p.count,
                 flat.size, lay.offset, lay.offset + lay.length)
        return servicer

    # -- checkpoints -----------------------------------------------------------------------

    def save(self, write: Callable[[ShardStore, dict], str]) -> list[str]:
        """Every partition's state written by write(store, {"id", "count", "specs"}) (the
        partition's checkpoint directory: pserver.server.checkpoint); the paths, by id."""
        with self._lock:
            known = sorted(self.known.items())
        return [write(k.servicer.store, {"id": pid, "count": k.count, "specs": k.specs})
                for pid, k in known]

    def restore(self, path: str, optimizer: str) -> ShardStore:
        """The partition saved at `path` made here again, in its saved state (a resumed
        server holds the partitions its groups had; they register as before)."""
        made = []

        def layout_of(saved: dict) -> ShardLayout:
            p = pb.PartitionLayout(id=saved["id"], count=saved["count"], specs=saved["specs"])
            try:
                made.append(self._add(p, f"{path}: partition {p.id}"))
            except PSError as e:
                raise CheckpointError(str(e)) from None
            return made[0].store.layout

        _, state = checkpoint.load_partition(path, optimizer, layout_of)
        made[0].store.load_state(state)
        return made[0].store

    # -- the other unary calls -------------------------------------------------------------

    def Deregister(self, raw: bytes, context) -> pb.DeregisterReply:
        return self._unary(pb.DeregisterRequest, "Deregister", raw, context)

    def Stats(self, raw: bytes, context) -> pb.StatsReply:
        return self._unary(pb.StatsRequest, "Stats", raw, context)

    def _unary(self, cls, name: str, raw: bytes, context):
        try:
            req = wire.parse(cls, memoryview(raw))
            target = self._servicer(req.partition if req.HasField("partition") else None)
        except PSError as e:
            self._abort(context, e)
        return getattr(target, name)(raw, context)

    def SaveCheckpoint(self, raw: bytes, context) -> pb.CheckpointReply:
        return self.dense.SaveCheckpoint(raw, context)  # the daemon's save: every partition

    # -- streams ---------------------------------------------------------------------------

    def Pull(self, raw: bytes, context) -> Iterator[bytes]:
        try:
            req = wire.parse(pb.PullRequest, memoryview(raw))
            target = self._servicer(req.partition if req.HasField("partition") else None)
        except PSError as e:
            self._abort(context, e)
        yield from target.Pull(raw, context)

    def Push(self, requests: Iterator[bytes], context) -> pb.PushReply:
        requests = iter(requests)
        first = next(requests, None)
        if first is None:
            return self.dense.Push(iter(()), context)
        try:
            kind, value = self.dense.codec.read(pb.PushRequest, first)
            target = self._servicer(partition_of(kind, value))
        except PSError as e:
            self._abort(context, e)
        return target.Push(itertools.chain((first,), requests), context)

    def Session(self, requests: Iterator[bytes], context) -> Iterator[bytes]:
        requests = iter(requests)
        first = next(requests, None)
        if first is None:
            return
        try:
            kind, value = self.dense.codec.read(pb.SessionRequest, first)
            target = self._servicer(partition_of(kind, value))
        except PSError as e:
            self._abort(context, e)
        yield from target.Session(itertools.chain((first,), requests), context)


def layout_difference(held: str, given: str) -> str:
    """The first tensor whose spec differs between two PartitionLayout.specs texts."""
    try:
        a, b = specs_from_json(held), specs_from_json(given)
    except ValueError as e:
        return f"its specs are malformed ({e})"
    for x, y in zip(a, b, strict=False):
        if x != y:
            return (f"tensor {y.name} has shape {tuple(y.shape)}"
                    + (f" of {tuple(y.full_shape)}" if y.full_shape else "")
                    + f" where the servers' {x.name} has {tuple(x.shape)}"
                    + (f" of {tuple(x.full_shape)}" if x.full_shape else ""))
    return f"{len(b)} tensors where the servers' partition has {len(a)}"
