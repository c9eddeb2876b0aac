"""A helper thread that runs a rank's ZeRO collectives in the order they were asked for.

    stream = Stream(dp_comm)                    # its own duplicate of the communicator
    job = stream.submit(lambda comm: comm.allgather(seg, out=unit, counts=counts))
    ...                                         # compute goes on meanwhile
    job.wait()                                  # raises what the collective raised
    stream.drain()                              # every job submitted so far is done

The sharded trainer (collective/zero/sharding.py) submits each unit's all-gather (the next unit's
while this one computes: FSDP's forward and backward prefetch, Zhao et al. 2023) and
each unit's gradient reduce-scatter as backward produces it, as collective/reducers/buckets.py
does for the bucketed all-reduce: one thread, jobs in submission order, which is the
same on every rank, on a communicator of its own (two threads must not issue
collectives on one). NumPy's kernels and MPI's waits release the GIL, so the
collectives overlap compute. Without MPI_THREAD_MULTIPLE, or with `overlap=False`,
each job runs inside submit() instead.
"""

from __future__ import annotations

import queue
import threading
import time
import warnings
from collections.abc import Callable

from mpi4py import MPI

from dtlab.collective.comm import Communicator


class Job:
    """A submitted collective: wait() returns once it ran, raising what it raised."""

    def __init__(self):
        self._done = threading.Event()
        self.error: BaseException | None = None

    def finish(self, error: BaseException | None = None) -> None:
        self.error = error
        self._done.set()

    def wait(self) -> None:
        self._done.wait()
        if self.error is not None:
            raise RuntimeError("a ZeRO collective failed on the helper thread") from self.error


class Stream:
    """Runs submitted collectives one at a time, in order, on `comm.dup()`."""

    def __init__(self, comm: Communicator, overlap: bool = True, persistent_buffers: int = 64):
        if overlap and comm.size > 1 and MPI.Query_thread() < MPI.THREAD_MULTIPLE:
            warnings.warn("ZeRO: MPI does not provide MPI_THREAD_MULTIPLE, so the collectives "
                          "cannot overlap compute; running each where it is asked for",
                          RuntimeWarning, stacklevel=2)
            overlap = False
        self.overlap = overlap and comm.size > 1
        # bindings per (unit, buffer) stay cached: the same buffers come back every step
        self.comm = comm.dup(name=f"{comm.name}.zero", persistent_buffers=persistent_buffers)
        self.seconds = 0.0  # inside the collectives since the last take_seconds()
        self._last = Job()
        self._last.finish()
        self._error: BaseException | None = None
        if self.overlap:
            self._queue: queue.SimpleQueue = queue.SimpleQueue()
            self._thread = threading.Thread(target=self._worker, name="dtlab-zero", daemon=True)
            self._thread.start()

    def submit(self, fn: Callable[[Communicator], None]) -> Job:
        """Run fn(comm) after every job submitted before it; return its Job."""
        job = Job()
        if self.overlap:
            self._queue.put((fn, job))
        else:
            self._run(fn, job)
        self._last = job
        return job

    def _run(self, fn, job: Job) -> None:
        if self._error is not None:  # a collective failed: the ones after it cannot run
            job.finish(self._error)
            return
        start = time.perf_counter()
        try:
            fn(self.comm)
        except BaseException as e:  # handed to whoever waits for it
            self._error = e
            job.finish(e)
            return
        self.seconds += time.perf_counter() - start
        job.finish()

    def _worker(self) -> None:
        while (item := self._queue.get()) is not None:
            self._run(*item)

    def drain(self) -> None:
        """Wait until every job submitted so far has run."""
        self._last.wait()

    def take_seconds(self) -> float:
        """Seconds spent inside collectives since the last call (after drain())."""
        seconds, self.seconds = self.seconds, 0.0
        return seconds

    def close(self) -> None:
        """Stop the thread and free the communicator (collective)."""
        if self.comm is None:
            return
        if self.overlap:
            self._queue.put(None)
            self._thread.join()
        self.comm.free()
        self.comm = None
