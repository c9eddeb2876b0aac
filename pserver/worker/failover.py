"""A worker's client of a replicated shard: its primary, and its backup to fail over to.

`--servers` lists a shard kept by two daemons (`dtlab-pserver serve --replicas
2`, pserver.server.replication.primary) as PRIMARY|BACKUP (either order). ReplicatedShard
holds one ShardClient per daemon and sends every call to the one it takes
for the primary: at connect, the first whose health check says SERVING (a
backup says NOT_SERVING). A call that fails with UNAVAILABLE (the daemon is
dead: connection refused or reset; or it is a backup, or a primary that was
replaced or stops, which answer workers UNAVAILABLE), or with
DEADLINE_EXCEEDED where that daemon's health check then says anything but
SERVING (it is frozen or cut off), is sent to the other daemon, then back.
After each round of both it waits, up to the round's exponential backoff but
no shorter than an attempt at a silent replica lasts (_PROBE_AFTER_S +
_PROBE_TIMEOUT_S), until one of them says SERVING, or UNKNOWN: a backup whose
primary gives it no answer, which takes over when a worker's call asks it
(pserver.server.replication.backup); so a takeover is found within a poll,
_POLL_S, of its being possible. A round after which a replica says SERVING
counts as one of --retries; one after which none does (a takeover under way)
does not, and such rounds go on for up to the call deadline or what --retries
rounds of backoff last, whichever is longer. A deadline on a primary whose
health says SERVING is the call's own (a pull waiting on SSP/BSP) and raised
as it is. Every call carries the highest term the worker has seen of the shard
(wire.TERM_KEY), by which an orphaned backup that its primary went on without
refuses to take over.

No attempt waits for the call's deadline on a replica that stopped answering
(paused, cut off, or no longer the primary): once an attempt has run for
_PROBE_AFTER_S, a watcher asks that replica's health every _PROBE_AFTER_S / 2,
and where it does not say SERVING within _PROBE_TIMEOUT_S the attempt is
ended (its session aborted: UNAVAILABLE) and goes to the other replica; a
serving primary's long wait (SSP, BSP) goes on. So after a fault the worker
finds the new primary within about a second of its takeover, whatever
--rpc-timeout-s is (on the session transport; a call of the per-call
transport ends at its deadline). The call is the same call: a push keeps its
(worker, step), so a push that reached the backup before the primary died is
answered as a duplicate by the new primary and applied once (Li et al. 2014).
The worker's registration is the primary's, which the backup holds too
(replicated), so nothing is registered again after a failover.

Terms. Every reply of a replicated shard carries its primary's replication term, and
terms only grow (a takeover, or a primary going on alone, starts a new one). `Terms`
keeps the highest one any replica's reply carried; a reply of a lower term is a replaced
primary's (one that lost its lease and did not know yet): it is refused as UNAVAILABLE
before anything of it is used (a pull's values included), and the call fails over.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import threading
import time
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from dtlab.protos import dtlab_ps_pb2 as pb
from dtlab.pserver.common.codec import SERVICE
from dtlab.pserver.common.config import ClientConfig
from dtlab.pserver.worker.session import StatusError

log = logging.getLogger(__name__)

SEPARATOR = "|"  # between the addresses of one shard's replicas in --servers
_MAX_BACKOFF_S = 2.0
_FAIL_OVER = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
_PROBE_AFTER_S = 0.5  # an attempt running this long has its replica's health asked ...
_PROBE_TIMEOUT_S = 0.5  # ... which must say SERVING within this, or the attempt ends
_POLL_S = 0.05  # between health checks while no replica says SERVING
_POLL_TIMEOUT_S = 0.1  # each of those (a silent replica is asked again in the next poll)


class Terms:
    """The highest replication term a shard's replies carried (protos/dtlab_ps.proto,
    Terms): a reply of a lower term is a replaced primary's, refused as UNAVAILABLE."""

    def __init__(self):
        self.highest = 0
        self._lock = threading.Lock()  # a shard's calls run one at a time; kept exact anyway

    def check(self, address: str, term: int) -> None:
        with self._lock:
            if term < self.highest:
                raise StatusError(grpc.StatusCode.UNAVAILABLE,
                                  f"{address}: a reply of replication term {term}, below the "
                                  f"term {self.highest} this shard answered in: not its "
                                  "primary (a replaced one)")
            self.highest = term


