"""One Chrome trace per run (dtlab-compare --trace), merged from its processes' traces.

Every sync rank writes OUT/NAME.trace.R.json, every parameter-server shard
OUT/NAME.trace.sK.json (received pushes, optimizer applies, pulls waiting for
their SSP / BSP turn) and every async worker OUT/NAME.trace.wK.json
(models/run/trace.py: complete events on the wall clock, so the files of one
host line up; pid = the rank, shard or worker number). After the run,
models/run/trace.merge joins them into OUT/NAME.trace.json, process i of the
files (ranks, then shards, then workers, by number) shifted to pid i (pid_offsets), so
that every process is its own track in Perfetto (ui.perfetto.dev, "Open trace
file") or chrome://tracing. A failed run merges the files its processes wrote.
"""

from __future__ import annotations

import re
from pathlib import Path

from dtlab.lab.compare.runner import Outcome
from dtlab.models.run.trace import merge


def process_files(out: Path, name: str) -> list[tuple[Path, int]]:
    """(file, its pid) of every process trace of run `name`: ranks, shards, then workers,
    by number."""
    pattern = re.compile(rf"{re.escape(name)}\.trace\.([sw]?)(\d+)\.json")
    found = []
    for path in out.iterdir():
        m = pattern.fullmatch(path.name)
        if m:
            found.append((m[1], int(m[2]), path))
    return [(path, number) for _, number, path in sorted(found)]


def merge_run(outcome: Outcome, out: Path) -> None:
    """Merge the run's process traces into OUT/NAME.trace.json (outcome.trace), if any."""
    files = process_files(out, outcome.spec.name)
    if not files:
        return
    target = out / f"{outcome.spec.name}.trace.json"
    merge([str(p) for p, _ in files], str(target),
          pid_offsets=[i - pid for i, (_, pid) in enumerate(files)])
    outcome.trace = target
