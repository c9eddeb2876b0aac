"""Ending the job when one rank fails: the abort handler and the stall watchdog.

MPI has no failure detection of its own: a rank that raises leaves the other
ranks blocked in their next receive forever, and a rank that never enters a
collective leaves its peers spinning. Two mechanisms turn both into a prompt,
explained end of the job:

* `install_abort_handler()` replaces `sys.excepthook` and
  `threading.excepthook` with hooks that print the traceback (prefixed with
  the rank) and call `MPI.COMM_WORLD.Abort(1)`, which ends every rank of the
  job within seconds, however the program was launched (`python -m mpi4py`
  does the same for the main thread only).

* A `Watch` belongs to one communicator and says what it is waiting for:
  `(deadline, operation, peer)`, written with one attribute store before
  every blocking wait and cleared after. One daemon thread per process (the
  watchdog) looks at all watches a few times per timeout; a deadline in the
  past is a stall, reported as

      dtlab: rank 0: allreduce(ring) on 'world' stalled: no progress for 30 s
      waiting for rank 1 (world rank 1); aborting the job

  and the job is aborted. Waits themselves stay plain `MPI.Request.Wait`
  (blocking in C with the GIL released), so the hot path pays one
  `time.monotonic()` and one tuple per step, not a polling loop.

Before aborting, the rank runs the steps registered with `before_abort`
(collective/algorithms/shm.py unlinks the node's MPICH shared-memory file, which only
MPI_Finalize would remove), writes its flight recorder
(collective/transport/flight.py), signals the other ranks to write theirs, and waits
for them a few seconds at most; the message names the directory and the
command that explains the hang. Each watchdog also writes its rank's
recorder when another rank signals.

The timeout is the `timeout` argument of the communicator, else the
environment variable DTLAB_COLLECTIVE_TIMEOUT (seconds), else 600 s; 0
disables the watch. It bounds the time without progress in one wait, not the
length of a collective, so it must exceed the longest time one rank may work
alone between two collectives (a checkpoint, an evaluation).
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import threading
import time
import traceback
import weakref

from mpi4py import MPI

from dtlab.collective.transport import flight

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT_S = 600.0
TIMEOUT_ENV = "DTLAB_COLLECTIVE_TIMEOUT"
FORWARD_S = 0.2  # for mpiexec's proxy to pass our last words on before Abort kills it
DUMP_GRACE_S = 3.0  # at most this long for the other ranks' flight recorders
_BEFORE_ABORT: list = []  # callables returning a dict of what they did (for the dump)


def before_abort(step) -> None:
    """Run `step()` (returning a dict, recorded in the dump) before this rank aborts."""
    _BEFORE_ABORT.append(step)


def _last_steps() -> dict:
    done: dict = {}
    for step in _BEFORE_ABORT:
        try:
            done.update(step())
        except OSError as e:  # an abort goes on whatever cleaning fails
            done[getattr(step, "__name__", "step")] = f"failed: {e}"
    return done


def _flight_words(reason: str) -> str:
    """Dump this rank's flight recorder, have the others dump theirs; say where."""
    try:
        path = flight.dump(reason, _last_steps())
        flight.signal_abort()
    except OSError as e:
        return f"dtlab: flight recorder not written: {e}\n"
    got = flight.wait_for_dumps(DUMP_GRACE_S)
    return (f"dtlab: flight recorder: {path} ({got} of {MPI.COMM_WORLD.Get_size()} ranks "
            f"dumped); explain: python -m dtlab.collective.transport.flight {path.parent}\n")


def _abort(message: str) -> None:
    message += _flight_words(message)
    sys.stderr.write(message)
    sys.stderr.flush()
    sys.stdout.flush()
    time.sleep(FORWARD_S)  # without it the suite once saw the job end with empty stderr
    MPI.COMM_WORLD.Abort(1)


def _rank_line(what: str) -> str:
    world = MPI.COMM_WORLD
    return (
        f"dtlab: {what} on rank {world.Get_rank()} of {world.Get_size()} "
        f"(host {socket.gethostname()}, pid {os.getpid()}); aborting the MPI job\n"
    )


