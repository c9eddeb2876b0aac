"""MPI side of dtlab: communicators, our own collectives, the process grid,
bucketed gradient averaging and failure handling.

    from dtlab.collective import world, ProcessGrid, BucketReducer
    comm = world()                                   # abort handler installed
    comm.allreduce(x, average=True)                  # ring (ours) by default

Modules, one job each:
    comm.py      Communicator: the protocol models call (allreduce, allgather,
                 reduce_scatter, alltoallv, broadcast, send, recv, ...)
    ring.py      ring reduce-scatter + all-gather (the 4-rank walk-through)
    doubling.py  recursive doubling, the small-message all-reduce
    naive.py     reduce-to-root + broadcast baseline
    tree.py      binomial-tree broadcast
    alltoall.py  pairwise-exchange all-to-all(v)
    link.py      per-communicator state: neighbours, scratch pool, tags
    agree.py     ranks agree on buffer sizes and dtypes before a collective
    failure.py   abort on uncaught exceptions, stall watchdog
    gpu.py       GPU-aware MPI detection, host staging of device buffers
    grid.py      dp x pp x ep x tp process grid
    buckets.py   bucketed, backward-overlapped gradient all-reduce
"""

from dtlab.collective.agree import MismatchError
from dtlab.collective.buckets import BucketReducer, ReduceTiming
from dtlab.collective.comm import Communicator, world
from dtlab.collective.failure import install_abort_handler
from dtlab.collective.grid import GridError, ProcessGrid

__all__ = [
    "BucketReducer",
    "Communicator",
    "GridError",
    "MismatchError",
    "ProcessGrid",
    "ReduceTiming",
    "install_abort_handler",
    "world",
]
