"""Client for S parameter-server shards: parallel pull and push, deadlines, retries.

    client = PSClient(ClientConfig(servers="127.0.0.1:50051,127.0.0.1:50052"))
    client.connect(0, "mlp", params.size, wire.layout_crc(params.specs))  # health wait + Register
    client.connect(None, ...)            # shard 0 assigns the id (client.worker)
    client.pull(params.data)             # every shard in parallel, into the flat buffer
    replies = client.push(params.grad, step)

Shards may be listed in any order; Register tells each one's index and
element range, and `connect` checks that they tile [0, n) exactly. Without
a worker id, `connect` registers with shard 0 first, which assigns one (a
fresh id: see pserver.server.store), then registers that id with the other shards,
so the worker has one id everywhere. Every call carries the process's
registration number, drawn at random once per process (the clients of one
process are one worker to the servers): a second process registering the
same id is refused while this one is live, and this one's calls are refused
once another has taken the id over. A connect that fails part-way
deregisters from the shards it registered with. Pulls
land straight in the caller's flat parameter buffer (no intermediate copy);
a shard whose version has not moved answers "not modified" and sends
nothing. Every call has a deadline; only UNAVAILABLE is retried, with
exponential backoff (a push is safe to retry: the server applies each
(worker, step) once; Li et al. 2014 make the same choice in ps-lite).

Pulls and pushes travel on one long-lived Session stream per shard
(pserver.worker.session; `transport="calls"`: a Pull or Push call each, as before
sessions). `push_pull` pushes and then pulls in one session operation (the
pull rides on the push: one round trip per shard for both; on calls, a Push
and then a Pull); a retry repeats both, the push being applied once. With
one shard the calls run on the caller's thread, not the pool's. A shard on
this host agrees on a shared-memory segment for the tensor bytes unless
`shm=False` (pserver.common.shm): the pushed gradient is copied into the segment
and the pulled values out of it, each with its Adler-32 in the same pass,
and gRPC carries the rest. With `wire_dtype` "fp16" or "bf16" (--wire) a
float32 model's gradients are pushed rounded to that dtype and its
parameters pulled as it (the server rounds them; it keeps float32 and
converts pushed gradients on receipt): half the bytes, over gRPC only (no
shared memory); `pushed_bytes` and `pulled_bytes` count the values' bytes.
With `compress` (--compress, pserver.worker.compressed_push) each push is the
gradient compressed once with error feedback and cut into the shards' parts
(indices and values, or packed signs and a scale), over gRPC only;
`pushed_bytes` counts the parts' bytes as they travel.

A shard kept by a primary and a backup (`--replicas 2`) is listed as
PRIMARY|BACKUP: pserver.worker.failover sends its calls to the primary and, when
that one is gone, to the backup that took over.
"""

from __future__ import annotations

import json
import logging
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import grpc
import numpy as np

from dtlab.protos import dtlab_ps_pb2 as pb
from dtlab.pserver.common import codec as wire
from dtlab.pserver.common import ranges as ranges_lib
from dtlab.pserver.common.compressed import Part
from dtlab.pserver.common.config import ClientConfig
from dtlab.pserver.common.errors import InvalidArgument
from dtlab.pserver.common.ranges import Ranges
from dtlab.pserver.worker.compressed_push import CompressedPush
from dtlab.pserver.worker.failover import SEPARATOR, ReplicatedShard
from dtlab.pserver.worker.session import Watchdog
from dtlab.pserver.worker.shard_client import PROCESS_REGISTRATION, WIRE_DTYPES, ShardClient

log = logging.getLogger(__name__)


