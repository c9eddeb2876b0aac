"""The communicator: the small protocol models and trainers talk to.

    from dtlab.collective import world
    comm = world()                      # COMM_WORLD; installs the abort handler
    comm.allreduce(grad, average=True)  # in place, our algorithms by default

Semantics, for every method:
  * arrays are C-contiguous NumPy or CuPy arrays of any dtype; the reduction
    is a sum; results land in place (allreduce, broadcast, recv) or in `out`,
    and every method returns its result array;
  * float16 and bfloat16 (ml_dtypes) are summed as floats on every path,
    MPI's included: each addition in float32, rounded to the buffer's dtype
    once per hop, partial sums moving in the buffer's dtype (the rule and
    its error bound: collective/transport/link.py);
  * a world of size 1 is a real communicator: the operations are identities
    (or a local copy);
  * collectives run our own algorithms (ring, halving-doubling, recursive
    doubling, shared-memory one-/two-shot, binomial tree, pairwise exchange:
    see each module's docstring) on MPI point-to-point messages of raw bytes
    (persistent requests where a buffer comes back) or MPI-3 shared memory
    within a node, with scratch memory pooled per communicator;
    `allreduce(algo="mpi")` is MPI's own Allreduce, kept as the baseline;
  * before a collective, ranks check once per distinct buffer signature that
    they agree on it (collective/transport/agree.py), and every blocking wait is under
    the stall watchdog (collective/transport/failure.py);
  * every collective call is recorded in the flight recorder (its sequence
    number on this communicator, size, dtype, algorithm, state), dumped when
    the job stalls or aborts (collective/transport/flight.py).

allreduce algorithms (`algo`, default "ours"):
  ours   ours: by buffer size, world size and node (collective/algorithms/choose.py),
         recursive doubling, shared-memory one-shot or two-shot, halving-
         doubling, or the ring reduce-scatter + all-gather, pipelined in
         `chunk_bytes` sub-chunks (default 4 MiB, see collective/algorithms/ring.py);
         `ours` forces one of them.
  naive  reduce to rank 0, broadcast from it (the textbook baseline).
  mpi    MPI_Allreduce of the MPI library.
"""

from __future__ import annotations

import functools
import math

import ml_dtypes
import numpy as np
from mpi4py import MPI

from dtlab.collective.algorithms.alltoall import pairwise_alltoallv
from dtlab.collective.algorithms.choose import OURS, allreduce_algorithm
from dtlab.collective.algorithms.doubling import bind_doubling
from dtlab.collective.algorithms.halving import bind_halving
from dtlab.collective.algorithms.naive import naive_allreduce
from dtlab.collective.algorithms.ring import (
    ring_allgather,
    ring_allreduce,
    ring_reduce_scatter,
    segment_bounds,
)
from dtlab.collective.algorithms.shm import SharedArena, shm_one_shot, shm_two_shot
from dtlab.collective.algorithms.tree import tree_broadcast
from dtlab.collective.transport import gpu
from dtlab.collective.transport.agree import ALGOS, Agreement, MismatchError, resolve_mode
from dtlab.collective.transport.failure import install_abort_handler, resolve_timeout
from dtlab.collective.transport.flight import recorder
from dtlab.collective.transport.link import TAG_ALLTOALL, Link, byte_view, mpi_sum
from dtlab.collective.transport.waits import resolve_yield
from dtlab.models import backend

DEFAULT_CHUNK_BYTES = 4 << 20
_ALGO_CODE = {a: i for i, a in enumerate(ALGOS)}
_BIND = {"doubling": bind_doubling, "halving": bind_halving}
_SHM = {"shm-one-shot": shm_one_shot, "shm-two-shot": shm_two_shot}


