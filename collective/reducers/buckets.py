"""Bucketed gradient averaging across data-parallel ranks, overlapped with backward.

    reducer = BucketReducer(grid.dp_comm, params.grad, bucket_bytes=25_000_000)
    loss = replica.compute_grads(micro_batches, grad_ready=reducer.ready)
    timing = reducer.wait()          # every rank now holds the mean gradient

The flat gradient buffer is cut into buckets of `bucket_bytes` laid out
from the END of the buffer backwards, because backward produces gradients
in that order: `ready(offset)` means "every element at index >= offset is
final" (models.layers.Sequential.backward reports it after each module).

    grad: [ b3 |    b2    |    b1    |    b0    ]      b0 is ready first
                                                      (last layer's params)

With `overlap=True` a background thread all-reduces each bucket as soon as
`ready` covers it, on a duplicate of the communicator (two threads must not
issue collectives on one communicator), while the main thread goes on with
backward: NumPy's matmuls, `np.add` and MPI waits all release the GIL. This
is PyTorch DDP's design (Li et al., "PyTorch Distributed", VLDB 2020);
its default bucket, 25 MiB, is ours too in round numbers (25 MB, --bucket-mb):
large enough that per-call latency is small against the bandwidth term, small
enough that the first bucket starts early. `wait()` launches whatever `ready`
never covered (so the result is right even if `ready` is never called), blocks until all buckets are
averaged, and returns the time spent communicating and the time the caller
waited; the difference is communication hidden behind backward.

With `wire="fp16"` or `"bf16"` each bucket is cast to that dtype, averaged
in it (summed as floats, rounded once per hop: collective/transport/link.py) and cast
back: half the bytes on the wire for a rounding error of about
(hops + 2) 2^-11 (fp16) or 2^-8 (bf16) relative per element. fp16 has
float32's precision down to 6e-5 only and overflows above 65504, so it
suits gradients of a loss-scaled run; bf16 keeps float32's range.

Overlap needs MPI_THREAD_MULTIPLE; with a lower thread level the reducer
warns and reduces all buckets inside `wait()` (`overlap=False` does that
on purpose). Buckets are always reduced in the same order on every rank.
"""

from __future__ import annotations

import queue
import threading
import time
import warnings
from dataclasses import dataclass

import ml_dtypes
import numpy as np
from mpi4py import MPI

from dtlab.collective.comm import Communicator
from dtlab.collective.reducers.bucket_defaults import DEFAULT_BUCKET_BYTES
from dtlab.models.backend import array_module

WIRE_DTYPES = {"fp32": None, "fp16": np.float16, "bf16": ml_dtypes.bfloat16}


@dataclass
class ReduceTiming:
    comm_s: float  # seconds inside the buckets' all-reduce calls, summed
    wait_s: float  # seconds the caller was blocked in wait()
    buckets: int
    wire_bytes: int  # bytes of the buffers handed to the all-reduces


def bucket_bounds(length: int, bucket_elems: int) -> list[tuple[int, int]]:
    """[lo, hi) element ranges of the buckets, the buffer's end first.

    bucket_bounds(10, 4) == [(6, 10), (2, 6), (0, 2)].
    """
    return [(max(0, hi - bucket_elems), hi) for hi in range(length, 0, -bucket_elems)]


