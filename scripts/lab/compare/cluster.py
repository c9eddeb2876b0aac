"""An emulated cluster on one machine: hosts as network namespaces, links shaped by tc.

    with EmulatedCluster(hosts=2, gbit=1.0, work=out) as cluster:
        mpiexec_args, env = cluster.mpiexec_args(), cluster.env
        server = ["ip", "netns", "exec", cluster.namespace(0), *serve_cmd]
        cluster.bytes_sent()                     # per host, from the qdisc counters

Host i is the network namespace <name>-h<i> with one interface, eth0, at
10.<a>.<b>.(i + 1)/24, joined to the others by a veth pair on the bridge
<name>-br, whose own address (.254) is where mpiexec listens (`-iface`).
Each host's egress is shaped by a token bucket (`tc qdisc ... tbf rate X`):
netem is not available on every kernel, tbf is. MPICH's Hydra starts its
proxies through `-launcher ssh -launcher-exec <script>`: the script enters
the host's namespace, and `unshare --uts` gives it its own hostname, so MPI
sees one node per host (no shared-memory path between them, our
collectives' MPI-3 windows included), and `unshare --mount` its own boot id
(a file bound over /proc/sys/kernel/random/boot_id), so the parameter
server's shared memory, which it offers only within one boot of one kernel,
is never used between hosts, as between machines. Each host resolves every
host's name (/etc/netns/<ns>/hosts, which `ip netns exec` binds over
/etc/hosts, as a cluster's DNS would) and has a default route through the
bridge: a job's servers find the address the other hosts reach them on by
the rule of pserver/common/rendezvous.py, as on real hosts. UCX_TLS=tcp,self keeps the wheel's
UCX off shared memory: with `sm` listed, UCX would move data between
namespaces of one kernel without ever touching the link. The qdisc byte
counters show the bytes did cross it. Each host owns an equal share of the
machine's CPUs (`taskset`): its processes size their BLAS threads by them
(models/run/threads.py reads the affinity), where otherwise every host would
count all the machine's cores and the hosts' threads would fight over them.

Each host's TCP congestion control is set (`tcp_cc`, default reno; a namespace
otherwise inherits the machine's): a loss-based one keeps the shaped link
busy, which is what the cost model's alpha-beta link assumes. BBR, this
project's machine's default, paces by the bandwidth it estimates from ACKs,
and in the parameter server's two-way rounds those ACKs queue behind the
other direction's data: it left a round at 0.1 Gbit/s anywhere from the
link's 359 ms to 900 ms (worker medians 375-410 ms in 40-step runs, 400-520
ms in 60-step ones, where reno gave 359 ms in every step; 2026-12-01,
dtlab-compare --hosts 2 --link-gbit 0.1 --tcp-cc bbr against reno).
Linux's usual default, cubic, is loss-based too but not allowed in this
project's container; `check_congestion_control()` says whether one is.

Everything made is removed on exit, after a failure too: processes left in
a namespace (SIGKILL), the namespaces, the bridge (the veths go with their
namespaces). Needs root and iproute2; `check()` names what is missing.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import uuid
from pathlib import Path

LAUNCHER = """#!/bin/sh
# Hydra's launcher, called as ssh would be: options (-x ...), the host, then a command
# line that a remote shell would parse. The host is a network namespace of this machine,
# its processes pinned to the host's own CPUs.
while [ "${1#-}" != "$1" ]; do shift; done
host="$1"; shift
case "$host" in
%(cpus)s
esac
exec ip netns exec "%(prefix)s-$host" taskset -c "$cpus" unshare --uts --mount sh -c \
    "mount --bind %(work)s/boot-id-$host /proc/sys/kernel/random/boot_id; hostname $host; $*"
