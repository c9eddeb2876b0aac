"""The step on an emulated cluster (dtlab-compare --hosts H --link-gbit X): H network
namespaces of this one host, each host's egress shaped by a token bucket, the CPUs shared.

Placement is compare/runner.py's: rank, worker or shard i on host i mod H.
The link is the alpha-beta model of one TCP stream through the shaped qdisc
(Hockney 1994):

    beta  = 1 / (X x payload share)   tbf counts whole frames: a full segment carries
                                      MSS = MTU - 52 bytes (IPv4 20 + TCP 20 + timestamps 12)
                                      in MTU + 14 (Ethernet header) bytes of the qdisc's
    alpha = ALPHA_S                   stated, not fitted: the 1gbit TCP preset's latency
                                      (links.py); a 4 MB gradient puts it under 1% of a step
    gamma = the calibrated local all-reduce's per byte (the adds run on this host's CPUs)

Sync, one rank per host (N <= H): the all-reduce formulas of formulas.py on that
link (no shared memory: every rank is on a host of its own, as collective/algorithms/choose.py
sees it); compute is this host's, its cores shared by the N ranks (step.Host).

Async: a worker's round is pull + push (one message each way per shard, Li et
al. 2014). A shard on the worker's own host is reached without the link; a
host's link carries, in a pull phase, its shards' answers to the workers on
other hosts, and in a push phase its workers' gradients to the shards on other
hosts; under BSP a round waits for the busiest link:

    link pull = alpha + max over hosts h (sum over shards on h, workers not on h) n/S beta
    link push = alpha + max over hosts h (sum over workers on h, shards not on h) n/S beta

Each also costs its CPU side, gRPC's serialisation and copies and the shard's
apply, as the calibration's `session` path (gRPC over TCP loopback, the path a
worker takes with shared memory off) measured it (calibration_links.host_server); the
two are added (no pipelining of one message's CPU work with its transmission).
The round's CPU work is shared by the cores as step.ps_step describes; the
link's time is not CPU work.
"""

from __future__ import annotations

from dataclasses import dataclass

from dtlab.lab.simulate.calibration_links import host_server
from dtlab.lab.simulate.formulas import Network, pserver_s
from dtlab.lab.simulate.links import Link
from dtlab.lab.simulate.step import Host, Step, Workload, sync_step
from dtlab.models.config import ConfigError

ALPHA_S = 50e-6  # links.PRESETS["1gbit"]: a typical TCP one-message latency
MTU = 1500  # the veth pair's (cluster.py leaves the default)
FRAME_BYTES = MTU + 14  # what tbf counts of a full segment: the Ethernet header too
MSS = MTU - 52  # IPv4 + TCP headers + the timestamp option
TCP_PATH = "session"  # pserver's default transport; --no-shm leaves it on TCP


@dataclass(frozen=True)
class Cluster:
    """H emulated hosts, each host's egress shaped to `gbit`."""

    hosts: int
    gbit: float

    def link(self, cal: dict) -> Link:
        gamma = cal["allreduce"].get("ring", {}).get("beta_s_per_byte", 0.0)
        payload_rate = self.gbit * 1e9 / 8 * MSS / FRAME_BYTES  # bytes of payload per s
        return Link(f"emulated {self.gbit:g} Gbit/s", ALPHA_S, 1 / payload_rate, gamma)

    def describe(self, cal: dict) -> str:
        link = self.link(cal)
        return (f"{self.hosts} emulated hosts at {self.gbit:g} Gbit/s: alpha "
                f"{link.alpha_s * 1e6:g} us (stated), payload {MSS}/{FRAME_BYTES} of the rate")

    def check(self, ranks: int) -> None:
        if ranks > self.hosts:
            raise ConfigError(f"the emulated-cluster model takes one rank or worker per host: "
                              f"N = {ranks} on {self.hosts} hosts is not modelled")

    def crossing(self, workers: int, shards: int) -> tuple[float, float]:
        """(pull, push): the busiest host link's bytes in that phase, as a fraction of the
        gradient (module docstring)."""
        H = self.hosts
        pull = max(sum(1 for k in range(shards) if k % H == h)
                   * sum(1 for w in range(workers) if w % H != h) for h in range(H))
        push = max(sum(1 for w in range(workers) if w % H == h)
                   * sum(1 for k in range(shards) if k % H != h) for h in range(H))
        return pull / shards, push / shards


def sync_step_on(cluster: Cluster, kind: str, w: Workload, n: int, cal: dict,
                 compute_s: float, bucket_bytes: float, host: Host,
                 straggler_s: float = 0.0) -> Step:
    cluster.check(n)
    link = cluster.link(cal)
    # every rank on a host of its own: the flat algorithms on the shaped link (one level:
    # the ranks as one group on it, no shared memory between them)
    return sync_step(kind, w, n, Network(link, link, gpus_per_node=n), compute_s, bucket_bytes,
                     host, straggler_s)


def ps_step_on(cluster: Cluster, w: Workload, workers: int, shards: int, cal: dict,
               compute_s: float, host: Host, straggler_s: float = 0.0) -> Step:
    """compute_s: a worker's step with its cores to itself; straggler_s: under BSP the
    slowest worker's delay."""
    cluster.check(workers)
    link = cluster.link(cal)
    cpu_pull, cpu_push = pserver_s(w.grad_bytes, workers, shards,
                                   host_server(cal, w.optimizer, TCP_PATH))
    pull_share, push_share = cluster.crossing(workers, shards)
    link_pull = link.alpha_s + pull_share * w.grad_bytes * link.beta_s_per_byte
    link_push = link.alpha_s + push_share * w.grad_bytes * link.beta_s_per_byte
    own = compute_s + straggler_s + cpu_pull + cpu_push  # the critical path's CPU parts
    links = link_pull + link_push
    # the round takes the longer of its critical path and its CPU work over the cores; the
    # CPU parts stretch to make up the difference, the link's time is no CPU work
    work = workers * (compute_s + cpu_pull + cpu_push) / host.cores if host.cores else 0.0
    stretch = max(1.0, (work - links) / own)
    pull, push = stretch * cpu_pull + link_pull, stretch * cpu_push + link_push
    return Step("ps", workers, stretch * compute_s, stretch * straggler_s + pull + push,
                f"S={shards}", {"pull_s": pull, "push_s": push, "link_pull_s": link_pull,
                                "link_push_s": link_push, "straggler_s": stretch * straggler_s,
                                "cpu_bound": stretch > 1})
