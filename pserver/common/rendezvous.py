"""One launch for the async topology: servers and workers find each other through the job.

    mpiexec -n 2 dtlab-pserver serve --config C --rendezvous auto \\
        : -n 4 dtlab-worker --config C --servers auto
    srun --multi-prog job.conf      # servers: --rendezvous DIR, workers: --servers auto
                                    # --rendezvous DIR (DIR on a shared file system)

Roles are told apart by the program a rank runs (dtlab-pserver serve is a server,
dtlab-worker a worker), never by a rank number given by hand.

MPI (`auto`). Every rank of MPI_COMM_WORLD takes part in two allgathers and MPI
is used for nothing else: the first carries (role, host, --replicas), the host
being the one the launcher reports (MPI_Get_processor_name), from which a
server's shard is its rank among the servers, --num-shards the number of
servers and --num-workers the number of workers, and a worker's id its rank
among the workers; the second carries each server's address once it listens,
which the workers take in shard order.

Replicated shards (`--replicas 2` on every server): 2S servers keep S shards,
each on a primary and a backup placed on different hosts by this rule
(`replica_places`): the servers sorted by host (hosts in the order of their
first server rank, a host's servers in rank order), the j-th of them keeps shard
j mod S, as its primary when j < S, else as its backup. Two positions S apart
never fall in one host's run of at most S servers, so the rule holds whenever
no host runs more than half the servers (else it is refused, naming the host);
when every server runs on one host, both replicas of a shard share it. A third
allgather comes between the two: the primaries' addresses, which each backup
takes as --replica-of before it starts; the workers get `PRIMARY|BACKUP`.

A directory (`DIR`, for launches without MPI: srun --multi-prog, by hand). The
launcher's rank and size are read from its environment (models.run.launcher:
PMI_*, OMPI_*, SLURM_PROCID / SLURM_NTASKS); the servers are the job's first
ranks, as in the MPMD line. A server needs --num-shards (or --shard) unless its
environment says how many servers the job has; it writes DIR/shard-K.json
({"shard", "num_shards", "address"}) atomically (write, then rename) once it
listens. A worker waits, bounded, for shard-0.json (which names --num-shards),
then every other shard's, naming the ones missing when the time is up.

The address a server binds (`bind_address`): --bind ADDR, else the IPv4 address
of --bind-interface NAME, else the address of the interface that routes to the
other ranks' hosts (every rank on this host: 127.0.0.1), else, not knowing
them (a directory), the default route's interface's. Never a wildcard by
default: 0.0.0.0 listens on every network, so give it by hand, with a token or TLS.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import struct
import time
from dataclasses import dataclass
from pathlib import Path

from dtlab.models.config import ConfigError
from dtlab.models.run.launcher import RANK_VARS, SIZE_VARS, first_int

SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address
JOIN_TIMEOUT_S = 120.0  # how long a rank waits for the job's others at an allgather
POLL_S = 0.01  # between tests of a pending barrier (MPICH would spin a core otherwise)


@dataclass(frozen=True)
class Place:
    """Where a process stands in the job: its role, its index among that role's
    processes (a server's shard, a worker's id) and how many servers and workers there are."""

    role: str  # "server" | "worker"
    index: int
    servers: int  # shards
    workers: int
    replica: int = 0  # a server of a replicated shard: 0 its primary, 1 its backup


def place_in(roles: list[str], rank: int, hosts: list[str] | None = None,
             replicas: int = 1) -> Place:
    """`rank`'s place in a job whose ranks run `roles` on `hosts` (one per rank, in rank
    order), its shards kept by `replicas` servers each (the module docstring's rule)."""
    servers = [r for r, role in enumerate(roles) if role == "server"]
    workers = [r for r, role in enumerate(roles) if role == "worker"]
    if not servers or not workers:
        raise ConfigError(f"the job runs {len(servers)} servers and {len(workers)} workers: "
                          "an async job needs at least one of each (mpiexec -n S dtlab-pserver "
                          "serve ... : -n W dtlab-worker ...)")
    if roles[rank] == "worker":
        return Place("worker", workers.index(rank), len(servers) // replicas, len(workers))
    if replicas == 1:
        return Place("server", servers.index(rank), len(servers), len(workers))
    where = hosts or ["?"] * len(roles)
    shard, replica = replica_places([where[r] for r in servers])[servers.index(rank)]
    return Place("server", shard, len(servers) // 2, len(workers), replica)


def replica_places(hosts: list[str]) -> list[tuple[int, int]]:
    """(shard, replica) of each of 2S servers running on `hosts` (in rank order), the two
    replicas of a shard on different hosts (the module docstring's rule)."""
    if len(hosts) % 2:
        raise ConfigError(f"--replicas 2 needs an even number of servers (a primary and a "
                          f"backup per shard); the job runs {len(hosts)}")
    half, first = len(hosts) // 2, {}
    for h in hosts:
        first.setdefault(h, len(first))
    crowded = {h: hosts.count(h) for h in first if hosts.count(h) > half}
    if crowded and len(first) > 1:
        h, n = next(iter(crowded.items()))
        raise ConfigError(f"--replicas 2: host {h} runs {n} of the job's {len(hosts)} servers; "
                          f"with more than {half} on one host two replicas of a shard would "
                          "share it: spread the servers over the hosts")
    order = sorted(range(len(hosts)), key=lambda i: (first[hosts[i]], i))
    out = [(0, 0)] * len(hosts)
    for j, i in enumerate(order):
        out[i] = (j % half, j // half)
    return out


def env_int(env, names: tuple[str, ...]) -> int | None:
    """The first of `names` set in `env` to a non-negative integer (models.run.launcher)."""
    found = first_int(names, env)
    return None if found is None else found[0]


def place_from_env(role: str, num_servers: int | None = None,
                   env: dict[str, str] | None = None) -> Place | None:
    """This process's place from the launcher's environment (no MPI): the servers are
    ranks [0, S) and the workers [S, size). S is `num_servers`, else
    $DTLAB_NUM_SERVERS; None outside a launcher. ConfigError where S is not known or
    the rank does not fit the role."""
    env = os.environ if env is None else env
    rank, size = env_int(env, RANK_VARS), env_int(env, SIZE_VARS)
    given = env_int(env, ("DTLAB_NUM_SERVERS",))
    if rank is None or size is None:
        return None
    servers = num_servers or given
    if not servers:
        raise ConfigError(f"rank {rank} of {size}: how many of the job's ranks are servers? "
                          "give the servers --num-shards S (the workers read it from "
                          "shard-0.json) or set DTLAB_NUM_SERVERS")
    if not 0 < servers < size:
        raise ConfigError(f"{servers} servers in a job of {size} ranks leaves no worker")
    if role == "server" and rank >= servers:
        raise ConfigError(f"rank {rank} runs a server, but the job's servers are ranks "
                          f"[0, {servers}): put the servers first")
    if role == "worker" and rank < servers:
        raise ConfigError(f"rank {rank} runs a worker, but ranks [0, {servers}) are the "
                          "servers: put the workers after them")
    index = rank if role == "server" else rank - servers
    return Place(role, index, servers, size - servers)


class MPIJob:
    """The job's two allgathers over MPI_COMM_WORLD (see the module docstring). Each
    waits first for every rank to arrive, at most `timeout_s`: a rank that failed before
    it joined ends the job with a message rather than a hang; `end_job` ends it after a
    failure of this rank."""

    joined: MPIJob | None = None  # the job this process joined, for end_job

    def __init__(self, role: str, timeout_s: float = JOIN_TIMEOUT_S, replicas: int = 0):
        """`replicas`: a server's --replicas (a worker gives 0)."""
        from mpi4py import MPI  # only a job launched with `auto` starts MPI

        self.comm, self.timeout_s = MPI.COMM_WORLD, timeout_s
        MPIJob.joined = self
        gathered = self._allgather((role, MPI.Get_processor_name(), replicas),
                                   "the job's roles")
        self.hosts = [host for _, host, _ in gathered]
        given = sorted({n for r, _, n in gathered if r == "server"})
        if len(given) > 1:
            raise ConfigError(f"the job's servers disagree on --replicas ({given}): give "
                              "every server the same")
        self.replicas = given[0] if given else 1
        self.place = place_in([r for r, _, _ in gathered], self.comm.rank, self.hosts,
                              self.replicas)
        self._primaries: list[str] | None = None

    def _allgather(self, mine, what: str) -> list:
        arrived = self.comm.Ibarrier()
        deadline = time.monotonic() + self.timeout_s
        while not arrived.Test():
            if time.monotonic() > deadline:
                raise TimeoutError(f"not every rank of the job of {self.comm.size} came to "
                                   f"exchange {what} within {self.timeout_s:g} s: one failed "
                                   "before it joined (see its error) or is not a dtlab-pserver "
                                   "serve --rendezvous auto / dtlab-worker --servers auto")
            time.sleep(POLL_S)
        return self.comm.allgather(mine)

    def other_hosts(self) -> list[str]:
        """The host names of the ranks on other hosts than this one."""
        me = self.hosts[self.comm.rank]
        return sorted({h for h in self.hosts if h != me})

    def primaries(self, mine: str | None) -> list[str]:
        """Replicated shards: every primary's address in shard order, which a backup
        takes as --replica-of; a primary gives its own, every other rank None."""
        gathered = self._allgather((self.place.role, self.place.replica, self.place.index,
                                    mine), "the primaries' addresses")
        self._primaries = [a for _, _, _, a in sorted(
            g for g in gathered if g[0] == "server" and g[1] == 0)]
        return self._primaries

    def addresses(self, mine: str | None) -> list[str]:
        """Every shard's address in shard order (a replicated one as PRIMARY|BACKUP);
        a server gives its own, a worker None."""
        if self.replicas > 1 and self._primaries is None:
            self.primaries(None)  # a worker takes part in the primaries' exchange too
        gathered = self._allgather((self.place.role, self.place.index, self.place.replica,
                                    mine), "the servers' addresses")
        servers = sorted(g for g in gathered if g[0] == "server")
        if self.replicas == 1:
            return [a for _, _, _, a in servers]
        return ["|".join(a for _, k, _, a in servers if k == shard)
                for shard in range(self.place.servers)]


def end_job(rc: int) -> None:
    """After this rank failed (its message printed): end every rank of the MPI job it
    joined, which may wait on it in an allgather or as a server (MPI_Abort)."""
    job = MPIJob.joined
    if rc and job is not None and job.comm.size > 1:
        time.sleep(0.5)  # the other ranks' own lines get out before the abort
        job.comm.Abort(rc)


def interface_address(name: str) -> str:
    """The IPv4 address of network interface `name`; ConfigError if it has none."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError as e:
            raise ConfigError(f"--bind-interface {name}: no IPv4 address ({e.strerror})") from None
    return socket.inet_ntoa(packed[20:24])


def route_to(host: str) -> str:
    """The address of this host's interface that routes to `host` (no packet is sent)."""
    try:
        target = socket.getaddrinfo(host, 9, socket.AF_INET, socket.SOCK_DGRAM)[0][4]
    except socket.gaierror as e:
        raise ConfigError(f"cannot resolve the job's host {host!r} ({e.strerror}): give "
                          "--bind ADDR or --bind-interface NAME") from None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(target)
        return s.getsockname()[0]


def default_route_interface(routes: str = "/proc/net/route") -> str | None:
    """The interface of the IPv4 default route, None without one."""
    try:
        lines = Path(routes).read_text().splitlines()[1:]
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        if len(fields) > 1 and fields[1] == "00000000":
            return fields[0]
    return None


def bind_address(bind: str | None, interface: str, other_hosts: list[str] | None) -> str:
    """The address a job's server listens on, by the rule of the module docstring.
    `bind`: --bind when given; `other_hosts`: the job's other hosts (None: not known)."""
    if bind:
        return bind
    if interface:
        return interface_address(interface)
    if other_hosts is not None:
        if not other_hosts:
            return "127.0.0.1"
        chosen = {route_to(h) for h in other_hosts}
        if len(chosen) > 1:
            raise ConfigError(f"the job's hosts {', '.join(other_hosts)} are reached through "
                              f"different interfaces ({', '.join(sorted(chosen))}): give "
                              "--bind ADDR or --bind-interface NAME")
        return chosen.pop()
    name = default_route_interface()
    if name is None:
        raise ConfigError("no default route to pick the address other hosts reach: give "
                          "--bind ADDR or --bind-interface NAME")
    return interface_address(name)


def shard_file(directory: str, shard: int) -> Path:
    return Path(directory) / f"shard-{shard}.json"


def write_address(directory: str, shard: int, num_shards: int, address: str) -> Path:
    """DIR/shard-K.json naming `address`, written whole (a temporary file, then rename)."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    path = shard_file(directory, shard)
    tmp = root / f".shard-{shard}.json.{os.getpid()}.tmp"
    tmp.write_text(json.dumps({"shard": shard, "num_shards": num_shards, "address": address}))
    os.replace(tmp, path)
    return path


def read_addresses(directory: str, timeout_s: float, poll_s: float = 0.1) -> list[str]:
    """Every shard's address from DIR, in shard order, waiting up to `timeout_s` for the
    files; TimeoutError naming the ones still missing."""
    root = Path(directory)
    deadline = time.monotonic() + timeout_s
    found: dict[int, dict] = {}
    num_shards = None
    while True:
        for path in root.glob("shard-*.json") if root.is_dir() else []:
            k = path.stem.removeprefix("shard-")
            if k.isdigit() and int(k) not in found:
                found[int(k)] = json.loads(path.read_text())
        if 0 in found:
            num_shards = int(found[0]["num_shards"])
            bad = {k: r["num_shards"] for k, r in found.items() if r["num_shards"] != num_shards}
            if bad:
                raise ConfigError(f"{directory}: the shards disagree on --num-shards "
                                  f"(shard 0: {num_shards}, others: {bad}); stale files of "
                                  "an earlier job? use a fresh directory")
            if all(k in found for k in range(num_shards)):
                return [found[k]["address"] for k in range(num_shards)]
        if time.monotonic() > deadline:
            missing = ([f"shard-{k}.json" for k in range(num_shards) if k not in found]
                       if num_shards else ["shard-0.json (it names --num-shards)"])
            raise TimeoutError(f"--rendezvous {directory}: after {timeout_s:g} s still no "
                               f"{', '.join(missing)}: are those servers running, and is "
                               "the directory shared with them?")
        time.sleep(poll_s)
