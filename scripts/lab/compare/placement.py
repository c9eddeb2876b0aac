"""Where a comparison's processes run (dtlab-compare --launcher), and the one rule
that places them on hosts.

    local     this host: mpiexec -n N for the ranks, each async run's servers as
              daemons on loopback ports (shared memory on)
    emulated  --hosts H emulated hosts (compare/cluster.py, --link-gbit X)
    mpiexec   real hosts, --hosts a,b,...: MPICH's Hydra over ssh
                  mpiexec -launcher ssh -hosts a,b -rankmap 0,1,0,1 -n N dtlab-sync ...
    srun      the nodes of the current Slurm allocation (SLURM_JOB_NODELIST), srun
                  SLURM_HOSTFILE=OUT/NAME.hosts srun -n N --distribution=arbitrary ...

The placement rule, on H hosts (`rank_hosts`, `async_hosts`; the emulated hosts'
too, compare/runner.py): rank r of a sync run on host (r // T) mod H, where T is
--tp (a tensor-parallel group stays on one host); an async run's shard k on host
k mod H and its worker ranks as a sync run's ranks. Hydra takes the host of every
rank by -rankmap (node indices into -hosts), srun by --distribution=arbitrary
from the file SLURM_HOSTFILE names (one node per task, in task order).

Under mpiexec and srun an async run is one job, its servers first
(pserver/common/rendezvous.py): mpiexec's MPMD line `-n S dtlab-pserver serve
--rendezvous auto : -n W dtlab-worker --servers auto` (addresses by two MPI
allgathers), srun's `--multi-prog OUT/NAME.conf` with the addresses through the
rendezvous directory OUT/NAME.rv (OUT must be on a file system every node
shares, as the metrics already need). Each server listens on the address of its
interface that routes to the other hosts (never a wildcard); shared memory is
used only between a worker and a server of one host. srun's --mpi is the
site's default (SLURM_MPI_TYPE). A worker group (--tp/--pp) would take the
servers into its MPI world there, so async runs with --tp/--pp are refused.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from dtlab.models.config import ConfigError

LAUNCHERS = ("local", "emulated", "mpiexec", "srun")


def rank_hosts(ranks: int, block: int, hosts: int) -> list[int]:
    """The host index of each of `ranks` ranks: blocks of `block` consecutive ranks,
    block b on host b mod `hosts`."""
    return [(r // block) % hosts for r in range(ranks)]


def async_hosts(shards: int, worker_ranks: int, block: int, hosts: int) -> list[int]:
    """The host index of each rank of an async job, its servers first: shard k on host
    k mod `hosts`, then the worker ranks as `rank_hosts` places them."""
    return [k % hosts for k in range(shards)] + rank_hosts(worker_ranks, block, hosts)


def expand_nodelist(nodelist: str) -> list[str]:
    """Slurm's compressed host list ("gpu[01-03,07],login1", "n[1-2]-ib[3-4]") as names."""
    names, depth, start = [], 0, 0
    for i, ch in enumerate(nodelist + ","):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            if nodelist[start:i]:
                names += _expand_one(nodelist[start:i])
            start = i + 1
    return names


def _expand_one(pattern: str) -> list[str]:
    m = re.search(r"\[([^\]]*)\]", pattern)
    if m is None:
        return [pattern]
    head, tail = pattern[:m.start()], pattern[m.end():]
    out = []
    for part in m.group(1).split(","):
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise ConfigError(f"SLURM_JOB_NODELIST {pattern!r}: cannot read range {part!r}")
        for n in range(int(lo), int(hi or lo) + 1):
            out += _expand_one(f"{head}{n:0{len(lo)}d}{tail}")
    return out


@dataclass
class Hosts:
    """Real hosts and the launcher that starts processes on them (mpiexec or srun)."""

    kind: str  # "mpiexec" | "srun"
    names: list[str]
    mpiexec: str = "mpiexec"
    env: dict[str, str] = field(default_factory=dict)

    def describe(self) -> str:
        how = "Hydra over ssh" if self.kind == "mpiexec" else "srun in Slurm job " + \
            self.env.get("SLURM_JOB_ID", os.environ.get("SLURM_JOB_ID", "?"))
        return f"{len(self.names)} hosts {', '.join(self.names)} ({self.kind}: {how})"

    def line(self, programs: list[tuple[int, list[str]]], placed: list[int], out: Path,
             name: str) -> tuple[list[str], dict[str, str]]:
        """The command line (and its environment) that runs `programs`, each (processes,
        command), as one job whose rank r runs on host placed[r]; srun's files go to
        OUT/NAME.hosts and OUT/NAME.conf."""
        if self.kind == "mpiexec":
            cmd = [self.mpiexec, "-launcher", "ssh", "-hosts", ",".join(self.names),
                   "-rankmap", ",".join(map(str, placed))]
            for i, (n, prog) in enumerate(programs):
                cmd += [*([":"] if i else []), "-n", str(n), *prog]
            return cmd, {}
        hostfile = out / f"{name}.hosts"
        hostfile.write_text("".join(f"{self.names[h]}\n" for h in placed))
        cmd = ["srun", "-n", str(len(placed)), "--distribution=arbitrary", "--overcommit",
               "--kill-on-bad-exit=1"]
        if len(programs) == 1:
            return [*cmd, *programs[0][1]], {"SLURM_HOSTFILE": str(hostfile)}
        conf, first = out / f"{name}.conf", 0
        lines = []
        for n, prog in programs:
            lines.append(f"{first}-{first + n - 1} {shlex.join(prog)}\n")
            first += n
        conf.write_text("".join(lines))
        return [*cmd, "--multi-prog", str(conf)], {"SLURM_HOSTFILE": str(hostfile)}


def mpiexec_hosts(given: str, mpiexec: str) -> Hosts:
    """--launcher mpiexec --hosts a,b,...; ConfigError where the list is not names."""
    names = [h.strip() for h in given.split(",") if h.strip()]
    if not names or given.strip().isdigit():
        raise ConfigError(f"--launcher mpiexec --hosts {given!r}: give the hosts' names "
                          "(--hosts a,b,...), reachable by ssh without a password")
    if len(set(names)) != len(names):
        raise ConfigError(f"--hosts {given}: a host is named twice")
    return Hosts("mpiexec", names, mpiexec)


def srun_hosts(env: dict[str, str] | None = None) -> Hosts:
    """--launcher srun: the current allocation's nodes, from its environment; ConfigError
    outside one or without srun."""
    env = os.environ if env is None else env
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not env.get("SLURM_JOB_ID") or not nodelist:
        raise ConfigError("--launcher srun runs inside a Slurm allocation (sbatch or salloc): "
                          "SLURM_JOB_ID / SLURM_JOB_NODELIST are not set")
    if shutil.which("srun", path=env.get("PATH")) is None:
        raise ConfigError("--launcher srun: no srun on PATH")
    return Hosts("srun", expand_nodelist(nodelist),
                 env={k: env[k] for k in ("SLURM_JOB_ID",) if k in env})
