"""The flight recorder: the last collectives of every rank, dumped when the job hangs.

A hang in a collective says nothing by itself: every rank waits, each for a
different reason. Like PyTorch's Flight Recorder (torch.distributed, "Flight
Recorder for Debugging Stuck Jobs", 2024) every collective call of a
`Communicator` gets the next sequence number of that communicator and one
entry in a per-process ring of the last DTLAB_FLIGHT_ENTRIES (default 256)
calls:

    (communicator, sequence, operation, bytes, dtype, algorithm, peer,
     start, end, state started | done)

DTLAB_FLIGHT_ENTRIES=0 turns it off (a recorder that records nothing, as
Communicator(flight=False) gets; what dtlab-bench flight times it against).
The ring's entries are allocated once; a call overwrites the oldest one's
fields (a few attribute stores and one clock read at entry, two at exit).
When the stall watchdog fires (DTLAB_COLLECTIVE_TIMEOUT) or a rank aborts
(collective/transport/failure.py), that rank writes its ring to
DTLAB_FLIGHT_DIR/rank-R.json (default ./dtlab-flight-<jobid>, the job id of
the scheduler, else of this node's launcher process), then touches the
directory's ABORT file; the watchdog thread of every other rank sees it
within a tenth of the timeout and writes its own ring, and the aborting rank
waits (a few seconds at most) for those before it aborts the job. Ranks of
other nodes see the file only on a shared file system.

The analyser reads the dumps and names, per communicator, the first
sequence number the ranks disagree on: ranks that never reached it, or
ranks that called another operation, size or dtype there:

    python -m dtlab.collective.transport.flight ./dtlab-flight-12345

    world (ranks 0-2): first disagreement at sequence 5:
      ranks 0, 2 called allreduce(4096 B float32, recursive-doubling) [started]
      rank 1 never reached it (last: #4 allreduce, done)
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from mpi4py import MPI

DIR_ENV = "DTLAB_FLIGHT_DIR"
ENTRIES_ENV = "DTLAB_FLIGHT_ENTRIES"
DEFAULT_ENTRIES = 256
TRIGGER = "ABORT"
_JOB_ENVS = ("SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID", "FLUX_JOB_ID")
_STARTED = time.time()


class _Entry:
    __slots__ = ("algo", "comm", "done", "dtype", "end", "nbytes", "op", "peer", "seq", "start")

    def __init__(self):
        self.comm = self.seq = -1


class _Ring:
    def __init__(self, capacity: int):
        self.entries = [_Entry() for _ in range(capacity)]
        self.count = itertools.count()  # next() is atomic under the GIL


def _capacity() -> int:
    raw = os.environ.get(ENTRIES_ENV, "")
    try:
        n = int(raw) if raw else DEFAULT_ENTRIES
    except ValueError:
        raise ValueError(f"{ENTRIES_ENV} must be a whole number of entries, not {raw!r}") from None
    if n < 0:
        raise ValueError(f"{ENTRIES_ENV} must be 0 (off) or more, not {n}")
    return n


_RING = _Ring(max(1, _capacity()))
_COMMS: list[dict] = []  # one description per recorder, in creation order
_dumped = False


class Recorder:
    """One communicator's sequence numbers; its calls go into the process's ring.

    name: the communicator's name; world_ranks: its members' COMM_WORLD ranks.
    Communicators are created collectively, in the same order on every member,
    so the n-th recorder of one (name, members) pair is the same one on all.
    """

    __slots__ = ("index", "seq")

    def __init__(self, name: str, rank: int, world_ranks: list[int]):
        twins = sum(c["name"] == name and c["ranks"] == world_ranks for c in _COMMS)
        self.index, self.seq = len(_COMMS), 0
        _COMMS.append({"key": name if not twins else f"{name}#{twins}", "name": name,
                       "rank": rank, "ranks": list(world_ranks), "recorder": self})

    def start(self, op: str, nbytes: int, dtype, algo: str, peer: int = -1) -> _Entry:
        """Record the entry into collective `op`; pass the result to done()."""
        ring = _RING
        entries = ring.entries
        e = entries[next(ring.count) % len(entries)]
        self.seq += 1
        e.comm, e.seq, e.op, e.nbytes, e.dtype, e.algo, e.peer = (
            self.index, self.seq, op, nbytes, dtype, algo, peer)
        e.done = False
        e.start = time.monotonic()
        return e

    @staticmethod
    def done(e: _Entry) -> None:
        e.end = time.monotonic()
        e.done = True


class Off:
    """The recorder of a communicator that records nothing (DTLAB_FLIGHT_ENTRIES=0, or
    Communicator(flight=False): what dtlab-bench flight times the recorder against)."""

    __slots__ = ()
    _ENTRY = _Entry()

    def start(self, op: str, nbytes: int, dtype, algo: str, peer: int = -1) -> _Entry:
        return self._ENTRY

    @staticmethod
    def done(e: _Entry) -> None:
        pass


def recorder(name: str, rank: int, world_ranks: list[int], on: bool = True) -> Recorder | Off:
    """A communicator's recorder: Off when `on` is False or DTLAB_FLIGHT_ENTRIES is 0."""
    return Recorder(name, rank, world_ranks) if on and _capacity() else Off()