class BucketReducer:
    """Averages (or sums) a 1-D gradient buffer over `comm`, bucket by bucket."""

    def __init__(
        self,
        comm: Communicator,
        grad,
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        algo: str | None = None,
        ours: str | None = None,
        overlap: bool = True,
        average: bool = True,
        wire: str = "fp32",
    ):
        if wire not in WIRE_DTYPES:
            raise ValueError(f"wire dtype {wire!r}: choose from {sorted(WIRE_DTYPES)}")
        if grad.ndim != 1:
            raise ValueError(f"the gradient buffer must be 1-D (flat), not of shape {grad.shape}")
        if bucket_bytes < grad.itemsize:
            raise ValueError(f"bucket_bytes={bucket_bytes} is smaller than one element")
        self.grad, self.algo, self.average = grad, algo, average
        self.buckets = bucket_bounds(grad.size, bucket_bytes // grad.itemsize)
        self.wire = wire
        self.shadow = None  # (L,) the gradient cast to the wire dtype, bucket by bucket
        if WIRE_DTYPES[wire] not in (None, grad.dtype) and comm.size > 1:  # not half already
            xp = array_module(grad)
            if xp is not np and wire == "bf16":
                raise ValueError("--wire bf16 needs NumPy arrays: CuPy has no bfloat16")
            self.shadow = xp.empty(grad.size, dtype=WIRE_DTYPES[wire])
        self.wire_bytes = (self.shadow if self.shadow is not None else grad).nbytes
        if overlap and comm.size > 1 and MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            warnings.warn(
                "BucketReducer: MPI does not provide MPI_THREAD_MULTIPLE, so all-reduce "
                "cannot overlap backward; reducing all buckets in wait() instead",
                RuntimeWarning,
                stacklevel=2,
            )
            overlap = False
        self.overlap = overlap and comm.size > 1
        self._next = 0  # buckets [0, _next) have been launched this step
        self._comm_s = 0.0
        # A communicator of our own (collective): the comm thread may not share
        # one with the caller, and every bucket keeps its ring requests bound.
        # `ours` (one of collective.algorithms.choose.OURS) forces that algorithm for algo "ours";
        # None lets the chooser pick by size
        self.comm = comm.dup(name=f"{comm.name}.buckets",
                             persistent_buffers=max(1, len(self.buckets)), ours=ours)
        if self.overlap:
            self._queue: queue.SimpleQueue = queue.SimpleQueue()
            self._done = 0
            self._error: BaseException | None = None
            self._cv = threading.Condition()
            self._thread = threading.Thread(target=self._worker, name="dtlab-buckets", daemon=True)
            self._thread.start()

    def plan(self) -> list[dict]:
        """What each bucket's all-reduce runs, in launch order: its bytes on the wire and
        the algorithm (one of collective.algorithms.choose.OURS for algo "ours", else "naive" or
        "mpi"), as comm.ours_for decides it (collective on the first call)."""
        itemsize = (self.shadow if self.shadow is not None else self.grad).itemsize
        algo = self.algo or self.comm.algo
        plan = []
        for lo, hi in self.buckets:
            nbytes = (hi - lo) * itemsize
            name = self.comm.ours_for(nbytes) if algo == "ours" else algo
            plan.append({"bytes": nbytes, "algorithm": name if self.comm.size > 1 else "none"})
        return plan

    def _reduce(self, i: int) -> float:
        lo, hi = self.buckets[i]
        start = time.perf_counter()
        if self.shadow is None:
            self.comm.allreduce(self.grad[lo:hi], average=self.average, algo=self.algo)
        else:
            wire = self.shadow[lo:hi]
            wire[...] = self.grad[lo:hi]  # round to the wire dtype
            self.comm.allreduce(wire, average=self.average, algo=self.algo)
            self.grad[lo:hi] = wire
        return time.perf_counter() - start

    def _worker(self) -> None:
        while (i := self._queue.get()) is not None:
            try:
                spent = self._reduce(i)
            except BaseException as e:  # handed to wait(), which raises it
                with self._cv:
                    self._error = e
                    self._cv.notify()
                return
            with self._cv:
                self._done += 1
                self._comm_s += spent
                self._cv.notify()

    def ready(self, offset: int) -> None:
        """Every gradient element at index >= offset is final (backward's callback)."""
        if not self.overlap:
            return
        while self._next < len(self.buckets) and self.buckets[self._next][0] >= offset:
            self._queue.put(self._next)
            self._next += 1

    def wait(self) -> ReduceTiming:
        """Reduce what is left, wait for every bucket, return the step's timing."""
        start = time.perf_counter()
        if self.overlap:
            self.ready(0)
            with self._cv:
                while self._done < len(self.buckets) and self._error is None:
                    self._cv.wait()
                if self._error is not None:
                    raise RuntimeError("bucket all-reduce failed in the comm thread") from (
                        self._error
                    )
                comm_s, self._comm_s, self._done = self._comm_s, 0.0, 0
        else:
            comm_s = sum(self._reduce(i) for i in range(len(self.buckets)))
        self._next = 0
        return ReduceTiming(comm_s, time.perf_counter() - start, len(self.buckets),
                            self.wire_bytes)

    def close(self) -> None:
        """Stop the comm thread and free its communicator (collective; the
        reducer cannot be used afterwards)."""
        if self.comm is None:
            return
        if self.overlap:
            self._queue.put(None)
            self._thread.join()
        self.comm.free()
        self.comm = None

    def __enter__(self) -> BucketReducer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
