"""The sync topology on MPI: communicators that models call, our own collectives
(the ring and its relatives, chosen by size), the dp x pp x ep x tp process grid,
bucketed gradient averaging overlapped with backward, failure handling, and the
synchronous trainer `dtlab-sync`. ARCHITECTURE.md maps its modules.

    from dtlab.collective import world, ProcessGrid, BucketReducer
    comm = world()                                   # abort handler installed
    comm.allreduce(x, average=True)                  # ours, chosen by size

The names below load on first use, so what needs no MPI (collective.algorithms.choose, which
the cost model reads) imports without mpi4py.
"""

import importlib

import dtlab.models  # noqa: F401 - first: its BLAS thread setting must precede NumPy's import

_WHERE = {
    "MismatchError": "transport.agree",
    "BucketReducer": "reducers.buckets", "ReduceTiming": "reducers.buckets",
    "Communicator": "comm", "world": "comm",
    "install_abort_handler": "transport.failure",
    "GridError": "grid", "ProcessGrid": "grid",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'dtlab.collective' has no attribute {name!r}")
    return getattr(importlib.import_module(f"dtlab.collective.{_WHERE[name]}"), name)
