"""Assemble one parameter-server shard daemon: store, gRPC server, health, metrics.

The shard starts from the model's seeded initialisation,
FlatParams(model.specs(), seed), sliced to its element range, so that sync
and async runs start from identical weights; or, with --resume, from the
newest checkpoint in --checkpoint-dir. Shutdown (SIGTERM, see
pserver.__main__) reports NOT_SERVING on the health service, fails pulls
that wait on the consistency policy with UNAVAILABLE, lets in-flight pushes
finish (up to --grace-s), ends the workers' sessions once no operation is
in progress on them, writes a checkpoint when configured and returns.

Model-parallel worker groups bring their partitions at Register; the daemon
then makes one store per partition (pserver.server.partitions, store_of) from the
record's model and optimizer, and routes every call by the partition it
names. A daemon holding partitions saves and resumes each (pserver.server.partitions).

With shared memory allowed (`shm`), the daemon first sweeps segments that
servers killed before unlinking them left in /dev/shm (pserver.common.shm).

Two optional threads: with --worker-timeout the lease reaper drops workers
that stopped calling (pserver.server.leases; the server then also pings its
clients), and with --checkpoint-every-s the shard is saved periodically
(pserver.server.periodic); both stop before the shutdown's own checkpoint.

With --apply-log the dense store records every update it applies
(pserver.server.applylog; {shard} in the path becomes the shard index); the
log is closed after the shutdown's checkpoint, so the two end at one version
(what pserver.replay compares). The partitions of worker groups are not logged.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import threading
import time
from concurrent import futures
from functools import partial
from pathlib import Path

import grpc
import numpy as np
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from dtlab.models.config import ConfigError, build
from dtlab.models.data import DataConfig
from dtlab.models.optim import OptimConfig, Schedule
from dtlab.models.outer import make_outer
from dtlab.models.params import FlatParams
from dtlab.models.run.checkpoint import CheckpointError
from dtlab.models.run.trace import Trace
from dtlab.models.zoo import build_model, config_class
from dtlab.pserver.common import auth, shm
from dtlab.pserver.common import codec as wire
from dtlab.pserver.common.codec import SERVICE
from dtlab.pserver.common.config import ServerConfig
from dtlab.pserver.common.errors import FailedPrecondition
from dtlab.pserver.server import checkpoint, reflection
from dtlab.pserver.server.allocator import huge_empty
from dtlab.pserver.server.applylog import ApplyLog, path_of
from dtlab.pserver.server.cache_blocked import BlockedOptimizer
from dtlab.pserver.server.consistency import Consistency
from dtlab.pserver.server.expert_staleness import ExpertStaleness
from dtlab.pserver.server.inflight import InFlight
from dtlab.pserver.server.leases import LeaseReaper, keepalive_options
from dtlab.pserver.server.metrics import MetricsServer
from dtlab.pserver.server.partitions import Partitions
from dtlab.pserver.server.periodic import PeriodicCheckpoints
from dtlab.pserver.server.replication.primary import Replication
from dtlab.pserver.server.servicer import ParameterServerServicer, handler
from dtlab.pserver.server.store import ShardLayout, ShardStore

log = logging.getLogger(__name__)


def host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def build_store(cfg: ServerConfig, model_name: str, model_cfg,
                optim_cfg: OptimConfig) -> ShardStore:
    """The shard's store at its seeded initial values (host NumPy, whatever the device)."""
    model = build_model(model_name, model_cfg)
    flat = FlatParams(model.specs(), seed=cfg.seed, dtype=cfg.dtype, xp=np)
    return store_of(cfg, model_name, flat, optim_cfg)


def store_of(cfg: ServerConfig, model_name: str, flat: FlatParams,
             optim_cfg: OptimConfig) -> ShardStore:
    """The store of this shard's slice of `flat`: a dense model's parameters, or one
    partition of a model-parallel worker group's (pserver.server.partitions)."""
    if cfg.num_shards > flat.size:
        raise ConfigError(f"--num-shards {cfg.num_shards} exceeds the model's {flat.size} "
                          "parameters")
    layout = ShardLayout(model_name, flat.size, cfg.shard, cfg.num_shards,
                         wire.layout_crc(flat.specs))
    lo, hi = layout.offset, layout.offset + layout.length
    params = huge_empty(hi - lo, flat.data.dtype)
    params[...] = flat.data[lo:hi]
    optim_cfg, outer = served_optim(cfg, optim_cfg), cfg.outer()
    if outer.outer_optimizer == "delayed-nesterov":  # its own state (buffer, period): unblocked
        optimizer = make_outer(outer, params)
    else:
        optimizer = BlockedOptimizer(optim_cfg, params, flat.decay_mask()[lo:hi].copy(),
                                     threads=cfg.apply_threads)
    policy = Consistency(cfg.consistency, cfg.staleness, cfg.backup_workers)
    return ShardStore(layout, params, optimizer, Schedule(optim_cfg, cfg.schedule_steps), policy,
                      staleness_lr=cfg.staleness_lr, expected_workers=cfg.num_workers,
                      chunk_bytes=cfg.chunk_bytes, log_every=cfg.log_every,
                      worker_timeout=cfg.worker_timeout,
                      experts=ExpertStaleness.of(flat.specs, lo, hi - lo))