def _flat(x, what: str = "buffer"):
    """A 1-D view of `x` (which must be C-contiguous, so results land in x)."""
    if x.ndim == 1 and x.strides[0] == x.itemsize:
        return x
    if not x.flags.c_contiguous:
        raise ValueError(f"{what} must be C-contiguous (got strides {x.strides}); pass a copy")
    return x.reshape(-1)


def _output(x, out, rows: int, operation: str):
    """`out` checked to be (rows, *x.shape[1:]) of x's dtype, or a new such array."""
    shape = (rows, *x.shape[1:])
    if out is None:
        return backend.array_module(x).empty(shape, dtype=x.dtype)
    if out.shape != shape or out.dtype != x.dtype:
        raise ValueError(f"{operation}: out must be {shape} {x.dtype}, "
                         f"not {out.shape} {out.dtype}")
    return out


def _floating(dtype) -> bool:
    """Whether `dtype` can be averaged: NumPy's floats and complex (kinds f, c) and
    ml_dtypes' floats (bfloat16, float8_*), whose kind is V."""
    if dtype.kind in "fc":
        return True
    try:
        ml_dtypes.finfo(dtype)
    except ValueError:
        return False
    return True


def _row_elems(x) -> int:
    return math.prod(x.shape[1:])


def _element_bounds(counts: list[int], row: int) -> list[int]:
    """Element offsets [0, c0 row, (c0 + c1) row, ...] of blocks of `counts` rows."""
    return [b * row for b in np.cumsum([0, *counts]).tolist()]


class SendRequest:
    """A send in flight (Communicator.isend): holds its buffer; wait() completes it
    under the stall watchdog, once."""

    def __init__(self, link: Link, req, buf, what: str, dest: int):
        self._link, self._req, self._buf, self._what, self._dest = link, req, buf, what, dest

    def wait(self) -> None:
        if self._req is not None:
            self._link.wait(self._req, self._what, self._dest)
            self._req = self._buf = None


class AlltoallvRequest:
    """An all-to-all(v) in flight (Communicator.ialltoallv): holds its buffers; wait()
    completes it under the stall watchdog, once, and returns (out, recv_counts)."""

    def __init__(self, link: Link, reqs: list, send, buf, device, out, recv_counts: list[int],
                 entry, recorder):
        self._link, self._reqs, self._held = link, reqs, (send, buf, device)
        self.out, self.recv_counts, self._entry = out, recv_counts, entry
        self._recorder = recorder

    def wait(self):
        if self._reqs is not None:
            self._link.waitall(self._reqs, "ialltoallv", None)
            self._recorder.done(self._entry)
            gpu.unplace(self._held[1], self._held[2])
            self._reqs = self._held = None
        return self.out, self.recv_counts


