"""MPI side of dtlab: communicators, our own collectives, the process grid,
bucketed gradient averaging and failure handling.

    from dtlab.collective import world, ProcessGrid, BucketReducer
    comm = world()                                   # abort handler installed
    comm.allreduce(x, average=True)                  # ring (ours) by default

Modules, one job each:
    comm.py      Communicator: the protocol models call (allreduce, allgather,
                 reduce_scatter, alltoallv, broadcast, send, recv, ...)
    choose.py    which all-reduce runs, by size, world size and node
    ring.py      ring reduce-scatter + all-gather (the 4-rank walk-through)
    halving.py   Rabenseifner's halving-doubling
    doubling.py  recursive doubling, the small-message all-reduce
    fold.py      folding a world that is not a power of two
    steps.py     step lists on persistent requests (doubling, halving)
    shm.py       shared-memory all-reduce within a node (one- and two-shot)
    naive.py     reduce-to-root + broadcast baseline
    tree.py      binomial-tree broadcast
    alltoall.py  pairwise-exchange all-to-all(v)
    link.py      per-communicator state: neighbours, tags, raw-byte messages
    scratch.py, pages.py, order.py, waits.py, bindings.py
                 scratch pool, page-offset buffers, ring order, wait policy,
                 request caches
    agree.py     ranks agree on buffer sizes and dtypes before a collective
    failure.py   abort on uncaught exceptions, stall watchdog
    gpu.py       GPU-aware MPI detection, host staging of device buffers
    grid.py      dp x pp x ep x tp process grid
    buckets.py   bucketed, backward-overlapped gradient all-reduce
    train.py     dtlab-sync: synchronous data-parallel training
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
