"""Configuration of a parameter-server daemon and of its clients (every field a dashed flag).

The daemon's `--model` and model flags (`--d-model`, ...) and its optimizer
flags (`--optimizer`, `--lr`, ...) are parsed by models.session, as for every
trainer; see pserver.__main__ and dtlab.pserver.worker.loop.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from dtlab.models.config import ConfigError, build, choice, described, non_negative, positive
from dtlab.models.outer import OuterConfig

WILDCARDS = ("0.0.0.0", "::", "")  # --bind values that listen on every network


@dataclass
class ServerConfig:
    seed: int = described(0, "initialisation seed: the same as the workers' and the sync trainer's")
    dtype: str = choice("float32", "float32", "float64", help="parameter dtype")
    shard: int = described(0, "this server's shard index")
    num_shards: int = described(1, "shards the flat parameter vector is split into")
    bind: str = described("127.0.0.1", "address to listen on; with --rendezvous, when not "
                                       "given: by rule (pserver.common.rendezvous), never a "
                                       "wildcard such as 0.0.0.0, which needs a token or TLS")
    bind_interface: str = described("", "with --rendezvous: listen on this interface's IPv4 "
                                        "address (e.g. ib0) rather than the one routing to the "
                                        "job's other hosts")
    rendezvous: str = described("", "one launch with the workers: auto (mpiexec MPMD: shard, "
                                    "--num-shards, --num-workers from the job; addresses by "
                                    "an allgather) or a shared DIR this server writes "
                                    "shard-K.json into (srun --multi-prog, by hand)")
    port: int = described(0, "port to listen on; 0 picks a free one (logged, and in --ready-file)")
    consistency: str = choice("asp", "asp", "ssp", "bsp", help="consistency model")
    staleness: int = described(0, "SSP bound s: a worker may lead the slowest by at most s clocks")
    staleness_lr: str = choice("none", "none", "divide",
                               help="divide the lr by the gradient's staleness (Zhang et al. 2016)")
    num_workers: int = described(0, "workers sharing the data: SSP/BSP serve no pull before this "
                                    "many registered; workers without --num-workers split the "
                                    "data this many ways")
    backup_workers: int = described(0, "BSP: close each round at the first --num-workers "
                                       "minus this many gradients; the later ones are dropped "
                                       "as late (Chen et al. 2016)")
    outer_optimizer: str = choice("none", "none", "sgd", "nesterov", "delayed-nesterov",
                                  help="apply this outer optimizer (models.outer) to the "
                                       "outer gradients of workers with --local-steps, in "
                                       "place of --optimizer (local SGD, DiLoCo; "
                                       "delayed-nesterov: Liu et al. 2024's for asynchronous "
                                       "local SGD)")
    outer_lr: float = described(1.0, "outer learning rate (sgd 1: model averaging; DiLoCo 0.7)")
    outer_momentum: float = described(0.0, "outer momentum (nesterov needs it; DiLoCo 0.9)")
    outer_period: int = described(1, "delayed-nesterov: the momentum moves at every N-th outer "
                                     "gradient the shard applies, plain steps of "
                                     "--outer-lr/N in between (1: nesterov)")
    schedule_steps: int = described(0, "updates the lr schedule spans (0: constant after warm-up)")
    chunk_bytes: int = described(1 << 20, "bytes per pulled chunk message")
    max_message_bytes: int = described(4 << 20, "largest message accepted or sent")
    threads: int = described(64, "gRPC handler threads (each waiting pull holds one)")
    apply_threads: int = described(2, "threads that run the optimizer on blocks of the shard")
    checkpoint_dir: str = described("", "write a checkpoint here on SIGTERM, on SaveCheckpoint "
                                        "and every --checkpoint-every-s")
    resume: bool = described(False, "start from the newest checkpoint in --checkpoint-dir")
    checkpoint_every_s: float = described(0.0, "also write a checkpoint every N seconds, skipped "
                                               "while nothing changed (0: off)")
    keep: int = described(0, "keep only the newest K checkpoints that verify (0: keep all)")
    worker_timeout: float = described(0.0, "drop a worker after N seconds with no call and no "
                                           "open session: SSP/BSP stop waiting for it; it "
                                           "rejoins by registering or calling again (0: never)")
    metrics_port: int = described(-1, "serve Prometheus GET /metrics here (-1 off, 0 any port)")
    token_file: str = described("", "file holding the bearer token every call must carry; "
                                    "without one any client that reaches the port may call, "
                                    "and with --allow-takeover take over any idle worker id: "
                                    "impersonation by design")
    token_env: str = described("", "environment variable holding the bearer token")
    tls_cert: str = described("", "PEM server certificate (with --tls-key): serve TLS")
    tls_key: str = described("", "PEM private key of --tls-cert")
    tls_client_ca: str = described("", "PEM CA: require client certificates it signed (mutual TLS)")
    reflection: bool = described(False, "enable gRPC server reflection")
    unchecked_registration: bool = described(
        False, "accept Register and calls that carry registration 0 (clients from before the "
               "check): any client that may talk to the server can then pull and push as any "
               "worker")
    allow_takeover: bool = described(
        False, "let a Register take over an idle worker id without the registration it "
               "replaces (a restarted worker process; without a token any client that reaches "
               "the port can then take over any idle id)")
    shm: bool = described(True, "offer workers on this host a shared-memory data plane "
                                "(gRPC stays the control plane)")
    ready_file: str = described("", "write {pid, port, metrics_port} JSON here once serving")
    trace: str = described("", "write a Chrome trace (JSON, opens in Perfetto) of the shard's "
                               "pushes received, optimizer applies and pull waits here at "
                               "shutdown")
    apply_log: str = described("", "write every applied update (its version, lr, the workers, "
                                   "steps and versions read behind it, a digest of the "
                                   "parameters) here as JSON lines, for dtlab-replay; {shard} "
                                   "becomes the shard index")
    grace_s: float = described(10.0, "seconds in-flight calls get to finish at shutdown")
    log_every: int = described(100, "log a staleness summary every N updates")
    log_level: str = choice("info", "debug", "info", "warning", help="daemon log verbosity")
    replicas: int = described(1, "daemons holding this shard: 2 is a primary and a backup that "
                                 "holds every push before it is acknowledged (chain "
                                 "replication, pserver.server.replication.primary)")
    replica_of: str = described("", "host:port of this shard's primary: start as its backup "
                                    "(with --replicas 2; also to rejoin after a failure)")
    replica_timeout_s: float = described(2.0, "a replica that says nothing for this long is "
                                              "taken for dead (heartbeats every quarter); "
                                              "longer than a push takes to reach the backup "
                                              "and be applied there")

    def validate(self):
        positive(self, "num_shards", "chunk_bytes", "max_message_bytes", "threads",
                 "apply_threads", "log_every")
        non_negative(self, "staleness", "num_workers", "schedule_steps", "grace_s",
                     "checkpoint_every_s", "keep", "worker_timeout", "backup_workers")
        if self.backup_workers and self.consistency != "bsp":
            raise ConfigError("--backup-workers applies to --consistency bsp only")
        if self.backup_workers and not self.num_workers > self.backup_workers:
            raise ConfigError(f"--backup-workers {self.backup_workers} needs --num-workers N + "
                              f"{self.backup_workers} with N >= 1 (got --num-workers "
                              f"{self.num_workers})")
        self.outer()
        if not 0 <= self.shard < self.num_shards:
            raise ConfigError(f"--shard must be in [0, --num-shards={self.num_shards}) "
                              f"(got {self.shard})")
        for name in ("port", "metrics_port"):
            if not -1 <= getattr(self, name) <= 65535 or (name == "port" and self.port < 0):
                raise ConfigError(f"--{name.replace('_', '-')} {getattr(self, name)} is not a "
                                  "port number")
        if self.staleness and self.consistency != "ssp":
            raise ConfigError("--staleness applies to --consistency ssp only")
        if self.chunk_bytes + 1024 > self.max_message_bytes:
            raise ConfigError(f"--chunk-bytes {self.chunk_bytes} must leave 1 KiB of room under "
                              f"--max-message-bytes {self.max_message_bytes}")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError("--tls-cert and --tls-key go together")
        if self.tls_client_ca and not self.tls_cert:
            raise ConfigError("--tls-client-ca (mutual TLS) needs --tls-cert and --tls-key")
        if self.token_file and self.token_env:
            raise ConfigError("give the token by --token-file or --token-env, not both")
        if self.apply_log and (self.resume or self.replicas > 1):
            raise ConfigError(f"--apply-log records a shard's updates from its first: it does "
                              f"not go with {'--resume' if self.resume else '--replicas 2'} "
                              "(that daemon may start in the middle of the run)")
        for name in ("resume", "checkpoint_every_s", "keep"):
            if getattr(self, name) and not self.checkpoint_dir:
                raise ConfigError(f"--{name.replace('_', '-')} needs --checkpoint-dir")
        self._validate_replicas()
        if self.bind_interface and not self.rendezvous:
            raise ConfigError("--bind-interface picks the address of a job's server: give "
                              "--rendezvous too, or --bind ADDR")
        if self.rendezvous not in ("", "auto") and self.replicas > 1:
            raise ConfigError(f"--rendezvous {self.rendezvous} with --replicas 2: a "
                              "rendezvous folder places one daemon per shard; replicas are "
                              "placed by the MPMD launch (--rendezvous auto) or by hand "
                              "(--replica-of)")
        if self.rendezvous == "auto" and self.replicas > 1 and self.checkpoint_dir:
            raise ConfigError("--rendezvous auto --replicas 2 with --checkpoint-dir: a shard's "
                              "primary and backup would write the same shard folder; "
                              "checkpoint replicas launched by hand, each its own folder")

    def outer(self) -> OuterConfig:
        """The outer optimizer's config (models.outer); ConfigError where it is wrong."""
        return build(OuterConfig, {"outer_optimizer": self.outer_optimizer,
                                   "outer_lr": self.outer_lr,
                                   "outer_momentum": self.outer_momentum,
                                   "outer_period": self.outer_period})

    def _validate_replicas(self):
        positive(self, "replica_timeout_s")
        if self.replicas not in (1, 2):
            raise ConfigError(f"--replicas {self.replicas}: 1, or 2 (a primary and a backup)")
        if self.replica_of and self.replicas != 2:
            raise ConfigError("--replica-of makes this daemon a backup: give --replicas 2 too")
        host, _, port = self.replica_of.rpartition(":")
        if self.replica_of and (not host or not port.isdigit()):
            raise ConfigError(f"--replica-of {self.replica_of!r} is not host:port")
        if self.replicas > 1 and self.bind in WILDCARDS:
            raise ConfigError(f"--replicas 2 with --bind {self.bind or '(empty)'}: a replica "
                              "tells the other the address it listens on, and a wildcard "
                              "names no host (a primary elsewhere would ask its own host "
                              "about its backup); give this host's address, or use "
                              "--rendezvous, which binds one by rule")
        if self.replicas > 1 and (self.tls_cert or self.resume):
            raise ConfigError("--replicas 2 does not go with "
                              f"{'--tls-cert' if self.tls_cert else '--resume'} (the replicas "
                              "speak plain gRPC to each other; a backup starts from its primary)")


