"""Chrome traces: what each process did when, in the JSON that Perfetto opens.

    trace = Trace("runs/sync.rank{rank}.trace.json", pid=rank, process="sync rank 1")
    trace.span("compute", t0, t1)               # perf_counter seconds
    trace.close()                                # writes {"traceEvents": [...]}
    merge(["a.json", "b.json"], "run.trace.json")

Events are complete events ("ph": "X") with microsecond timestamps on the
wall clock (time.time at the trace's start plus perf_counter offsets), so
the files of several processes on one host line up when merged. pid is the
rank (or worker / server number), tid the phase: one timeline row per phase,
named by metadata events (Chrome trace event format, "Trace Event Format",
Google, 2016).
"""

from __future__ import annotations

import json
import os
import time

PHASES = ("compute", "comm", "wait", "optimizer", "eval", "pipeline", "apply")


class Trace:
    """Spans of one process, written to `path` by close() (nothing if path is empty)."""

    def __init__(self, path: str, pid: int, process: str, worker: int | None = None):
        """`path` may hold {rank} (= pid) and {worker} (default: pid too; a worker
        group's ranks share their worker number but not their pid)."""
        self.path, self.pid = path.format(rank=pid, worker=pid if worker is None else worker), pid
        self._wall0, self._perf0 = time.time(), time.perf_counter()
        self.events: list[dict] = [
            {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": process}},
            *({"ph": "M", "name": "thread_name", "pid": pid, "tid": i, "args": {"name": phase}}
              for i, phase in enumerate(PHASES))]

    @property
    def enabled(self) -> bool:
        return bool(self.path)

    def span(self, name: str, start: float, end: float, phase: str | None = None,
             **args) -> None:
        """A span from perf_counter `start` to `end` on the row of `phase` (default: name)."""
        if not self.path:
            return
        event = {"ph": "X", "name": name, "pid": self.pid,
                 "tid": PHASES.index(phase or name), "ts": self._micros(start),
                 "dur": max(0.0, (end - start) * 1e6)}
        if args:
            event["args"] = args
        self.events.append(event)

    def _micros(self, perf: float) -> float:
        return (self._wall0 + (perf - self._perf0)) * 1e6

    def close(self) -> None:
        if self.path:
            write_events(self.path, self.events)


def write_events(path: str, events: list[dict]) -> None:
    """{"traceEvents": events} to `path`, atomically."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
    os.replace(tmp, path)


def merge(paths: list[str], out: str, pid_offsets: list[int] | None = None) -> int:
    """One trace of several processes' files (pids shifted by `pid_offsets` where two
    files share a pid); returns the number of events."""
    events: list[dict] = []
    for i, path in enumerate(paths):
        with open(path) as f:
            these = json.load(f)["traceEvents"]
        shift = pid_offsets[i] if pid_offsets else 0
        events += [{**e, "pid": e["pid"] + shift} for e in these]
    write_events(out, events)
    return len(events)
