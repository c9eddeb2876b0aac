"""Which cores this process's helper threads compute on: each on a core of its own.

dtlab computes a training step on the calling thread and T - 1 helpers: the BLAS's
worker threads, and the pool that runs the other blocks of layers.in_blocks' passes and
attention's heads. Helper i of the BLAS and thread i of a pool take turns (a pass's
blocks run between the matmuls, and attention runs the BLAS on one thread), so
`bind_helpers(cores)` gives both the core cores[i % len(cores)], as OMP_PROC_BIND=close
places OpenMP's threads. Left to the scheduler, a helper woken for the next matmul or
block can land on the caller's core and wait for it, or move between cores. On a 2-vCPU
KVM guest whose idle cores halt at once, binding the helper to the core the caller
leaves free took the small transformer's step from 14.0 to 13.0 ms (torch/dtlab 0.91 to
1.01, `dtlab-bench model` with DTLAB_BIND_HELPERS=0 and without; scripts/RESULTS.md,
stop 46), and no size slower.

The caller is left unbound: every thread it starts later (gRPC's, MPI's, another
library's pool) inherits its mask, and would share one core. models/run/threads.py binds
the helpers only where the process owns its cores (alone on its host, or given a mask by
the launcher); several processes that each think they own the host would all crowd their
helpers onto the same cores.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import threading

_CORES: list[tuple[int, ...]] = [()]  # the helpers' cores; () leaves them to the scheduler
_POOL_THREADS: dict[tuple, list[int]] = {}  # (process id, pool's workers): ids, in start order
_STARTING = threading.Lock()
_CAN_BIND = hasattr(os, "sched_setaffinity")  # Linux
_BLAS_BOUND = [0]  # the BLAS's workers the last call bound (unbound again when () comes)


def bind_helpers(cores: tuple[int, ...], blas) -> str:
    """Bind the BLAS's worker i and every pool's thread i (now, or when it starts) to
    cores[i % len]; () unbinds them. `blas`: threadpoolctl's controller of NumPy's BLAS,
    or None. Returns what was done, for the run's header."""
    _CORES[0] = tuple(cores) if _CAN_BIND else ()
    for (pid, _), started in _POOL_THREADS.items():
        if pid == os.getpid():  # a forked child's table still lists its parent's threads
            for index, thread in enumerate(started):
                _bind(thread, index)
    bound = _bind_blas_workers(blas)
    if not _CORES[0]:
        return "helper threads placed by the scheduler"
    where = ",".join(map(str, _CORES[0]))
    return f"helper threads bound to core(s) {where}" + ("" if bound else
                                                          " (the BLAS's own threads not)")


def bind_pool_thread(workers: int) -> None:
    """The initializer of the pool of `workers` threads (layers.thread_pool): bind its
    starting thread j to helper j's core."""
    with _STARTING:
        started = _POOL_THREADS.setdefault((os.getpid(), workers), [])  # a forked child anew
        started.append(threading.get_native_id())
        _bind(0, len(started) - 1)


def _bind(thread: int, helper: int) -> None:
    """Bind `thread` (0: the calling one) to `helper`'s core; one the system refuses (a
    cpuset narrowed since, a thread gone) stays where it runs."""
    if _CAN_BIND:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(thread, _core_of(helper))


def _core_of(helper: int) -> set[int]:
    cores = _CORES[0]
    return {cores[helper % len(cores)]} if cores else _process_mask()


def _process_mask() -> set[int]:
    return os.sched_getaffinity(os.getpid())  # the main thread's: the process's own


def _bind_blas_workers(blas) -> bool:
    """OpenBLAS (pthreads build): openblas_setaffinity(i, size, set) binds worker i, for
    i below its thread count less one (the last index is the caller). Other BLAS: False."""
    if not _CAN_BIND or blas is None or blas.internal_api != "openblas" \
            or blas.threading_layer != "pthreads":
        return False
    setaffinity = _symbol(blas.dynlib, "openblas_setaffinity")
    if setaffinity is None:  # OpenBLAS before 0.3.12
        return False
    workers = blas.num_threads - 1
    reach = max(workers, _BLAS_BOUND[0])  # also those bound before, idle at this count
    if reach > workers:
        blas.set_num_threads(reach + 1)  # OpenBLAS only reaches workers within its count
    try:
        done = all(_bind_blas_worker(setaffinity, worker) for worker in range(reach))
    finally:
        if reach > workers:
            blas.set_num_threads(workers + 1)
    _BLAS_BOUND[0] = reach if _CORES[0] else 0
    return done


def _bind_blas_worker(setaffinity, worker: int) -> bool:
    bits = (ctypes.c_uint64 * 16)()  # a cpu_set_t: 1024 cores
    for core in _core_of(worker):
        bits[core // 64] |= 1 << (core % 64)
    return setaffinity(ctypes.c_int(worker), ctypes.c_size_t(ctypes.sizeof(bits)), bits) == 0


def _symbol(dynlib, name: str):
    """`name` as this OpenBLAS build exports it (SciPy's wheels add affixes to some)."""
    for prefix, suffix in itertools.product(("", "scipy_"), ("", "64_", "_64")):
        found = getattr(dynlib, f"{prefix}{name}{suffix}", None)
        if found is not None:
            return found
    return None