class PSClient:
    """All shards of one model: connect, pull and push to every shard in parallel.

    transport: "session" (one stream per shard) or "calls" (a call per pull and push);
    shm: use shared memory with shards on this host; codec: wire.HAND, or
    wire.CODECS["generated"] (the benchmark's baseline); registration: the number this
    client registers with (default: the process's, PROCESS_REGISTRATION); partition:
    this process is one rank of a model-parallel worker group and pulls and pushes
    only this partition of it (pserver.server.partitions; the model size and layout given to
    `connect` are the partition's).
    """

    def __init__(self, cfg: ClientConfig, transport: str = "session", shm: bool = True,
                 codec: wire.HandCodec | wire.GeneratedCodec = wire.HAND,
                 registration: int = PROCESS_REGISTRATION,
                 partition: pb.PartitionLayout | None = None, wire_dtype: str = "fp32",
                 compress: CompressedPush | None = None):
        if wire_dtype not in WIRE_DTYPES:
            raise ValueError(f"wire dtype {wire_dtype!r}: one of {', '.join(WIRE_DTYPES)}")
        self.cfg = cfg
        self.wire = WIRE_DTYPES[wire_dtype]
        if compress is not None and self.wire is not None:
            raise ValueError(f"--compress with --wire {wire_dtype}: a compressed push carries "
                             "its values in the model's dtype")
        self.compress = compress
        self._wire_grad = self._wire_params = None  # (n,) the half copies --wire sends
        self._watchdog = Watchdog(min(1.0, cfg.rpc_timeout_s / 4))
        self.registration = registration
        if compress is not None:
            shm_refused = "--compress: compressed pushes travel over gRPC"
        elif self.wire is not None:
            shm_refused = f"--wire {wire_dtype}: tensors travel over gRPC as {wire_dtype}"
        else:
            shm_refused = "" if shm else "the worker runs with shm off"
        make = partial(ShardClient, transport=transport, shm_refused=shm_refused, codec=codec,
                       watchdog=self._watchdog, registration=registration,
                       partition=partition, wire_dtype=self.wire)
        self.shards = [ReplicatedShard(a.split(SEPARATOR), cfg, make) if SEPARATOR in a
                       else make(a, cfg) for a in cfg.addresses()]
        self._pool = ThreadPoolExecutor(len(self.shards), thread_name_prefix="ps-client")
        self.versions: list[int | None] = [None] * len(self.shards)
        self.worker = -1

    def _each(self, fn) -> list:
        return self._map(fn, self.shards)

    def _map(self, fn, items) -> list:
        """fn over `items` on the pool in parallel; one item in this thread (no hand-off)."""
        items = list(items)
        if len(items) == 1:
            return [fn(items[0])]
        return list(self._pool.map(fn, items))

    def connect(self, worker: int | None, model: str, model_size: int, layout_crc: int = 0,
                run_config: dict | None = None) -> int:
        """Wait for every shard, register, check the layout; returns the step to start at.

        worker: this worker's id, or None: shard 0 assigns one (then in self.worker).
        layout_crc: wire.layout_crc of the model's parameter specs; run_config: the
        worker's run config (pserver.common.runconfig), checked by every shard.
        """
        self._each(lambda s: s.wait_ready())
        config = json.dumps(run_config, sort_keys=True) if run_config else ""
        try:
            return self._register(worker, model, model_size, layout_crc, config)
        except BaseException:
            self._forget()
            raise

    def _register(self, worker: int | None, model: str, model_size: int, layout_crc: int,
                  config: str) -> int:
        first, assigned = None, None
        if worker is None:
            first = next((s for s, st in zip(self.shards, self._each(lambda s: s.stats()),
                                             strict=True) if st.shard == 0), None)
            if first is None:
                raise InvalidArgument(f"--servers {','.join(self.cfg.addresses())}: no shard 0 "
                                      "among them, and shard 0 assigns worker ids")
            assigned = first.register(None, model, model_size, layout_crc, config)
            worker = assigned.worker_id
        self.worker = worker
        infos = self._each(lambda s: assigned if s is first else
                           s.register(worker, model, model_size, layout_crc, config))
        order = sorted(range(len(infos)), key=lambda i: infos[i].shard)
        self.shards = [self.shards[i] for i in order]
        infos = [infos[i] for i in order]
        n = len(infos)
        if [i.shard for i in infos] != list(range(n)) or any(i.num_shards != n for i in infos):
            found = ", ".join(f"{s.address}: shard {i.shard} of {i.num_shards}"
                              for s, i in zip(self.shards, infos, strict=True))
            raise InvalidArgument(f"--servers must list shards 0..{n - 1} of {n} once each "
                                  f"({found})")
        end = 0
        for s, i in zip(self.shards, infos, strict=True):
            if i.meta.offset != end:
                raise InvalidArgument(f"{s.address}: shard {i.shard} starts at {i.meta.offset}, "
                                      f"expected {end}")
            end += i.meta.shape[0]
        if end != model_size:
            raise InvalidArgument(f"shards cover {end} elements, the model has {model_size}")
        self.versions = [None] * n
        return min(i.next_step for i in infos)

    def _slice(self, shard: ShardClient, flat: np.ndarray) -> np.ndarray:
        lo = shard.info.meta.offset
        return flat[lo : lo + shard.info.meta.shape[0]]

    def _on_wire(self, flat: np.ndarray, which: str) -> np.ndarray:
        """The buffer a tensor travels in: `flat` itself, or under --wire its half copy
        ("grad" or "params", made at first use)."""
        if self.wire is None:
            return flat
        buf = getattr(self, f"_wire_{which}")
        if buf is None or buf.size != flat.size:
            buf = np.empty(flat.size, self.wire)
            setattr(self, f"_wire_{which}", buf)
        return buf

    def _landed(self, s: ShardClient, changed: bool, flat: np.ndarray, sent: np.ndarray) -> None:
        """Count a pull's bytes; a half pull's values into the float32 `flat`."""
        if changed:
            s.pulled_bytes += s.info.meta.shape[0] * sent.itemsize
            if sent is not flat:
                self._slice(s, flat)[...] = self._slice(s, sent)

    def paths(self) -> list[str]:
        """How each shard's tensors travel now (ShardClient.path; a replicated shard's: its
        current replica's)."""
        return [(s.replicas[s.current] if isinstance(s, ReplicatedShard) else s).path()
                for s in self.shards]

    def pull(self, flat: np.ndarray) -> int:
        """Pull every shard into `flat` in parallel; returns how many shards changed."""
        sent = self._on_wire(flat, "params")

        def one(k: int) -> bool:
            s = self.shards[k]
            known, self.versions[k] = self.versions[k], None  # unknown until the pull succeeds
            self.versions[k], changed = s.pull_into(self._slice(s, sent), self.worker, known)
            self._landed(s, changed, flat, sent)
            return changed

        return sum(self._map(one, range(len(self.shards))))

    def pull_whole(self, flat: np.ndarray) -> np.ndarray:
        """Every shard's parameters into `flat`, each sent whole, the versions this client
        keeps for its own buffer left as they are: a look at the servers' state (an
        evaluation inside a local-SGD round); returns `flat`."""
        sent = self._on_wire(flat, "params")

        def one(k: int) -> None:
            s = self.shards[k]
            _, changed = s.pull_into(self._slice(s, sent), self.worker, None)
            self._landed(s, changed, flat, sent)

        self._map(one, range(len(self.shards)))
        return flat

    def _grad_on_wire(self, flat_grad: np.ndarray) -> np.ndarray:
        """The gradient as it travels: itself, or rounded to the --wire dtype."""
        grad = self._on_wire(flat_grad, "grad")
        if grad is not flat_grad:
            grad[...] = flat_grad
        return grad

    @property
    def pushed_bytes(self) -> int:
        """Gradient bytes pushed (values only, as they travel), over every shard."""
        return sum(s.pushed_bytes for s in self.shards)

    @property
    def pulled_bytes(self) -> int:
        """Parameter bytes pulled (values only, as they travel; not-modified pulls: 0)."""
        return sum(s.pulled_bytes for s in self.shards)

    def _part(self, shard: ShardClient, flat_grad: np.ndarray,
              ranges: Ranges | None) -> tuple[np.ndarray, Ranges | None]:
        """What `shard` gets of `flat_grad`: its slice; or, given the model's `ranges`, the
        values of those that meet its slice, packed, and them relative to the shard."""
        if ranges is None:
            return self._slice(shard, flat_grad), None
        lo = shard.info.meta.offset
        mine = ranges_lib.within(ranges, lo, lo + shard.info.meta.shape[0])
        return ranges_lib.gather(self._slice(shard, flat_grad), mine), mine

    def _parts(self, flat_grad: np.ndarray,
               ranges: Ranges | None) -> list[tuple[np.ndarray, Ranges | None, Part | None]]:
        """Each shard's push, (what travels, its ranges, its compressed part): `_part`'s;
        or with --compress the gradient compressed once (the residual moves on) and each
        shard's part of it, its bytes travelling."""
        if self.compress is None:
            return [(*self._part(s, flat_grad, ranges), None) for s in self.shards]
        if ranges is not None:
            raise ValueError("a compressed push carries no ranges")
        bounds = [(s.info.meta.offset, s.info.meta.offset + s.info.meta.shape[0])
                  for s in self.shards]
        return [(p.data, None, p) for p in self.compress.parts(flat_grad, bounds)]

    def report_step_s(self, seconds: float) -> None:
        """Carry `seconds`, this worker's measured step time, on every push from now on
        (PushHeader.step_s; each reply answers the fastest worker's: --dylu)."""
        for s in self.shards:
            s.step_s = seconds

    def push(self, flat_grad: np.ndarray, step: int,
             ranges: Ranges | None = None) -> list[pb.PushReply]:
        """Push every shard's slice of `flat_grad` in parallel, each with the version it read;
        `ranges`: only these ranges of the model's flat vector (pserver.common.ranges: sorted,
        disjoint), each shard the ones that meet its slice."""
        if any(v is None for v in self.versions):
            raise RuntimeError("push before a successful pull of every shard")
        parts = self._parts(self._grad_on_wire(flat_grad), ranges)

        def one(k: int) -> pb.PushReply:
            s = self.shards[k]
            grad, mine, part = parts[k]
            reply = s.push(grad, self.worker, step, self.versions[k], mine, part)
            s.pushed_bytes += grad.nbytes
            return reply

        return self._map(one, range(len(self.shards)))

    def push_pull(self, flat_grad: np.ndarray, step: int, flat: np.ndarray,
                  ranges: Ranges | None = None) -> tuple[list[pb.PushReply], int]:
        """push(flat_grad, step), then pull(flat), every shard in parallel, each shard's
        pull right behind its push (ShardClient.push_pull): the worker's loop of push,
        pull, compute, with one round trip per shard for the push and the pull (`ranges`:
        as in push). Once every shard's session is open, the pushes are sent and the
        answers read from this thread (_push_pull_here). Returns the push replies and how
        many shards changed."""
        if any(v is None for v in self.versions):
            raise RuntimeError("push before a successful pull of every shard")
        flat_grad, sent = self._grad_on_wire(flat_grad), self._on_wire(flat, "params")
        known = list(self.versions)
        self.versions = [None] * len(self.shards)  # unknown until each pull succeeds
        parts = self._parts(flat_grad, ranges)  # (grad, ranges, compressed)

        def land(k: int, answer: tuple[pb.PushReply, int, bool]) -> tuple[pb.PushReply, bool]:
            s, (grad, _, _) = self.shards[k], parts[k]
            reply, self.versions[k], changed = answer
            s.pushed_bytes += grad.nbytes
            self._landed(s, changed, flat, sent)
            return reply, changed

        def retried(k: int) -> tuple[pb.PushReply, bool]:
            s, (grad, mine, part) = self.shards[k], parts[k]
            return land(k, s.push_pull(grad, self.worker, step, known[k], self._slice(s, sent),
                                       mine, part))

        answers = self._push_pull_here(step, known, parts, sent)
        missing = [k for k in range(len(self.shards)) if k not in answers]
        again = dict(zip(missing, self._map(retried, missing), strict=True))
        done = [again[k] if k in again else land(k, answers[k]) for k in range(len(self.shards))]
        return [reply for reply, _ in done], sum(changed for _, changed in done)

    def _push_pull_here(self, step: int, known: list[int], parts: list[tuple],
                        sent: np.ndarray) -> dict[int, tuple[pb.PushReply, int, bool]]:
        """{shard: push_pull's answer} for every shard, sent and read from this thread,
        where every shard has its session open (the pushes go out together and no thread
        is woken to carry them: on a host whose cores are busy each hand-off to a pool
        thread and back waits to be scheduled); {} when not, and after a failure the
        answers read so far: the others go through ShardClient.push_pull, which retries."""
        if len(self.shards) < 2 or not all(
                isinstance(s, ShardClient) and s.in_session for s in self.shards):
            return {}
        answers: dict[int, tuple[pb.PushReply, int, bool]] = {}
        try:
            for s, (grad, mine, part), version in zip(self.shards, parts, known, strict=True):
                s.start_push_pull(grad, self.worker, step, version, mine, part)
            for k, s in enumerate(self.shards):
                answers[k] = s.finish_push_pull(self._slice(s, sent))
        except BaseException as e:
            for k, s in enumerate(self.shards):
                if k not in answers:  # it may still owe an answer: a new session for a retry
                    s.end_session()
            if not isinstance(e, Exception):
                raise
            log.info("push_pull from one thread: %s; the shards without an answer retry", e)
        return answers

    def stats(self) -> list[pb.StatsReply]:
        return self._each(lambda s: s.stats())

    @property
    def server(self) -> pb.RegisterReply:
        """Shard 0's answer to Register: what the servers run (optimizer, consistency...)."""
        return self.shards[0].info

    def leave(self) -> None:
        self._each(lambda s: s.deregister(self.worker))

    def _forget(self) -> None:
        """Deregister from every shard that registered us (a connect that failed)."""
        for s in self.shards:
            if s.info is not None:
                try:
                    s.deregister(s.info.worker_id)
                except grpc.RpcError as e:
                    log.warning("%s: could not deregister: %s", s.address, e)
                s.info = None

    def close(self) -> None:
        for s in self.shards:
            s.close()
        self._pool.shutdown(wait=True)
        self._watchdog.close()