def flight_dir() -> Path:
    """Where dumps go: DTLAB_FLIGHT_DIR, else ./dtlab-flight-<jobid>."""
    given = os.environ.get(DIR_ENV)
    if given:
        return Path(given)
    job = next((os.environ[v] for v in _JOB_ENVS if os.environ.get(v)), None)
    return Path(f"dtlab-flight-{job or f'ppid{os.getppid()}'}").absolute()


def snapshot(reason: str, extra: dict | None = None) -> dict:
    """This rank's ring and communicators as a JSON-able dict (oldest entry first)."""
    wall = time.time() - time.monotonic()
    entries = sorted((e for e in list(_RING.entries) if e.seq >= 0),
                     key=lambda e: (e.start, e.comm, e.seq))
    return {
        "rank": MPI.COMM_WORLD.Get_rank(), "world_size": MPI.COMM_WORLD.Get_size(),
        "host": socket.gethostname(), "pid": os.getpid(), "time": time.time(),
        "reason": reason, **(extra or {}),
        "communicators": [{"key": c["key"], "name": c["name"], "rank": c["rank"],
                           "ranks": c["ranks"], "issued": c["recorder"].seq} for c in _COMMS],
        "entries": [{"comm": _COMMS[e.comm]["key"], "seq": e.seq, "op": e.op,
                     "bytes": int(e.nbytes), "dtype": str(e.dtype), "algo": e.algo,
                     "peer": None if e.peer < 0 else e.peer,
                     "start": round(wall + e.start, 6),
                     "seconds": round(e.end - e.start, 6) if e.done else None,
                     "state": "done" if e.done else "started"} for e in entries],
    }


def dump(reason: str, extra: dict | None = None) -> Path:
    """Write this rank's snapshot to flight_dir()/rank-R.json (atomically); return the path."""
    global _dumped
    _dumped = True
    folder = flight_dir()
    folder.mkdir(parents=True, exist_ok=True)
    rank = MPI.COMM_WORLD.Get_rank()
    path = folder / f"rank-{rank}.json"
    tmp = folder / f".rank-{rank}.json.tmp"
    tmp.write_text(json.dumps(snapshot(reason, extra), indent=1))
    tmp.replace(path)
    return path


def signal_abort() -> None:
    """Tell every rank's watchdog (through the ABORT file) to dump its ring."""
    (flight_dir() / TRIGGER).write_text(f"rank {MPI.COMM_WORLD.Get_rank()}\n")


def _since_start(path: Path) -> bool:
    """Whether `path` was written since this job started (not by an earlier one)."""
    try:
        return path.stat().st_mtime >= _STARTED - 1
    except OSError:
        return False


def abort_signalled() -> bool:
    """Whether another rank of this job signalled an abort we have not dumped for."""
    return not _dumped and _since_start(flight_dir() / TRIGGER)


def wait_for_dumps(grace_s: float) -> int:
    """Wait up to `grace_s` until every rank's dump since this process started is
    there; return how many are."""
    folder, size = flight_dir(), MPI.COMM_WORLD.Get_size()
    deadline = time.monotonic() + grace_s
    while True:
        fresh = sum(_since_start(folder / f"rank-{r}.json") for r in range(size))
        if fresh == size or time.monotonic() > deadline:
            return fresh
        time.sleep(0.05)


# ---- the analyser -----------------------------------------------------------

class DumpError(ValueError):
    """A flight directory or dump that cannot be read."""


