"""Communication time of one training step in the alpha-beta-gamma model.

With alpha one message's latency, beta the time per byte on a link and gamma
the time to add one byte (Thakur, Rabenseifner & Gropp 2005; the same costs
collective/algorithms/choose.py orders our all-reduces by), an all-reduce of n bytes
over N ranks costs a alpha + b n beta + c n gamma, with (a, b, c):

    ring           2(N-1),      2(N-1)/N,  (N-1)/N     reduce-scatter + all-gather
    halving        2 log2 N,    2(N-1)/N,  (N-1)/N     Rabenseifner
    doubling       log2 N,      log2 N,    log2 N      recursive doubling
    shm-one-shot   1,           1,         N-1         one barrier; every rank adds N copies
    shm-two-shot   2,           2,         (N-1)/N     two barriers; rank r adds segment r
    naive          2(N-1),      2(N-1),    N-1         the root receives, adds and sends N-1
    alltoall       N-1,         (N-1)/N,   0           pairwise exchange
                                                       (collective/algorithms/alltoall.py;
                                                       n: the bytes one rank sends in all; the
                                                       MoE dispatch and combine)

"ours" is the algorithm collective/algorithms/choose.py picks for that size and N
(shared memory only when every rank is on one host, as there).

Two levels (`gpus_per_node` G > 1, M = N / G nodes), as NCCL's tree/ring
hierarchy and Horovod's hierarchical all-reduce do: reduce-scatter within
the node (G-1 alpha_i + (G-1)/G n beta_i + (G-1)/G n gamma), an all-reduce
of n/G bytes across the M nodes run by each of the G GPUs at once on its
own NIC (rail-optimised), all-gather within the node (G-1 alpha_i + (G-1)/G
n beta_i). With K < G NICs a node (`nics_per_node`), the G GPUs' cross-node all-reduces
share them: that term takes G / K times as long. The naive all-reduce is flat: its
root's link is the node's NIC.

Parameter server, S shards on hosts of their own, W workers (Li et al.
2014): every worker pushes n/S bytes to every shard and pulls n/S back; a
shard's link carries W n/S bytes each way a round, a worker's n, so

    pull = alpha + max(W/S, 1) n beta
    push = alpha + max(W/S, 1) n beta + (W/S) n gamma_apply

with gamma_apply the shard's optimizer time per byte of gradient. On one
host the S shards do not come free: a worker's per-shard work runs in one
process, so each shard beyond the first adds per_shard_s to its round
(calibrated by bench fanout; half to the pull, half to the push).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from dtlab.collective.algorithms.choose import allreduce_algorithm
from dtlab.lab.simulate.links import Link


def terms(algo: str, n_ranks: int) -> tuple[float, float, float]:
    """(a, b, c): the all-reduce of `algo` over `n_ranks` costs a alpha + b n beta + c n gamma."""
    N = n_ranks
    if N < 1:
        raise ValueError(f"an all-reduce needs at least 1 rank (got {N})")
    if N == 1:
        return 0.0, 0.0, 0.0
    lg = math.log2(N)
    return {
        "ring": (2 * (N - 1), 2 * (N - 1) / N, (N - 1) / N),
        "halving": (2 * lg, 2 * (N - 1) / N, (N - 1) / N),
        "doubling": (lg, lg, lg),
        "shm-one-shot": (1.0, 1.0, N - 1.0),
        "shm-two-shot": (2.0, 2.0, (N - 1) / N),
        "naive": (2 * (N - 1), 2 * (N - 1), N - 1.0),
        "alltoall": (N - 1.0, (N - 1) / N, 0.0),
    }[algo]


def allreduce_s(algo: str, nbytes: float, n_ranks: int, link: Link) -> float:
    a, b, c = terms(algo, n_ranks)
    return a * link.alpha_s + nbytes * (b * link.beta_s_per_byte + c * link.gamma_s_per_byte)


def ours(nbytes: float, n_ranks: int, one_host: bool) -> str:
    """The algorithm Communicator.allreduce runs (collective/algorithms/choose.py)."""
    return allreduce_algorithm(int(nbytes), n_ranks, lambda: one_host)


@dataclass(frozen=True)
class Network:
    """Where N ranks run: G per node on `intra`, nodes joined by `inter`; `per_algo`:
    calibrated constants by algorithm (a measured host), used in place of the link's."""

    intra: Link
    inter: Link
    gpus_per_node: int = 1
    per_algo: dict[str, Link] | None = None
    nics_per_node: float = 0  # 0: one NIC per GPU (rail-optimised)

    def nic_share(self, g: int) -> float:
        """How many of a node's g GPUs share one NIC (1 when each has its own)."""
        return max(1.0, g / self.nics_per_node) if self.nics_per_node else 1.0

    def link(self, algo: str, base: Link) -> Link:
        if self.per_algo and algo in self.per_algo:
            return self.per_algo[algo]
        return base