"""
BURST = "256kb"  # tbf bucket: a few packets' worth at 1 Gbit/s
LATENCY = "50ms"  # tbf queue limit, as time
NETNS_ETC = Path("/etc/netns")  # ip netns exec binds NETNS_ETC/<ns>/FILE over /etc/FILE


# where iproute2 lives on machines whose PATH lacks the admin folders (a container's root)
SBIN = ("/usr/sbin", "/sbin")


def tool_path() -> str:
    """PATH with the admin folders appended where missing: the commands the cluster runs
    (ip, tc, unshare) and the processes it starts find them there."""
    parts = os.environ.get("PATH", "").split(os.pathsep)
    return os.pathsep.join([*parts, *(d for d in SBIN if d not in parts)])


def check() -> str:
    """'' when this machine can build an emulated cluster, else why not."""
    if os.geteuid() != 0:
        return "emulated hosts need root (network namespaces, tc)"
    missing = [tool for tool in ("ip", "tc", "unshare")
               if shutil.which(tool, path=tool_path()) is None]
    if missing:
        return f"emulated hosts need iproute2 and util-linux: {', '.join(missing)} not found"
    return ""


def check_congestion_control(name: str) -> str:
    """'' when the hosts may be given TCP congestion control `name` here ('host': the
    machine's own, always), else why not (the kernel's allowed list named)."""
    path = Path("/proc/sys/net/ipv4/tcp_allowed_congestion_control")
    allowed = path.read_text().split() if path.exists() else []
    if name == "host" or name in allowed:
        return ""
    return f"not allowed on this machine (allowed: {' '.join(allowed) or 'none listed'}; or 'host')"


def _run(*cmd: str) -> str:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"{' '.join(cmd)}: {r.stderr.strip() or r.returncode}")
    return r.stdout


def kill_in(namespace: str) -> int:
    """SIGKILL every process in network namespace `namespace`; how many there were."""
    pids = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True,
                          text=True).stdout.split()
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, ValueError):
            os.kill(int(pid), signal.SIGKILL)
    return len(pids)


class EmulatedCluster:
    """`hosts` hosts, each one's egress at `gbit` Gbit/s and its TCP congestion control
    `tcp_cc` ("host": the machine's own); files go to `work`."""

    def __init__(self, hosts: int, gbit: float, work: Path, tcp_cc: str = "reno"):
        if hosts < 2:
            raise ValueError(f"an emulated cluster needs at least 2 hosts (got {hosts})")
        if not gbit > 0:
            raise ValueError(f"the link rate must be positive (got {gbit} Gbit/s)")
        if why := check_congestion_control(tcp_cc):
            raise ValueError(f"TCP congestion control {tcp_cc!r}: {why}")
        self.hosts, self.gbit, self.work, self.tcp_cc = hosts, gbit, Path(work), tcp_cc
        tag = os.getpid() % 60000
        self.prefix = f"dtl{tag}"  # interface names stay under 15 characters
        self.subnet = f"10.{200 + tag // 256 % 50}.{tag % 256}"
        self.bridge = f"{self.prefix}-br"
        self.launcher = self.work / "netns-launcher.sh"
        self.made: list[str] = []  # namespaces made, for cleanup

    def namespace(self, host: int) -> str:
        return f"{self.prefix}-h{host}"

    def address(self, host: int) -> str:
        return f"{self.subnet}.{host + 1}"

    @property
    def host_names(self) -> list[str]:
        return [f"h{i}" for i in range(self.hosts)]

    def __enter__(self) -> EmulatedCluster:
        os.environ["PATH"] = tool_path()  # for ip, tc and every process started in a host
        try:
            _run("ip", "link", "add", self.bridge, "type", "bridge")
            _run("ip", "addr", "add", f"{self.subnet}.254/24", "dev", self.bridge)
            _run("ip", "link", "set", self.bridge, "up")
            for i in range(self.hosts):
                ns, veth = self.namespace(i), f"{self.prefix}-v{i}"
                _run("ip", "netns", "add", ns)
                self.made.append(ns)
                _run("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0",
                     "netns", ns)
                _run("ip", "link", "set", veth, "master", self.bridge)
                _run("ip", "link", "set", veth, "up")
                _run("ip", "-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", "eth0")
                _run("ip", "-n", ns, "link", "set", "eth0", "up")
                _run("ip", "-n", ns, "link", "set", "lo", "up")
                _run("ip", "-n", ns, "route", "add", "default", "via", f"{self.subnet}.254")
                if self.tcp_cc != "host":
                    _run("ip", "netns", "exec", ns, "sysctl", "-qw",
                         f"net.ipv4.tcp_congestion_control={self.tcp_cc}")
                _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "eth0", "root",
                     "tbf", "rate", f"{self.gbit * 1000:g}mbit", "burst", BURST,
                     "latency", LATENCY)
            self.work.mkdir(parents=True, exist_ok=True)
            names = "".join(f"{self.address(i)} {h}\n" for i, h in enumerate(self.host_names))
            for i, h in enumerate(self.host_names):
                (NETNS_ETC / self.namespace(i)).mkdir(parents=True, exist_ok=True)
                (NETNS_ETC / self.namespace(i) / "hosts").write_text(
                    f"127.0.0.1 localhost\n{names}")
                (self.work / f"boot-id-{h}").write_text(f"{uuid.uuid4()}\n")
            cases = "\n".join(f"  {h}) cpus={self.cpu_list(i)} ;;"
                              for i, h in enumerate(self.host_names))
            self.launcher.write_text(LAUNCHER % {"prefix": self.prefix, "cpus": cases,
                                                "work": self.work.resolve()})
            self.launcher.chmod(0o755)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Kill what runs in the namespaces, delete them and the bridge."""
        for ns in self.made:
            kill_in(ns)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            shutil.rmtree(NETNS_ETC / ns, ignore_errors=True)
        self.made.clear()
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)

    def kill(self, host: int) -> int:
        """Host `host` dies: every process in it killed (SIGKILL); how many there were."""
        return kill_in(self.namespace(host))

    def mpiexec_args(self, slots: int = 1) -> list[str]:
        """Hydra flags that put ranks round-robin on the hosts in blocks of `slots`
        consecutive ranks, block b on host b mod H, through the namespace launcher."""
        return ["-iface", self.bridge, "-launcher", "ssh", "-launcher-exec",
                str(self.launcher), "-hosts", ",".join(f"{h}:{slots}" if slots > 1 else h
                                                       for h in self.host_names)]

    @property
    def env(self) -> dict[str, str]:
        return {"UCX_TLS": "tcp,self"}

    def cpus(self, host: int) -> list[int]:
        """The CPUs of this machine that host `host` owns: an equal share of them (one
        each, shared round-robin, when there are more hosts than CPUs). A host's
        processes see only these (their affinity), so each sizes its threads by its own
        host's cores, as on separate machines, instead of every host counting them all."""
        every = sorted(os.sched_getaffinity(0))
        if self.hosts > len(every):
            return [every[host % len(every)]]
        k = len(every) // self.hosts
        return every[host * k:(host + 1) * k]

    def cpu_list(self, host: int) -> str:
        return ",".join(map(str, self.cpus(host)))

    def in_host(self, host: int, cmd: list[str]) -> list[str]:
        """`cmd` run inside host `host`, on its CPUs."""
        return ["ip", "netns", "exec", self.namespace(host), "taskset", "-c",
                self.cpu_list(host), *cmd]

    def bytes_sent(self) -> list[int]:
        """Bytes each host's shaped link has sent so far (its qdisc's counter)."""
        out = []
        for i in range(self.hosts):
            text = _run("ip", "netns", "exec", self.namespace(i), "tc", "-s", "qdisc", "show",
                        "dev", "eth0")
            out.append(int(re.search(r"Sent (\d+) bytes", text).group(1)))
        return out

    def congestion_control(self) -> str:
        """The TCP congestion control the hosts run, read back from host 0."""
        return _run("ip", "netns", "exec", self.namespace(0), "sysctl", "-n",
                    "net.ipv4.tcp_congestion_control").strip()

    def describe(self) -> str:
        cpus = "; ".join(f"host {i} CPUs {self.cpu_list(i)}" for i in range(self.hosts))
        return (f"{self.hosts} emulated hosts (network namespaces on a bridge), each link "
                f"shaped to {self.gbit:g} Gbit/s by tc tbf; TCP congestion control "
                f"{self.congestion_control()}; MPI over TCP (UCX_TLS=tcp,self); {cpus}")
