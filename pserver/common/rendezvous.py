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

A program of the job that fails before or during the rendezvous ends the whole
job within seconds, its own line printed first (`end_job`, run by both programs'
error path). Under mpiexec (`auto`) every rank waits in MPI_Init until all have
started MPI, so a program that failed before it did (a bad flag, a worker given no
--servers) starts MPI itself, at most ABORT_START_S, and calls MPI_Abort, which
ends every rank; a rank that joined calls MPI_Abort directly. A rank that waits
for the others gives up after its join timeout (MPI_Init and each exchange
bounded), so a program that takes no part in the rendezvous ends the job too,
later. In a folder (`DIR`) the failing program writes DIR/failed-<rank>.json
({"rank", "status", "line", "job", "time"}); the workers waiting for the shard
files and the servers waiting for their workers look for it at every poll and end
with its line (`JobFailed`). A file of another job (Slurm's job and step ids, or,
without them, written over STALE_S before this process started) is not read.

The address a server binds (`bind_address`): --bind ADDR, else the IPv4 address
of --bind-interface NAME, else the address of the interface that routes to the
other ranks' hosts (every rank on this host: 127.0.0.1), else, not knowing
them (a directory), the default route's interface's. Never a wildcard by
default: 0.0.0.0 listens on every network, so give it by hand, with a token or TLS.
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import socket
import struct
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from dtlab.models.config import ConfigError
from dtlab.models.run.cli import command_name
from dtlab.models.run.launcher_env import RANK_VARS, SIZE_VARS, first_int, who

SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address
JOIN_TIMEOUT_S = 120.0  # how long a rank waits for the job's others at an allgather
POLL_S = 0.01  # between tests of a pending barrier (MPICH would spin a core otherwise)
ABORT_START_S = 10.0  # how long a program that failed before MPI started waits to start it
STALE_S = 60.0  # a failed-<rank>.json from before this process started, by more, is stale
STARTED = time.time()  # about when this process started (the programs import this first)
MPI_LAUNCH = (("PMI_RANK", "PMI_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"))
PROGRAMS = {"server": ("dtlab.pserver", " serve"), "worker": ("dtlab.pserver.worker", "")}


class JobFailed(RuntimeError):
    """Another program of the job failed; the message carries its line."""

    seen = False  # whether this process read another program's failure


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
        MPI = start_mpi(timeout_s, f"{program(role)}: {who()}error: MPI did not start "
                        f"within {timeout_s:g} s: every rank of the job waits in MPI_Init for "
                        "all the others; one failed before it started MPI (see its error) or "
                        "runs a program that takes no part in the rendezvous")
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


def start_mpi(timeout_s: float, late: str, status: int = 1):
    """mpi4py's MPI, started (MPI_Init) within `timeout_s`, else `late` said and exit
    `status`: MPI_Init waits for every rank of the job, so a rank that never starts MPI
    holds it for good. MPI_Init_thread is called through ctypes, which lets go of the GIL
    while it waits (mpi4py's own start holds it), so the timer can run; mpi4py then
    finalizes at exit as if it had started MPI itself."""
    import mpi4py

    if "mpi4py.MPI" not in sys.modules:
        mpi4py.rc.initialize, mpi4py.rc.finalize = False, True
    from mpi4py import MPI

    if MPI.Is_initialized():
        return MPI

    def give_up():
        sys.stderr.write(late + "\n")
        sys.stderr.flush()
        os._exit(status)

    timer = threading.Timer(timeout_s, give_up)
    timer.daemon = True
    timer.start()
    provided = ctypes.c_int()
    try:  # the extension's handle finds the symbol in the libmpi it links
        error = ctypes.CDLL(MPI.__file__).MPI_Init_thread(None, None, MPI.THREAD_MULTIPLE,
                                                          ctypes.byref(provided))
    finally:
        timer.cancel()
    if error:
        raise RuntimeError(f"MPI_Init_thread failed with error code {error}")
    MPI.COMM_WORLD.Set_errhandler(MPI.ERRORS_RETURN)  # errors as exceptions, as mpi4py's
    return MPI


def program(role: str) -> str:
    """The command this process runs as the user typed it, for its lines."""
    module, command = PROGRAMS[role]
    return command_name(module) + command