@dataclass
class Finding:
    """The first sequence number of one communicator the ranks disagree on."""

    comm: str
    ranks: list[int]
    seq: int
    groups: list[tuple[str, list[int]]]  # (what they called, world ranks)
    missing: list[tuple[int, str]]  # (world rank, its last call)

    def text(self) -> str:
        lines = [f"{self.comm} (world ranks {_span(self.ranks)}): first disagreement at "
                 f"sequence {self.seq}:"]
        lines += [f"  {_who(rs)} called {what}" for what, rs in self.groups]
        lines += [f"  rank {r} never reached it (last: {last})" for r, last in self.missing]
        return "\n".join(lines)


def load(folder: Path) -> dict[int, dict]:
    """Every rank-R.json in `folder`, by world rank."""
    if not folder.is_dir():
        raise DumpError(f"{folder}: no such flight directory")
    dumps = {}
    for path in sorted(folder.glob("rank-*.json")):
        try:
            d = json.loads(path.read_text())
            if not isinstance(d.get("communicators"), list) or not isinstance(
                    d.get("entries"), list):
                raise ValueError("no communicators or entries")
            dumps[int(d["rank"])] = d
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise DumpError(f"{path}: not a flight-recorder dump ({e})") from None
    if not dumps:
        raise DumpError(f"{folder}: no rank-*.json dumps")
    return dumps


def _span(ranks: list[int]) -> str:
    if ranks == list(range(ranks[0], ranks[0] + len(ranks))) and len(ranks) > 2:
        return f"{ranks[0]}-{ranks[-1]}"
    return ", ".join(map(str, ranks))


def _who(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def _call(e: dict) -> str:
    root = f", root {e['peer']}" if e["peer"] is not None else ""
    return f"{e['op']}({e['bytes']} B {e['dtype']}, {e['algo']}{root}) [{e['state']}]"


def _signature(e: dict) -> tuple:
    """What every member must agree on (an all-to-all's sizes differ by rank)."""
    if e["op"].endswith("alltoallv"):
        return ("alltoallv", e["dtype"])
    return (e["op"], e["bytes"], e["dtype"], e["peer"])


def analyse(dumps: dict[int, dict]) -> list[Finding]:
    """Per communicator (that some rank dumped), its first disagreement, if any."""
    comms: dict[tuple, dict] = {}  # (key, ranks) -> world rank -> (issued, {seq: entry})
    for r, d in dumps.items():
        for c in d["communicators"]:
            comms.setdefault((c["key"], tuple(c["ranks"])), {})[r] = (c["issued"], {})
        keyed = {c["key"]: tuple(c["ranks"]) for c in d["communicators"]}
        for e in d["entries"]:
            comms[(e["comm"], keyed[e["comm"]])][r][1][e["seq"]] = e
    findings = []
    for (key, members), seen in comms.items():
        members = [m for m in members if m in seen]
        first = max((min(s) if s else issued + 1) for issued, s in seen.values())
        top = max(issued for issued, _ in seen.values())
        for seq in range(first, top + 1):
            groups: dict[tuple, tuple[str, list[int]]] = {}
            missing = []
            for m in members:
                issued, entries = seen[m]
                if issued < seq:
                    last = entries.get(issued)
                    missing.append((m, f"#{issued} {last['op']}, {last['state']}"
                                    if last else f"#{issued}"))
                else:
                    e = entries[seq]
                    groups.setdefault(_signature(e), (_call(e), []))[1].append(m)
            if missing or len(groups) > 1:
                ordered = sorted(groups.values(), key=lambda g: (-len(g[1]), g[1]))
                findings.append(Finding(key, list(members), seq, ordered, missing))
                break
    return findings


def report(dumps: dict[int, dict]) -> str:
    """The analyser's text: missing dumps, then one paragraph per disagreement."""
    size = max(d["world_size"] for d in dumps.values())
    lines = [f"flight recorder: dumps of {len(dumps)} of {size} ranks"]
    absent = [r for r in range(size) if r not in dumps]
    if absent:
        lines.append(f"  no dump from {_who(absent)} (exited, killed, or on another node)")
    for r in sorted(dumps):
        lines.append(f"  rank {r}: {dumps[r]['reason'].strip().splitlines()[0]}")
    findings = analyse(dumps)
    lines += [f.text() for f in findings]
    if not findings:
        lines.append("every communicator's ranks agree on every recorded call")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dtlab.collective.transport.flight",
                                description="Explain a hang from the flight-recorder dumps.")
    p.add_argument("dir", type=Path, help="the flight directory (DTLAB_FLIGHT_DIR)")
    args = p.parse_args(argv)
    try:
        print(report(load(args.dir)))
    except DumpError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
