"""The order of the ranks around the ring: neighbours share a node, then a CPU.

Ranks on the same node are adjacent (nodes in order of their lowest rank),
and within a node ranks bound to one CPU each are ordered by that CPU, so
ring neighbours share a core or cache where the launcher packed them
(`mpiexec -bind-to core`); unbound ranks keep rank order. NCCL likewise
orders its rings by topology, so that on a cluster most hops stay inside a
node.
"""

from __future__ import annotations

import os

from mpi4py import MPI


def ring_order(comm: MPI.Comm) -> tuple[list[int], int]:
    """(ranks in ring order, this rank's position in it); collective."""
    affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
    cpu = min(affinity) if len(affinity) == 1 else -1
    keys = comm.allgather((MPI.Get_processor_name(), cpu))
    first_rank: dict[str, int] = {}
    for r, (node, _) in enumerate(keys):
        first_rank.setdefault(node, r)
    order = sorted(range(len(keys)), key=lambda r: (first_rank[keys[r][0]], keys[r][1], r))
    return order, order.index(comm.Get_rank())