def _excepthook(exc_type, exc, tb) -> None:
    text = "".join(traceback.format_exception(exc_type, exc, tb))
    _abort(_rank_line("uncaught exception") + text)


def _thread_excepthook(args: threading.ExceptHookArgs) -> None:
    if args.exc_type is SystemExit:
        return
    name = args.thread.name if args.thread is not None else "?"
    text = "".join(traceback.format_exception(args.exc_type, args.exc_value, args.exc_traceback))
    _abort(_rank_line(f"uncaught exception in thread {name!r}") + text)


def install_abort_handler() -> None:
    """Make an uncaught exception in any thread abort the whole MPI job.

    Idempotent. The traceback goes to stderr before `MPI.COMM_WORLD.Abort(1)`.
    """
    sys.excepthook = _excepthook
    threading.excepthook = _thread_excepthook


def resolve_timeout(timeout: float | None) -> float:
    """The stall timeout in seconds: the argument, else the environment, else 600."""
    if timeout is None:
        raw = os.environ.get(TIMEOUT_ENV, "")
        try:
            timeout = float(raw) if raw else DEFAULT_TIMEOUT_S
        except ValueError:
            raise ValueError(f"{TIMEOUT_ENV} must be a number of seconds, not {raw!r}") from None
    if timeout < 0:
        raise ValueError(f"collective timeout must be >= 0 seconds (0 disables), not {timeout}")
    return float(timeout)


class Watch:
    """What one communicator waits for, as seen by the watchdog thread.

    `state` is None when idle, else `(deadline, operation, peer)`: peer is a
    rank of the communicator, or None inside an MPI collective (any peer).
    """

    __slots__ = ("__weakref__", "label", "state", "timeout", "world_ranks")

    def __init__(self, label: str, timeout: float, world_ranks: list[int]):
        self.label, self.timeout, self.world_ranks = label, timeout, world_ranks
        self.state: tuple[float, str, int | None] | None = None
        if timeout > 0:
            _watchdog().add(self)

    def waiting(self, operation: str, peer: int | None) -> None:
        """About to block in `operation` until `peer` (None: any rank) acts."""
        if self.timeout:
            self.state = (time.monotonic() + self.timeout, operation, peer)

    def idle(self) -> None:
        self.state = None

    def describe(self, operation: str, peer: int | None) -> str:
        me = MPI.COMM_WORLD.Get_rank()
        if peer is None:
            whom = f"inside MPI for one of world ranks {self.world_ranks}"
        else:
            whom = f"for rank {peer} (world rank {self.world_ranks[peer]})"
        return (
            f"dtlab: rank {me}: {operation} on {self.label!r} stalled: no progress for "
            f"{self.timeout:g} s waiting {whom}; aborting the job "
            f"(raise {TIMEOUT_ENV} if a rank legitimately works alone that long)\n"
        )


class _Watchdog:
    """One daemon thread per process that aborts the job when a watch expires."""

    def __init__(self):
        self.watches: weakref.WeakSet[Watch] = weakref.WeakSet()
        self.lock = threading.Lock()
        self.period = 1.0
        self.thread: threading.Thread | None = None

    def add(self, watch: Watch) -> None:
        with self.lock:
            self.watches.add(watch)
            self.period = min(self.period, max(0.02, watch.timeout / 10))
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="dtlab-watchdog", daemon=True)
                self.thread.start()

    def _run(self) -> None:
        while True:
            time.sleep(self.period)
            if flight.abort_signalled():
                try:
                    flight.dump("another rank is aborting the job", _last_steps())
                except OSError as e:
                    log.warning("flight recorder not written: %s", e)
            now = time.monotonic()
            with self.lock:
                watches = list(self.watches)
            for w in watches:
                state = w.state
                if state is not None and now > state[0]:
                    _abort(w.describe(state[1], state[2]))


_DOG: _Watchdog | None = None
_DOG_LOCK = threading.Lock()


def _watchdog() -> _Watchdog:
    global _DOG
    with _DOG_LOCK:
        if _DOG is None:
            _DOG = _Watchdog()
        return _DOG