class Communicator:
    """A group of ranks and the collectives over it.

    comm: the MPI communicator (default COMM_WORLD); name: used in errors.
    algo: default allreduce algorithm, "ours" | "naive" | "mpi".
    timeout: stall timeout in seconds (None: DTLAB_COLLECTIVE_TIMEOUT or 600;
        0 disables). check: "first" | "always" | "never" agreement check
        (None: DTLAB_COLLECTIVE_CHECK or "first").
    chunk_bytes: ring pipelining sub-chunk. ours: one of choose.OURS for every
        allreduce(algo="ours") (None: chosen by size, collective/algorithms/choose.py).
    persistent_buffers: how many distinct buffers keep their requests bound
        (least recently used first out); each pins its buffer. Raise it for a
        fixed set of buffers reduced every step (the bucket reducer does).
    yield_waits: poll-and-yield instead of blocking waits (None: automatic,
        see collective/transport/waits.py).
    flight: record every call in the flight recorder (collective/transport/flight.py); False
        records nothing (the baseline dtlab-bench flight times it against).
    """

    def __init__(
        self,
        comm: MPI.Comm | None = None,
        *,
        name: str = "world",
        algo: str = "ours",
        timeout: float | None = None,
        check: str | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        ours: str | None = None,
        persistent_buffers: int = 4,
        yield_waits: bool | None = None,
        flight: bool = True,
    ):
        if algo not in ALGOS:
            raise ValueError(f"allreduce algorithm must be one of {ALGOS}, not {algo!r}")
        if ours is not None and ours not in OURS:
            raise ValueError(f"our all-reduce algorithm must be one of {OURS}, not {ours!r}")
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be positive, not {chunk_bytes}")
        self.mpi = comm if comm is not None else MPI.COMM_WORLD
        self.name, self.algo = name, algo
        self.chunk_bytes = chunk_bytes
        self.timeout = resolve_timeout(timeout)
        self.check = resolve_mode(check)
        self.yield_waits = resolve_yield(yield_waits)
        self.persistent_buffers = max(1, persistent_buffers)
        self._link = Link(self.mpi, name, self.timeout, self.yield_waits, self.persistent_buffers)
        self.ours = ours
        # (array, call, runner) of the last allreduce of a host array: the same call
        # on the same array object again goes straight to the runner, past the
        # argument checks, the agreement lookup and the dispatch (a good part of a
        # few-KB call); it keeps that one array alive
        self._last: tuple | None = None
        self._arena: SharedArena | bool | None = None  # False: ranks on several nodes
        self._agree = Agreement(self._link, self.check)
        self.rank, self.size = self._link.rank, self._link.size
        self.flight = flight
        self._flight = recorder(name, self.rank, self._link.world_ranks, flight)

    def __repr__(self) -> str:
        return f"Communicator({self.name!r}, rank {self.rank} of {self.size}, algo={self.algo!r})"

    # ---- collectives -------------------------------------------------------

    def allreduce(self, x, *, average: bool = False, algo: str | None = None):
        """Sum `x` over all ranks in place (divided by size if `average`); return x."""
        call = (average, algo, self.algo, self.ours, self.chunk_bytes, x.nbytes,
                self._link.cache.evictions)
        last = self._last
        if last is not None and last[0] is x and last[1] == call:
            e = self._flight.start("allreduce", x.nbytes, x.dtype, last[3])
            last[2]()  # the same call on the same array, its binding still cached
            self._flight.done(e)
            return x
        algo = algo or self.algo
        code = _ALGO_CODE.get(algo)
        if code is None:
            raise ValueError(f"allreduce algorithm must be one of {ALGOS}, not {algo!r}")
        flat = _flat(x)
        if average and not _floating(flat.dtype):
            raise TypeError(f"average=True needs a floating-point buffer, not {flat.dtype}")
        e = self._flight.start("allreduce", flat.nbytes, flat.dtype, algo)
        self._agree.check("allreduce", flat.size, flat.dtype, code + 8 * average)
        if self.size == 1 or flat.size == 0:
            self._flight.done(e)
            return x
        buf, xp, sync, device = self._place(flat, "stage")
        run, e.algo = self._allreduce_runner(buf, xp, sync, self.size if average else None, algo)
        run()
        if device is not None:
            gpu.unplace(buf, device)
        elif self.check != "always":
            self._last = (x, call[:-1] + (self._link.cache.evictions,), run, e.algo)
        self._flight.done(e)
        return x

    def _allreduce_runner(self, buf, xp, sync, divide: int | None, algo: str):
        """(a call that all-reduces `buf` in place with `algo`, repeatable; the name of
        the algorithm it runs)."""
        link = self._link
        if algo == "mpi":
            msg, op = mpi_sum(buf)
            return functools.partial(self._mpi_allreduce, buf, msg, op, xp, sync, divide), algo
        if algo == "naive":
            return functools.partial(naive_allreduce, link, buf, xp=xp, sync=sync,
                                     divide=divide), algo
        host = isinstance(buf, np.ndarray)
        ours = self.ours or allreduce_algorithm(buf.nbytes, self.size,
                                                lambda: host and self._shared())
        if ours == "ring":
            return functools.partial(ring_allreduce, link, buf, xp=xp, sync=sync, divide=divide,
                                     chunk_bytes=self.chunk_bytes), ours
        if ours in _SHM:
            if not host or not self._shared():
                raise ValueError(f"allreduce {ours!r} needs host arrays and all ranks of "
                                 f"{self.name!r} on one node")
            return functools.partial(_SHM[ours], self._arena, buf, divide=divide), ours
        return functools.partial(_BIND[ours](link, buf, xp).run, xp, sync, divide), ours

    def ours_for(self, nbytes: int) -> str:
        """Which of our algorithms allreduce(algo="ours") runs on a host buffer of
        `nbytes` (collective on first use, like allreduce)."""
        return self.ours or allreduce_algorithm(nbytes, self.size, self._shared)

    def _shared(self) -> bool:
        """Whether all ranks share one node's memory (collective on first use)."""
        if self._arena is None:
            self._arena = SharedArena(self._link) if SharedArena.usable(self.mpi) else False
        return bool(self._arena)

    def _mpi_allreduce(self, buf, msg, op: MPI.Op, xp, sync, divide: int | None) -> None:
        if sync is not None:
            sync()
        self._link.watch.waiting("allreduce(mpi)", None)
        self.mpi.Allreduce(MPI.IN_PLACE, msg, op=op)
        self._link.watch.idle()
        if divide is not None:
            xp.true_divide(buf, divide, out=buf)

    def _place(self, flat, key: str, copy_in: bool = True):
        """(buf, xp, sync, device) for running on `flat`; see gpu.place."""
        if isinstance(flat, np.ndarray):
            return flat, np, None, None
        return gpu.place(flat, self._link.ws, key, copy_in=copy_in)

    def reduce_scatter(self, x, *, average: bool = False):
        """Sum `x` over all ranks; return this rank's rows of the sum (a view of x).

        Rows (axis 0) are split as `segment_bounds(len(x), size)`: the first
        len(x) % size ranks get one row more. The other rows of `x` are used
        as scratch and hold unspecified values afterwards.
        """
        flat = _flat(x)
        if average and not _floating(flat.dtype):
            raise TypeError(f"average=True needs a floating-point buffer, not {flat.dtype}")
        e = self._flight.start("reduce_scatter", flat.nbytes, flat.dtype, "ring")
        self._agree.check("reduce_scatter", flat.size, flat.dtype, int(average))
        rows = segment_bounds(x.shape[0], self.size)
        mine = x[rows[self.rank] : rows[self.rank + 1]]
        if self.size == 1 or flat.size == 0:
            self._flight.done(e)
            return mine
        row = _row_elems(x)
        bounds = [b * row for b in rows]
        buf, xp, sync, device = self._place(flat, "stage")
        ring_reduce_scatter(self._link, buf, bounds, xp=xp, sync=sync,
                            chunk_bytes=self.chunk_bytes, divide=self.size if average else None)
        gpu.unplace(buf, device, bounds[self.rank], bounds[self.rank + 1])
        self._flight.done(e)
        return mine

    def allgather(self, x, out=None, counts: list[int] | None = None):
        """Concatenate every rank's `x` along axis 0 into `out`; return out.

        x: (counts[rank], *rest); counts: rows per rank (default: all equal to
        len(x)). out: (sum(counts), *rest), allocated if None; `x` may be a
        view of out's own rows (reduce_scatter's result), in which case the
        call completes that buffer in place.
        """
        counts = list(counts) if counts is not None else [x.shape[0]] * self.size
        if len(counts) != self.size or x.shape[0] != counts[self.rank]:
            raise ValueError(
                f"allgather on {self.name!r}: rank {self.rank} passes {x.shape[0]} rows "
                f"but counts say {counts} for {self.size} ranks"
            )
        row = _row_elems(x)
        total = sum(counts)
        out = _output(x, out, total, "allgather")
        e = self._flight.start("allgather", out.nbytes, x.dtype, "ring")
        self._agree.check("allgather", total * row, x.dtype, row)
        bounds = [b * row for b in np.cumsum([0, *counts]).tolist()]
        flat = _flat(out, "out")
        lo, hi = bounds[self.rank], bounds[self.rank + 1]
        flat[lo:hi] = _flat(x)
        if self.size == 1 or flat.size == 0:
            self._flight.done(e)
            return out
        buf, xp, sync, device = self._place(flat, "stage", copy_in=False)
        if device is not None:
            buf[lo:hi] = self._place(_flat(x), "stage_in")[0]
        ring_allgather(self._link, buf, bounds, xp=xp, sync=sync, chunk_bytes=self.chunk_bytes)
        gpu.unplace(buf, device)
        self._flight.done(e)
        return out

    def alltoallv(self, x, send_counts, out=None, recv_counts=None):
        """Send rows of `x` to every rank; return (out, recv_counts).

        x: (sum(send_counts), *rest), rows grouped by destination rank in rank
        order; send_counts[d] rows go to rank d. recv_counts[s] rows arrive
        from rank s, concatenated in rank order in out (sum(recv_counts),
        *rest). Without recv_counts they are exchanged first (one small
        pairwise all-to-all of counts).
        """
        e = self._flight.start("alltoallv", x.nbytes, x.dtype, "pairwise")
        send_counts, recv_counts, row = self._alltoallv_counts(x, send_counts, recv_counts,
                                                               "alltoallv")
        out = _output(x, out, sum(recv_counts), "alltoallv")
        sb, rb = _element_bounds(send_counts, row), _element_bounds(recv_counts, row)
        send = self._place(_flat(x), "stage_in")[0]
        buf, xp, sync, device = self._place(_flat(out, "out"), "stage", copy_in=False)
        pairwise_alltoallv(self._link, send, sb, buf, rb, xp=xp, sync=sync)
        gpu.unplace(buf, device)
        self._flight.done(e)
        return out, recv_counts

    def _alltoallv_counts(self, x, send_counts, recv_counts, operation: str):
        """(send_counts, recv_counts, elements per row) of an all-to-all(v): the send
        counts checked against x, the ranks' agreement on row size and dtype, and the
        receive counts exchanged (one small pairwise all-to-all) when not given."""
        send_counts = [int(c) for c in send_counts]
        if len(send_counts) != self.size or sum(send_counts) != x.shape[0]:
            raise ValueError(
                f"{operation} on {self.name!r}: rank {self.rank} has {x.shape[0]} rows but "
                f"send_counts {send_counts} (need {self.size} counts summing to the rows)"
            )
        row = _row_elems(x)
        self._agree.check("alltoallv", row, x.dtype, row)
        if recv_counts is None:
            mine = np.asarray(send_counts, dtype=np.int64)  # (N,)
            theirs = np.empty(self.size, dtype=np.int64)  # (N,)
            unit = list(range(self.size + 1))
            pairwise_alltoallv(self._link, mine, unit, theirs, unit, xp=np, sync=None)
            recv_counts = theirs.tolist()
        return send_counts, [int(c) for c in recv_counts], row

    def ialltoallv(self, x, send_counts, out=None, recv_counts=None) -> AlltoallvRequest:
        """Start alltoallv (the same arguments; without recv_counts they are exchanged
        first, blocking); the request's wait() completes it and returns (out, recv_counts).
        Every receive and send is posted at once, in pairwise-exchange order (from r - k,
        to r + k), and one wait completes them: no step waits for the one before, which
        matters when ranks outnumber cores. x and out must not be touched before wait()."""
        e = self._flight.start("ialltoallv", x.nbytes, x.dtype, "pairwise")
        send_counts, recv_counts, row = self._alltoallv_counts(x, send_counts, recv_counts,
                                                               "ialltoallv")
        out = _output(x, out, sum(recv_counts), "ialltoallv")
        sb, rb = _element_bounds(send_counts, row), _element_bounds(recv_counts, row)
        send = self._place(_flat(x), "stage_in")[0]
        buf, _, sync, device = self._place(_flat(out, "out"), "stage", copy_in=False)
        n, r = self.size, self.rank
        buf[rb[r]:rb[r + 1]] = send[sb[r]:sb[r + 1]]
        if sync is not None:
            sync()
        reqs = [self.mpi.Irecv(byte_view(buf[rb[s]:rb[s + 1]]), s, TAG_ALLTOALL)
                for s in ((r - k) % n for k in range(1, n))]
        reqs += [self.mpi.Isend(byte_view(send[sb[d]:sb[d + 1]]), d, TAG_ALLTOALL)
                 for d in ((r + k) % n for k in range(1, n))]
        return AlltoallvRequest(self._link, reqs, send, buf, device, out, recv_counts, e,
                                self._flight)

    def mpi_alltoallv(self, x, send_counts, out=None, recv_counts=None):
        """alltoallv by MPI's own Alltoallv (the baseline ours is measured against, and
        `--moe-alltoall mpi`); the same arguments and result. Moves raw bytes."""
        e = self._flight.start("mpi_alltoallv", x.nbytes, x.dtype, "mpi")
        send_counts, recv_counts, row = self._alltoallv_counts(x, send_counts, recv_counts,
                                                               "mpi_alltoallv")
        out = _output(x, out, sum(recv_counts), "mpi_alltoallv")
        unit = row * x.dtype.itemsize  # bytes per row
        sc = [c * unit for c in send_counts]
        rc = [c * unit for c in recv_counts]
        sd = np.cumsum([0, *sc[:-1]]).tolist()
        rd = np.cumsum([0, *rc[:-1]]).tolist()
        send = self._place(_flat(x), "stage_in")[0]
        buf, _, sync, device = self._place(_flat(out, "out"), "stage", copy_in=False)
        if sync is not None:
            sync()
        req = self.mpi.Ialltoallv([send, (sc, sd), MPI.BYTE], [buf, (rc, rd), MPI.BYTE])
        self._link.wait(req, "alltoallv(mpi)", None)
        gpu.unplace(buf, device)
        self._flight.done(e)
        return out, recv_counts

    def broadcast(self, x, root: int = 0):
        """Copy rank `root`'s `x` into `x` on every rank; return x."""
        if not 0 <= root < self.size:
            raise ValueError(
                f"broadcast root {root} is not a rank of {self.name!r} (size {self.size})"
            )
        flat = _flat(x)
        e = self._flight.start("broadcast", flat.nbytes, flat.dtype, "tree", root)
        self._agree.check("broadcast", flat.size, flat.dtype, root)
        if self.size == 1 or flat.size == 0:
            self._flight.done(e)
            return x
        buf, _, sync, device = self._place(flat, "stage", copy_in=self.rank == root)
        tree_broadcast(self._link, buf, root, sync=sync)
        gpu.unplace(buf, device)
        self._flight.done(e)
        return x

    def barrier(self) -> None:
        e = self._flight.start("barrier", 0, "-", "mpi")
        self._link.watch.waiting("barrier", None)
        self.mpi.Barrier()
        self._link.watch.idle()
        self._flight.done(e)

    # ---- point to point ----------------------------------------------------

    def send(self, x, dest: int, tag: int = 0) -> None:
        """Send `x` to rank `dest` (returns once `x` may be reused)."""
        buf, _, sync, _ = self._place(_flat(x), "stage_in")
        if sync is not None:
            sync()
        self._link.wait(self.mpi.Isend(byte_view(buf), dest, tag), f"send(tag {tag})", dest)

    def recv(self, x, source: int, tag: int = 0):
        """Receive into `x` (its shape and dtype must match the sender's); return x."""
        buf, _, _, device = self._place(_flat(x), "stage", copy_in=False)
        self._recv_checked(buf, source, tag)
        gpu.unplace(buf, device)
        return x

    def sendrecv(self, x, dest: int, out, source: int, tag: int = 0):
        """Send `x` to `dest` while receiving `out` from `source` (no deadlock
        when two ranks exchange); return out."""
        send, _, sync, _ = self._place(_flat(x), "stage_in")
        buf, _, _, device = self._place(_flat(out, "out"), "stage", copy_in=False)
        if sync is not None:
            sync()
        req = self.mpi.Isend(byte_view(send), dest, tag)
        self._recv_checked(buf, source, tag)
        self._link.wait(req, f"sendrecv(tag {tag})", dest)
        gpu.unplace(buf, device)
        return out

    def isend(self, x, dest: int, tag: int = 0) -> SendRequest:
        """Start sending `x` to `dest`; the returned request's wait() returns once `x`
        may be reused. A device array without GPU-aware MPI is sent from its own host
        copy, so several sends can be in flight."""
        flat = _flat(x)
        if gpu.is_device_array(flat) and not gpu.mpi_is_gpu_aware():
            flat = flat.get()  # (L,) this send's host copy
        elif gpu.is_device_array(flat):
            backend.synchronize()
        req = self.mpi.Isend(byte_view(flat), dest, tag)
        return SendRequest(self._link, req, flat, f"isend(tag {tag})", dest)

    def _recv_checked(self, buf, source: int, tag: int) -> None:
        status = MPI.Status()
        req = self.mpi.Irecv(byte_view(buf), source, tag)
        try:
            self._link.wait(req, f"recv(tag {tag})", source, status)
        except MPI.Exception as e:
            if e.Get_error_class() != MPI.ERR_TRUNCATE:
                raise
            raise MismatchError(
                f"recv on {self.name!r}: rank {self.rank} expected {buf.nbytes} bytes from "
                f"rank {source} (tag {tag}), which sent more"
            ) from None
        got = status.Get_count(MPI.BYTE)
        if got != buf.nbytes:
            raise MismatchError(
                f"recv on {self.name!r}: rank {self.rank} expected {buf.nbytes} bytes from "
                f"rank {source} (tag {tag}), got {got}"
            )

    # ---- new communicators -------------------------------------------------

    def free(self) -> None:
        """Release the MPI communicator of a dup/split (collective; not for COMM_WORLD)."""
        if self.mpi not in (MPI.COMM_WORLD, MPI.COMM_SELF):
            self._last = None
            if self._arena:
                self._arena.free()
            self._link.release()
            self.mpi.Free()

    def _settings(self) -> dict:
        return {"algo": self.algo, "timeout": self.timeout, "check": self.check,
                "chunk_bytes": self.chunk_bytes, "ours": self.ours,
                "persistent_buffers": self.persistent_buffers, "yield_waits": self.yield_waits,
                "flight": self.flight}

    def dup(self, name: str | None = None, **overrides) -> Communicator:
        """A communicator over the same ranks with its own message space
        (collective); `overrides` replace this one's settings."""
        settings = {**self._settings(), **overrides}
        return Communicator(self.mpi.Dup(), name=name or f"{self.name}.dup", **settings)

    def split(
        self, color: int | None, key: int = 0, name: str | None = None
    ) -> Communicator | None:
        """Ranks with the same color form a new communicator, ordered by key
        (collective). color None: this rank joins none and gets None."""
        sub = self.mpi.Split(MPI.UNDEFINED if color is None else color, key)
        if sub == MPI.COMM_NULL:
            return None
        return Communicator(sub, name=name or f"{self.name}.split", **self._settings())


def world(**settings) -> Communicator:
    """COMM_WORLD as a Communicator, with the abort handler installed."""
    install_abort_handler()
    return Communicator(MPI.COMM_WORLD, name="world", **settings)