def served_optim(cfg: ServerConfig, optim_cfg: OptimConfig) -> OptimConfig:
    """The optimizer the shard runs: with --outer-optimizer the outer one, as the SGD it
    is (models.outer.OuterConfig.as_optim: the workers push outer gradients), in place
    of `optim_cfg`; else `optim_cfg`."""
    outer = cfg.outer()
    return outer.as_optim() if outer.enabled else optim_cfg


def config_record(cfg: ServerConfig, model_name: str, model_cfg, optim_cfg: OptimConfig,
                  data_cfg: DataConfig | None = None) -> dict:
    """The full configuration, as checkpoints record it and Register checks workers
    against (pserver.common.runconfig)."""
    return {"server": dataclasses.asdict(cfg), "model_name": model_name,
            "model": dataclasses.asdict(model_cfg),
            "data": dataclasses.asdict(data_cfg or DataConfig()),
            "optim": dataclasses.asdict(served_optim(cfg, optim_cfg))}


def why_not_listen(host: str, port: int) -> str:
    """Why a server could not listen on host:port ("" if it can): a plain bind first, so
    that a port in use is one clear error rather than gRPC's own log line and then ours."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        return e.strerror
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC's listener does
        try:
            s.bind(address)
        except OSError as e:
            return e.strerror.lower()
    return ""


class Daemon:
    """A gRPC server for `store`, with health, optional reflection, metrics and TLS.

    `config` is the record checkpoints keep (see config_record); `handlers`
    adds further generic RPC handlers to the same server (the benchmark's
    ceiling service); `shm` offers co-located workers shared memory; `codec`
    is the chunk codec (pserver.common.codec).
    """

    def __init__(self, cfg: ServerConfig, store: ShardStore, config: dict,
                 handlers: tuple[grpc.GenericRpcHandler, ...] = (), shm: bool = True,
                 codec: wire.HandCodec | wire.GeneratedCodec = wire.HAND):
        self.cfg, self.store, self.config_record = cfg, store, config
        if cfg.resume:
            path = checkpoint.latest(cfg.checkpoint_dir, store.layout)
            if path is None:
                log.info("--resume: no checkpoint in %s, starting fresh", cfg.checkpoint_dir)
            else:
                state = checkpoint.load(path, store.layout, config["optim"]["optimizer"])
                try:
                    store.load_state(state)
                except (ValueError, KeyError) as e:
                    raise CheckpointError(f"{path}: does not fit this shard ({e})") from None
                log.info("resumed from %s (version %d)", path, store.version)
        self._ckpt_lock = threading.Lock()
        self.trace = Trace(cfg.trace, pid=cfg.shard, process=f"shard {cfg.shard}") \
            if cfg.trace else None
        store.trace = self.trace
        token = auth.read_token(cfg.token_file, cfg.token_env)
        self.replication = Replication(cfg, store, config) if cfg.replicas > 1 else None
        self.stopping = threading.Event()  # set by a signal, or by a failure (self.failure)
        self.failure = ""
        self.rejoin = ""  # a replica that goes on as the backup of this address (pserver.__main__)
        self.server = grpc.server(
            futures.ThreadPoolExecutor(cfg.threads, thread_name_prefix="ps"),
            interceptors=([auth.TokenInterceptor(token)] if token else [])
            + ([self.replication.gate] if self.replication else []),
            options=[*wire.transport_options(cfg.max_message_bytes), ("grpc.so_reuseport", 0),
                     *keepalive_options(cfg.worker_timeout)])
        self.servicer = ParameterServerServicer(
            self.store, cfg.max_message_bytes,
            checkpoint=self.save_checkpoint if cfg.checkpoint_dir else None, shm=shm,
            codec=codec, config=config)
        self.partitions = Partitions(self.servicer, partial(self._partition, shm, codec),
                                     self._dense_specs, cfg.seed, cfg.dtype)
        if cfg.resume:
            self._resume_partitions(config["optim"]["optimizer"])
        self.calls = InFlight(handler(self.partitions), idle_streams={"Session"})
        self.server.add_generic_rpc_handlers((self.calls, *handlers))
        if self.replication is not None:
            self.server.add_generic_rpc_handlers((self.replication.handler(),))
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        if cfg.reflection:
            reflection.enable(
                (SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name),
                self.server)
        address = host_port(cfg.bind, cfg.port)
        why = why_not_listen(cfg.bind, cfg.port) if cfg.port else ""
        if why:
            raise ConfigError(f"--bind {cfg.bind} --port {cfg.port}: cannot listen there ({why})")
        try:
            if cfg.tls_cert:
                creds = auth.server_credentials(cfg.tls_cert, cfg.tls_key, cfg.tls_client_ca)
                self.port = self.server.add_secure_port(address, creds)
            else:
                self.port = self.server.add_insecure_port(address)
        except RuntimeError:
            raise ConfigError(f"--bind {cfg.bind} --port {cfg.port}: cannot listen there "
                              "(in use, or not an address of this host)") from None
        self.metrics = None
        if cfg.metrics_port >= 0:
            try:
                self.metrics = MetricsServer(cfg.bind, cfg.metrics_port, self.servicer.stats,
                                             lambda: self.calls.count)
            except OSError as e:
                raise ConfigError(f"--metrics-port {cfg.metrics_port}: {e.strerror}") from None
        self._leases_primary = False  # whether the last reaper pass found this a primary
        self.reaper = LeaseReaper(cfg.worker_timeout, self._expire_leases) \
            if cfg.worker_timeout else None
        self.periodic = PeriodicCheckpoints(cfg.checkpoint_every_s, self._changes,
                                            self.save_checkpoint) \
            if cfg.checkpoint_every_s else None
        self.applylog = ApplyLog(path_of(cfg.apply_log, cfg.shard), store, config) \
            if cfg.apply_log else None
        store.applylog = self.applylog

    def _record(self) -> tuple[str, object, OptimConfig]:
        """The model name, model config and optimizer config of the config record."""
        rec = self.config_record
        if "model" not in rec or "optim" not in rec:
            raise FailedPrecondition("this server has no model record: it holds no "
                                     "partitions", reason="partition")
        name = rec["model_name"]
        return name, build(config_class(name), dict(rec["model"])), build(OptimConfig,
                                                                          dict(rec["optim"]))

    def _dense_specs(self) -> list:
        name, model_cfg, _ = self._record()
        return build_model(name, model_cfg).specs()

    def _partition(self, shm: bool, codec, flat: FlatParams) -> ParameterServerServicer:
        """A servicer over a new store for this shard's slice of partition `flat`."""
        name, _, optim_cfg = self._record()
        store = store_of(self.cfg, name, flat, optim_cfg)
        store.trace = self.trace
        return ParameterServerServicer(store, self.cfg.max_message_bytes, checkpoint=None,
                                       shm=shm, codec=codec, config=self.config_record)

    def _resume_partitions(self, optimizer: str) -> None:
        """Every partition this shard saved, made again in its newest state that verifies."""
        for k, count, directory in checkpoint.saved_partitions(self.cfg.checkpoint_dir,
                                                               self.store.layout):
            path = checkpoint.newest(directory)  # the dense shard's rule: one for both
            if path is None:
                continue
            store = self.partitions.restore(path, optimizer)
            log.info("resumed partition %d of %d from %s (version %d)", k, count, path,
                     store.version)

    def _changes(self) -> tuple[int, int]:
        """(version, accepted pushes) summed over the dense store and every partition's:
        what the periodic checkpoints watch."""
        stores = [self.store, *(k.servicer.store for k in list(self.partitions.known.values()))]
        stats = [s.stats() for s in stores]
        return sum(st.version for st in stats), sum(st.pushes for st in stats)

    def _expire_leases(self) -> None:
        """Drop the workers whose lease ran out, of the dense store and every partition's.
        A backup drops none (no worker calls it; its primary's drops reach it through the
        journal), and one that took over counts every lease from then on."""
        if self.replication is not None:
            primary = self.replication.role == "primary"
            if primary and not self._leases_primary:
                self.store.restart_leases()
            self._leases_primary = primary
            if not primary:
                return
        self.store.expire_leases()
        for known in list(self.partitions.known.values()):
            known.servicer.store.expire_leases()

    def start(self) -> None:
        if self.servicer.shm:
            shm.sweep()
        self.server.start()
        for thread in (self.metrics, self.reaper, self.periodic):
            if thread is not None:
                thread.start()
        if self.replication is None:
            for name in ("", SERVICE):
                self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        else:  # it sets the health as its role and its backup come and go
            self.replication.start(host_port(self.cfg.bind, self.port), self.health,
                                   self._fail, self._rejoin)
        lay = self.store.layout
        policy = self.store.policy
        mode = policy.mode + (f" with {policy.backups} backup workers" if policy.backups else "")
        outer = self.cfg.outer()
        if outer.enabled:
            period = (f" period {outer.outer_period}"
                      if outer.outer_optimizer == "delayed-nesterov" else "")
            mode += (f", outer {outer.outer_optimizer} lr {outer.outer_lr} momentum "
                     f"{outer.outer_momentum}{period} in place of --optimizer")
        log.info("shard %d/%d of %s: elements [%d, %d) of %d, %s, version %d, listening on %s%s",
                 lay.shard, lay.num_shards, lay.model, lay.offset, lay.offset + lay.length,
                 lay.model_size, mode, self.store.version,
                 host_port(self.cfg.bind, self.port),
                 f", metrics on :{self.metrics.port}" if self.metrics else "")
        if self.cfg.ready_file:
            self._write_ready(Path(self.cfg.ready_file))

    def _write_ready(self, path: Path) -> None:
        info = {"pid": os.getpid(), "port": self.port,
                "metrics_port": self.metrics.port if self.metrics else None}
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(info))
        os.replace(tmp, path)

    def save_checkpoint(self) -> tuple[str, int]:
        """Write the shard's checkpoint now; (its path, its version). A server holding the
        partitions of worker groups saves each (pserver.server.partitions): (the shard's
        directory, the sum of the partitions' versions)."""
        root, keep = self.cfg.checkpoint_dir, self.cfg.keep or None
        with self._ckpt_lock:
            if self.partitions.held:
                versions = []

                def write(store: ShardStore, partition: dict) -> str:
                    state = store.state()
                    versions.append(state["version"])
                    return checkpoint.save(root, store.layout, state, self.config_record,
                                           keep=keep, partition=partition)

                paths = self.partitions.save(write)
                path, version = checkpoint.shard_dir(root, self.store.layout), sum(versions)
                log.info("checkpoint of %d partitions in %s (versions %s)", len(paths), path,
                         versions)
                return path, version
            state = self.store.state()
            path = checkpoint.save(root, self.store.layout, state, self.config_record,
                                   keep=keep)
        log.info("checkpoint %s (version %d)", path, state["version"])
        return path, state["version"]

    def _fail(self, why: str) -> None:
        """This daemon cannot go on: logged, and the process stops with an error."""
        log.error("%s", why)
        self.failure = why
        self.stopping.set()

    def _rejoin(self, primary: str, why: str) -> None:
        """This replica goes on as the backup of `primary`: logged (one line: why, and what
        it does), and the daemon stops; pserver.__main__ starts it again on its port with
        --replica-of `primary` and a fresh store (replication.primary: rejoining)."""
        log.warning("%s: rejoining it as its backup, on port %d", why, self.port)
        self.rejoin = primary
        self.stopping.set()

    def shutdown(self) -> None:
        """NOT_SERVING, finish in-flight pushes, checkpoint if configured."""
        log.info("shutting down: finishing in-flight calls (up to %.1f s)", self.cfg.grace_s)
        for thread in (self.periodic, self.reaper):
            if thread is not None:
                thread.stop()
        self.health.enter_graceful_shutdown()
        if self.replication is not None:
            self.replication.stop()
        self.store.close()
        self.partitions.close()
        stopped = self.server.stop(self.cfg.grace_s)
        deadline = time.monotonic() + self.cfg.grace_s
        while (self.calls.count or self.partitions.busy) and time.monotonic() < deadline:
            time.sleep(0.02)
        self.server.stop(None)  # what is left are sessions idle between operations
        stopped.wait()
        if self.cfg.checkpoint_dir and not self.rejoin:  # its store is replaced by the snapshot
            self.save_checkpoint()
        if self.metrics is not None:
            self.metrics.stop()
        if self.trace is not None:
            self.trace.close()
            log.info("trace %s", self.cfg.trace)
        if self.applylog is not None:
            self.applylog.close()
            log.info("apply log %s (version %d)", self.applylog.path, self.store.version)
        h = self.store.staleness.shard
        log.info("stopped at version %d: %d gradients applied, staleness mean %.2f max %d",
                 self.store.version, h.total, h.sum / max(1, h.total), h.max)
        stats = self.store.stats()
        if stats.late:  # --backup-workers
            log.info("%d late gradients dropped (worker: count) %s", stats.late,
                     {w: ws.late for w, ws in stats.workers.items() if ws.late})
