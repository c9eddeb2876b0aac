"""Starting processes, following the trees under them, and stopping all of it.

Every process is started in a new session, so that the terminal's Ctrl-C
reaches this script only. mpiexec's proxy and ranks start sessions of their
own, so no process group holds a run: `Processes` records the tree under
each process it started (from /proc, whenever `track` runs), each member by
pid and start time, so that a member is found again after its parent died
and a pid the system reused is never signalled. Stopping signals every
recorded member: SIGTERM, then SIGKILL after a grace period.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path

GRACE_S = 10.0  # SIGTERM -> SIGKILL


class Processes:
    """Every process this comparison started, and every process seen below them."""

    def __init__(self):
        self.live: list[subprocess.Popen] = []
        self.tree: dict[int, set[tuple[int, int]]] = {}  # started pid -> {(pid, start time)}

    def start(self, cmd: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
        with open(log, "w") as f:
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True,
                                    env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        self.live.append(proc)
        self.tree[proc.pid] = set()
        return proc

    def track(self) -> None:
        table = process_table()
        children: dict[int, list[int]] = {}
        for pid, (ppid, _) in table.items():
            children.setdefault(ppid, []).append(pid)
        for p in self.live:
            # not reaped yet: its pid is still its own, even as a zombie
            todo = [p.pid] if p.returncode is None and p.pid in table else []
            members = self.tree[p.pid]
            while todo:
                pid = todo.pop()
                members.add((pid, table[pid][1]))
                todo += children.get(pid, [])

    def stop(self, procs: list[subprocess.Popen], grace_s: float = GRACE_S) -> None:
        """SIGTERM every process of their trees, SIGKILL what is left after grace_s."""
        self.track()
        members = set().union(*(self.tree.pop(p.pid, set()) for p in procs))
        _signal(members, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            for p in procs:
                p.poll()  # reaps the started ones, so that they read as gone
            if not _alive(members):
                break
            time.sleep(0.05)
        _signal(members, signal.SIGKILL)
        for p in procs:
            p.wait()
            self.live.remove(p)
        deadline = time.monotonic() + grace_s
        while _alive(members) and time.monotonic() < deadline:
            time.sleep(0.05)

    def stop_all(self) -> None:
        self.stop(list(self.live))


def process_table() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, start time in clock ticks) of every process, from /proc."""
    table = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                with open(f"/proc/{entry.name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()  # after "pid (comm)"
            except (OSError, IndexError):
                continue  # it ended while we looked
            table[int(entry.name)] = (int(fields[1]), int(fields[19]))
    return table


def _alive(members: set[tuple[int, int]]) -> set[tuple[int, int]]:
    """The members still running (a zombie has ended: state Z)."""
    out = set()
    for pid, start in members:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[19]) == start and fields[0] != "Z":
            out.add((pid, start))
    return out


def _signal(members: set[tuple[int, int]], sig: int) -> None:
    for pid, _ in _alive(members):
        with contextlib.suppress(ProcessLookupError):  # it ended just now
            os.kill(pid, sig)