def refuse_unused_optim_flags(cfg: ServerConfig, ns, fields: Iterable[str]) -> None:
    """With --outer-optimizer a shard runs the outer optimizer in place of --optimizer, so
    an optimizer flag given on the command line (one of `fields` set in the parsed flags
    `ns`: argparse leaves the others None) would go unused: a ConfigError naming it. A
    --config file's optim section is no flag and stays (it is the workers' inner
    optimizer, for dtlab-worker --local-steps)."""
    outer = cfg.outer()
    if not outer.enabled:
        return
    for name in fields:
        value = getattr(ns, name, None)
        if value is not None:
            flag = f"--{name.replace('_', '-')}"
            raise ConfigError(
                f"{flag} {value}: this shard runs --outer-optimizer {outer.outer_optimizer} "
                "in place of --optimizer on the workers' outer gradients, so it would go "
                "unused; give the inner optimizer's flags to dtlab-worker --local-steps H, "
                "and --outer-lr / --outer-momentum here")


@dataclass
class ClientConfig:
    """How a worker reaches the shards."""

    servers: str = described("", "host:port of every shard, comma-separated, any order; "
                                 "a replicated shard as PRIMARY|BACKUP")
    rendezvous: str = described("auto", "with --servers auto: auto (every shard's address "
                                        "from the mpiexec MPMD job) or the shared DIR the "
                                        "servers' --rendezvous wrote shard-K.json into")
    rendezvous_timeout_s: float = described(120.0, "with --servers auto --rendezvous DIR: how "
                                                   "long to wait for every shard's file")
    token_file: str = described("", "file holding the servers' bearer token")
    token_env: str = described("", "environment variable holding the servers' bearer token")
    tls: bool = described(False, "use TLS (implied by --tls-ca / --tls-cert; alone: system roots)")
    tls_ca: str = described("", "PEM CA that signed the servers' certificates")
    tls_cert: str = described("", "PEM client certificate for mutual TLS (with --tls-key)")
    tls_key: str = described("", "PEM private key of --tls-cert")
    tls_server_name: str = described("", "expect this name in the servers' certificates")
    rpc_timeout_s: float = described(120.0, "deadline of every call (a pull may wait on SSP/BSP)")
    connect_timeout_s: float = described(60.0, "how long to wait for the servers to be SERVING")
    retries: int = described(8, "retries of an UNAVAILABLE call, with exponential backoff (~7 s)")
    backoff_s: float = described(0.05, "first backoff delay")
    chunk_bytes: int = described(1 << 20, "bytes per pushed chunk message")
    transport: str = choice("session", "session", "calls",
                            help="session: one long-lived stream per shard; calls: one gRPC "
                                 "call per pull and per push")
    shm: bool = described(True, "move tensors through shared memory with shards on this host")
    wire: str = choice("fp32", "fp32", "fp16", "bf16",
                       help="dtype a float32 model's gradients are pushed and parameters "
                            "pulled as: fp16 / bf16 halve the bytes (rounded once each way; "
                            "the servers keep float32; over gRPC, not shared memory)")

    def validate(self):
        if self.servers == "auto":
            raise ConfigError("--servers auto: the worker reads the addresses from the job "
                              "(dtlab-worker resolves it before connecting)")
        if not self.addresses():
            raise ConfigError("--servers needs at least one host:port")
        for a in (r for shard in self.addresses() for r in shard.split("|")):
            host, _, port = a.rpartition(":")
            if not host or not port.isdigit():
                raise ConfigError(f"--servers: {a!r} is not host:port")
        positive(self, "rpc_timeout_s", "connect_timeout_s", "backoff_s", "chunk_bytes",
                 "rendezvous_timeout_s")
        non_negative(self, "retries")
        if self.token_file and self.token_env:
            raise ConfigError("give the token by --token-file or --token-env, not both")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigError("--tls-cert and --tls-key go together")

    def addresses(self) -> list[str]:
        return [a.strip() for a in self.servers.split(",") if a.strip()]

    def use_tls(self) -> bool:
        return self.tls or bool(self.tls_ca or self.tls_cert)