def sync_allreduce_s(kind: str, nbytes: float, n_ranks: int, net: Network,
                     one_host_shm: bool = False) -> tuple[float, str]:
    """(seconds, algorithm) of one all-reduce of `nbytes` over `n_ranks` by `kind`
    ("ring": our point-to-point family as choose.py picks it, "naive", or "mpi")."""
    if n_ranks == 1:
        return 0.0, "-"
    G = min(net.gpus_per_node, n_ranks)
    nodes = math.ceil(n_ranks / G)
    if kind in ("naive", "mpi"):  # flat; MPI's own all-reduce costed as a ring
        base = net.link(kind, net.intra if nodes == 1 else net.inter)
        return allreduce_s("naive" if kind == "naive" else "ring", nbytes, n_ranks, base), kind
    if nodes == 1:
        algo = ours(nbytes, n_ranks, one_host_shm)
        return allreduce_s(algo, nbytes, n_ranks, net.link(algo, net.intra)), algo
    inner = nbytes / G
    across = ours(inner, nodes, False)
    # reduce-scatter + all-gather within the node: together the ring's terms over G
    local = allreduce_s("ring", nbytes, G, net.intra)
    return (local + net.nic_share(G) * allreduce_s(across, inner, nodes, net.inter),
            f"2-level/{across}")


def bucketed_allreduce_s(kind: str, grad_bytes: float, bucket_bytes: float, n_ranks: int,
                         net: Network, one_host_shm: bool = False) -> tuple[float, float, str]:
    """(all buckets' seconds, the last bucket's, algorithm of the largest) for a gradient
    cut into buckets of `bucket_bytes` (collective/reducers/buckets.py), reduced one after
    another."""
    full, rest = divmod(grad_bytes, bucket_bytes)
    sizes = [bucket_bytes] * int(full) + ([rest] if rest else [])
    times = [sync_allreduce_s(kind, s, n_ranks, net, one_host_shm) for s in sizes]
    # buckets are filled from the end of the buffer: the last one reduced is the first
    # bucket of the buffer (a full one unless the gradient fits one bucket)
    return sum(t for t, _ in times), times[0][0], times[0][1]


@dataclass(frozen=True)
class RoundCPU:
    """CPU seconds of one worker's round over S shards, its side and the shards' together:
    alpha + (S - 1) per_shard + n beta (bench fanout's cpu column)."""

    alpha_s: float
    per_shard_s: float
    beta_s_per_byte: float

    def seconds(self, nbytes: float, shards: int) -> float:
        return self.alpha_s + (shards - 1) * self.per_shard_s + nbytes * self.beta_s_per_byte


@dataclass(frozen=True)
class ServerLink:
    """A parameter server's pull and push: alpha + n beta each (push: the shard's apply of
    the bench's optimizer included), plus gamma_apply per byte for the run's optimizer;
    per_shard_s: what a worker's round costs for each shard beyond the first (a host's:
    the worker's per-shard work runs in one process; 0 for shards on hosts of their own);
    cpu: the CPU a round takes on a host, where measured."""

    pull: Link
    push: Link
    gamma_apply_s_per_byte: float = 0.0
    per_shard_s: float = 0.0
    cpu: RoundCPU | None = None  # measured CPU of a round on a host, where calibrated


def pserver_s(nbytes: float, workers: int, shards: int, ps: ServerLink) -> tuple[float, float]:
    """(pull, push) seconds of one worker's round with W workers on S shards."""
    load = max(workers / shards, 1.0)
    fan = (shards - 1) * ps.per_shard_s / 2  # half of the round's per-shard cost each way
    pull = ps.pull.alpha_s + fan + load * nbytes * ps.pull.beta_s_per_byte
    push = (ps.push.alpha_s + fan + load * nbytes * ps.push.beta_s_per_byte
            + workers / shards * nbytes * ps.gamma_apply_s_per_byte)
    return pull, push