class ReplicatedShard:
    """The ShardClient interface over one shard's replicas; `make(address, cfg)` makes
    each replica's ShardClient (it retries nothing itself: this fails over instead)."""

    def __init__(self, addresses: list[str], cfg: ClientConfig, make: Callable):
        self.cfg = cfg
        once = dataclasses.replace(cfg, retries=0)
        self.replicas = [make(a, once) for a in addresses]
        self.terms = Terms()  # the highest term any replica's reply carried
        for r in self.replicas:
            r.terms = self.terms
        self.current = 0
        self.failovers = 0  # switches from one replica to the other
        self.pushed_bytes = self.pulled_bytes = 0  # counted by PSClient, as on a ShardClient
        self._attempt: tuple | None = None  # (replica, when it began): the call in flight
        self._closed = threading.Event()
        threading.Thread(target=self._watch, name="ps-failover-watch", daemon=True).start()

    @property
    def address(self) -> str:
        return self.replicas[self.current].address

    @property
    def info(self) -> pb.RegisterReply | None:
        return self.replicas[self.current].info

    @info.setter
    def info(self, value: pb.RegisterReply | None) -> None:
        for r in self.replicas:
            r.info = value

    @property
    def registration(self) -> int:
        return self.replicas[0].registration

    @registration.setter
    def registration(self, value: int) -> None:
        for r in self.replicas:
            r.registration = value

    @property
    def step_s(self) -> float | None:
        return self.replicas[0].step_s

    @step_s.setter
    def step_s(self, value: float | None) -> None:
        for r in self.replicas:
            r.step_s = value

    @property
    def partition(self) -> pb.PartitionLayout | None:
        return self.replicas[0].partition

    @partition.setter
    def partition(self, value: pb.PartitionLayout | None) -> None:
        for r in self.replicas:
            r.partition = value

    @property
    def shared_memory(self) -> bool:
        return self.replicas[self.current].shared_memory

    def wait_ready(self) -> None:
        """Until one replica's health says SERVING (bounded): that one is the primary. Where
        none does, one that says UNKNOWN while the other gives no answer (an orphaned
        backup, its primary silent to it and to this worker) is taken: the worker's first
        call asks it to take over."""
        start, delay = time.monotonic(), self.cfg.backoff_s
        request = health_pb2.HealthCheckRequest(service=SERVICE)
        seen: dict[str, str] = {}
        while time.monotonic() - start < self.cfg.connect_timeout_s:
            orphan, silent = None, 0
            for i, r in enumerate(self.replicas):
                try:
                    reply = health_pb2_grpc.HealthStub(r.channel).Check(
                        request, timeout=min(2.0, self.cfg.rpc_timeout_s))
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        self.current = i
                        return
                    if reply.status == health_pb2.HealthCheckResponse.UNKNOWN:
                        orphan = i
                    seen[r.address] = "not serving (a backup, or a primary without one yet)"
                except grpc.RpcError as e:
                    silent += 1
                    seen[r.address] = e.code().name
            if orphan is not None and silent:
                self.current = orphan
                return
            time.sleep(delay)
            delay = min(_MAX_BACKOFF_S, delay * 2)
        found = "; ".join(f"{a}: {why}" for a, why in seen.items())
        raise TimeoutError(f"no replica of {'|'.join(r.address for r in self.replicas)} "
                           f"serves after {self.cfg.connect_timeout_s:g} s ({found})")

    def _serves(self, replica, timeout: float | None = None) -> bool:
        """Whether `replica`'s health check says SERVING now (within `timeout` s, by default
        the smaller of 2 s and the call deadline)."""
        return self._status(replica, timeout) == health_pb2.HealthCheckResponse.SERVING

    def _status(self, replica, timeout: float | None = None) -> int | None:
        """`replica`'s health status now (None: no answer within `timeout` s, by default
        the smaller of 2 s and the call deadline)."""
        try:
            return health_pb2_grpc.HealthStub(replica.channel).Check(
                health_pb2.HealthCheckRequest(service=SERVICE),
                timeout=timeout or min(2.0, self.cfg.rpc_timeout_s)).status
        except grpc.RpcError:
            return None

    def _watch(self) -> None:
        """Ends an attempt whose replica, asked while it runs, does not say SERVING."""
        while not self._closed.wait(_PROBE_AFTER_S / 2):
            attempt = self._attempt
            if attempt is None or time.monotonic() - attempt[1] < _PROBE_AFTER_S:
                continue
            replica = attempt[0]
            if not self._serves(replica, _PROBE_TIMEOUT_S) and self._attempt is attempt:
                replica.abort(f"its health check did not say SERVING within "
                              f"{_PROBE_TIMEOUT_S} s during a call (paused, cut off, or no "
                              "longer the primary)")

    def _await_serving(self, limit: float) -> bool:
        """Up to `limit` s (at least _POLL_S) until a replica's health says SERVING (True),
        or UNKNOWN (False: a backup whose primary gives it no answer, which takes over when
        a worker's call asks it); that one is taken for the primary. False if none did."""
        end = time.monotonic() + max(limit, _POLL_S)
        n = len(self.replicas)
        ready = (health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.UNKNOWN)
        while True:
            for k in range(n):
                i = (self.current + k) % n
                status = self._status(self.replicas[i], _POLL_TIMEOUT_S)
                if status in ready:
                    self.current = i
                    time.sleep(max(0.0, min(_POLL_S, end - time.monotonic())))
                    return status == health_pb2.HealthCheckResponse.SERVING
            if time.monotonic() >= end:
                return False
            time.sleep(_POLL_S)

    def _on_primary(self, call: Callable, what: str):
        """call(replica) on the primary; on UNAVAILABLE, or a deadline on a replica that
        does not say SERVING, on the other replica, and so on: --retries rounds after
        which a replica served, and rounds after which none did for up to the call
        deadline (or the rounds' backoff, if longer)."""
        n, delay, tried, rounds = len(self.replicas), self.cfg.backoff_s, 0, 0
        patience = max(self.cfg.rpc_timeout_s, sum(min(_MAX_BACKOFF_S, self.cfg.backoff_s * 2**r)
                                                   for r in range(self.cfg.retries)))
        start = time.monotonic()
        while True:
            replica = self.replicas[self.current]
            self._attempt = (replica, time.monotonic())
            try:
                return call(replica)
            except grpc.RpcError as e:
                code, tried = e.code(), tried + 1
                spent = rounds >= self.cfg.retries or time.monotonic() - start >= patience
                if code not in _FAIL_OVER or (tried % n == 0 and spent):
                    raise
                if code == grpc.StatusCode.DEADLINE_EXCEEDED and self._serves(replica):
                    raise  # a serving primary's deadline: the call's own
                self.current = (self.current + 1) % n
                self.failovers += 1
                log.warning("%s %s: %s; trying %s", replica.address, what, e.details(),
                            self.address)
                if tried % n == 0:  # polled no shorter than a silent replica's attempt lasts
                    wait = max(min(_MAX_BACKOFF_S, delay) * random.uniform(0.5, 1),
                               _PROBE_AFTER_S + _PROBE_TIMEOUT_S)
                    rounds += self._await_serving(wait)  # a replica serves: a round counts
                    delay *= 2
            finally:
                self._attempt = None

    def register(self, worker: int | None, model: str, model_size: int, layout_crc: int,
                 run_config: str = "") -> pb.RegisterReply:
        info = self._on_primary(lambda r: r.register(worker, model, model_size, layout_crc,
                                                     run_config), "Register")
        self.info = info
        return info

    def deregister(self, worker: int) -> None:
        self._on_primary(lambda r: r.deregister(worker), "Deregister")

    def stats(self) -> pb.StatsReply:
        return self._on_primary(lambda r: r.stats(), "Stats")

    def save_checkpoint(self) -> pb.CheckpointReply:
        return self._on_primary(lambda r: r.save_checkpoint(), "SaveCheckpoint")

    def pull_into(self, out, worker: int, known_version: int | None) -> tuple[int, bool]:
        return self._on_primary(lambda r: r.pull_into(out, worker, known_version), "Pull")

    def push(self, grad, worker: int, step: int, version: int,
             ranges=None, compressed=None) -> pb.PushReply:
        return self._on_primary(lambda r: r.push(grad, worker, step, version, ranges,
                                                 compressed), "Push")

    def push_pull(self, grad, worker: int, step: int, version: int, out, ranges=None,
                  compressed=None):
        return self._on_primary(lambda r: r.push_pull(grad, worker, step, version, out, ranges,
                                                      compressed), "PushPull")

    def close(self) -> None:
        self._closed.set()
        for r in self.replicas:
            r.close()