def flag_value(argv: list[str], flag: str) -> str | None:
    """The value of `flag` in `argv` as argparse reads it (`--f V` or `--f=V`, the last
    one winning), read without the parser: the flags may be what failed."""
    value = None
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(flag + "="):
            value = arg[len(flag) + 1:]
    return value


def mpi_member(role: str, argv: list[str], env=None) -> bool:
    """Whether this program, launched by mpiexec as one of several ranks, was to join the
    job's MPI rendezvous: a server given --rendezvous auto; a worker given neither
    --servers HOST:PORT,... nor a rendezvous folder (given no --servers at all, in an MPMD
    job it leaves servers waiting)."""
    env = os.environ if env is None else env
    if not any(env_int(env, (rank,)) is not None and (env_int(env, (size,)) or 0) > 1
               for rank, size in MPI_LAUNCH):
        return False
    where = flag_value(argv, "--rendezvous")
    if role == "server":
        return where == "auto"
    return flag_value(argv, "--servers") in (None, "auto") and where in (None, "auto")


def end_job(status: int, line: str, role: str, argv: list[str] | None = None) -> None:
    """After this program failed with exit `status` (its `line` printed): end every other
    program of its job, which may wait on it (the module docstring). MPI: MPI_Abort, MPI
    started first if this program failed before it did; a folder: DIR/failed-<rank>.json,
    unless another program's failure ended this one."""
    argv = sys.argv[1:] if argv is None else argv
    if not status:
        return
    if MPIJob.joined is not None:
        comm = MPIJob.joined.comm
    elif mpi_member(role, argv):
        comm = start_mpi(ABORT_START_S, f"{program(role)}: {who()}could not start MPI within "
                         f"{ABORT_START_S:g} s to end the job", status).COMM_WORLD
    else:
        where = flag_value(argv, "--rendezvous")
        if where not in (None, "", "auto") and not JobFailed.seen:
            try:
                write_failure(where, status, line)
            except OSError as e:
                sys.stderr.write(f"{program(role)}: {who()}could not tell the job's others "
                                 f"through {where}: {e}\n")
        return
    if comm.size > 1:
        time.sleep(0.5)  # the other ranks' own lines get out before the abort
        comm.Abort(status)


def job_id(env=None) -> str:
    """Slurm's job and step of this process ("" outside Slurm): a folder's failure files
    name the job that wrote them."""
    env = os.environ if env is None else env
    if "SLURM_JOB_ID" not in env:
        return ""
    return f"{env['SLURM_JOB_ID']}.{env.get('SLURM_STEP_ID', '')}"


def write_failure(directory: str, status: int, line: str) -> Path:
    """DIR/failed-<rank>.json: this program's failure, for the job's others to read."""
    rank = env_int(os.environ, RANK_VARS)
    name = f"failed-{rank if rank is not None else f'pid{os.getpid()}'}.json"
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".{name}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps({"rank": rank, "status": status, "line": line or
                               f"{' '.join(sys.argv)}: exit status {status}",
                               "job": job_id(), "time": time.time()}))
    os.replace(tmp, root / name)
    return root / name


def peer_failure(directory: str) -> str | None:
    """The first failure of this job written into DIR by another program (its line, the
    file and exit status), None while there is none; remembered (`JobFailed.seen`), so
    that this program, ending on it, writes no failure of its own."""
    mine, found = job_id(), []
    for path in Path(directory).glob("failed-*.json"):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # a file of another kind, or gone
        theirs = record.get("job", "")
        this_job = theirs == mine if theirs and mine else \
            record.get("time", 0) >= STARTED - STALE_S
        if not this_job:
            continue  # an earlier job's
        found.append((record.get("time", 0), path, record))
    if not found:
        return None
    _, path, record = min(found)
    JobFailed.seen = True
    return f"{record['line']} (exit status {record['status']}; {path})"


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
    files; TimeoutError naming the ones still missing, JobFailed once another program of
    the job wrote its failure there."""
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
        failed = peer_failure(directory) if root.is_dir() else None
        if failed:
            raise JobFailed(f"--rendezvous {directory}: the job ended: {failed}")
        if time.monotonic() > deadline:
            missing = ([f"shard-{k}.json" for k in range(num_shards) if k not in found]
                       if num_shards else ["shard-0.json (it names --num-shards)"])
            raise TimeoutError(f"--rendezvous {directory}: after {timeout_s:g} s still no "
                               f"{', '.join(missing)}: are those servers running, and is "
                               "the directory shared with them?")
        time.sleep(poll_s)
