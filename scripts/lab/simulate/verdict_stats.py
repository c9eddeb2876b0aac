"""The verdict's statistics, measured once and kept: each (method, N) simulation of
simulate/statistical.py stored in a JSON file the verdict reads, so a table or plot is
redrawn, and more N or methods added, without training again.

    cache = Statistics.open("runs/verdict/statistics.json")
    got = measure(setup, methods, [8, 16, 32, 64], target, eval_every, speeds, cache,
                  jobs=2, log=sys.stderr)           # simulates only the cells not stored
    got.points                                     # {label: {N: steps or None}}

A cell is found by its key: the model, data, optimizer, seed, batch, budget (--steps),
held-out samples and cadence, the method and N, for asp and ssp the workers' speeds
(every input of its simulation but the target; any change is a new cell). A cell keeps
its held-out curve and the target it ran to, so it answers any target it ran past: one
its curve reached (the first evaluation at or below it), or any at all when it ran the
whole budget or diverged; only a lower target than a reached one is simulated again.
The file records, beside the cells, each command that added to it (`commands`):
rerunning them regenerates it. Every cell is written as soon as it finishes, so an
interrupted run keeps what it did.

Cost: a cell trains per-worker steps x N x batch samples (to the target or the budget).
The cells run in `jobs` processes at once, largest N first, each held to one BLAS
thread: a batch of 16 sequences is too small to gain from threads, and on a shared
host several threads per process cost several times the single thread's time.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from threadpoolctl import threadpool_limits

from dtlab.lab.simulate.arrivals import Speeds
from dtlab.lab.simulate.statistical import Method, steps_to_target
from dtlab.models.config import ConfigError
from dtlab.models.run.session import Setup

FORMAT = "dtlab-verdict statistics 1"


def key(setup: Setup, method: Method, n: int, eval_every: int, speeds: Speeds) -> str:
    """A cell's key: a digest of every input of its simulation (module docstring)."""
    run = setup.run
    inputs = {"model_name": setup.model_name, "model": asdict(setup.model),
              "data": asdict(setup.data), "optim": asdict(setup.optim),
              "run": {"steps": run.steps, "batch_size": run.batch_size, "seed": run.seed,
                      "dtype": run.dtype, "eval_samples": run.eval_samples},
              "eval_every": eval_every, "method": method.label, "n": n,
              # the speeds change only the async push order (the others are lockstep)
              "speeds": asdict(speeds) if method.kind in ("asp", "ssp") else None}
    text = json.dumps(inputs, sort_keys=True, default=str)
    return f"{method.label}@{n}:{hashlib.sha256(text.encode()).hexdigest()[:16]}"


@dataclass
class Statistics:
    """The cells stored in one JSON file (or none: path None keeps them in memory)."""

    path: Path | None
    cells: dict = field(default_factory=dict)  # key -> statistical.Result as a dict
    commands: list = field(default_factory=list)

    @classmethod
    def open(cls, path: str | Path | None) -> Statistics:
        if path is None or not Path(path).exists():
            return cls(None if path is None else Path(path))
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"--statistics {path}: not readable JSON ({e})") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ConfigError(f"--statistics {path}: not a verdict statistics file "
                              f"(format {FORMAT!r})")
        return cls(Path(path), data["cells"], data.get("commands", []))

    def note_command(self, argv: list[str]) -> None:
        command = " ".join(["python -m dtlab.lab.simulate.verdict", *argv])
        if command not in self.commands:
            self.commands.append(command)

    def put(self, k: str, result: dict) -> None:
        self.cells[k] = json.loads(json.dumps(result))  # as read back: lists, not tuples
        self.save()

    def save(self) -> None:
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"format": FORMAT, "commands": self.commands,
                                   "cells": self.cells}, indent=1))
        os.replace(tmp, self.path)


@dataclass
class Measured:
    points: dict  # {label: {N: per-worker steps or None}}
    runs: list  # each cell's Result as a dict, in the order of the table
    simulated_now: int  # cells simulated in this call (the others were read)


def answers(cell: dict | None, target: float) -> bool:
    """Whether a stored cell holds the steps to `target` (module docstring)."""
    return cell is not None and (cell["steps"] is None or cell["target"] <= target)


def at_target(cell: dict, target: float) -> dict:
    """The cell as a simulation to `target` would have ended (its curve cut there)."""
    reached = [i for i, (_, loss) in enumerate(cell["curve"]) if loss <= target]
    if not reached:
        return {**cell, "steps": None, "target": target}
    curve = cell["curve"][: reached[0] + 1]
    return {**cell, "steps": curve[-1][0], "curve": curve, "target": target,
            "diverged": None}


def one_cell(indexed) -> tuple[int, dict]:
    """Simulate one cell with one BLAS thread (a pool's task): (its index, its Result
    and the target it ran to)."""
    i, (setup, method, n, target, eval_every, speeds) = indexed
    with threadpool_limits(limits=1):
        r = asdict(steps_to_target(setup, method, n, target, eval_every, speeds))
    return i, {**r, "target": target}


def describe(r: dict) -> str:
    if r.get("diverged"):
        tail = f"diverged at step {r['diverged']}"
    elif r["steps"] is None:
        last = r["curve"][-1] if r["curve"] else None
        tail = "not reached" + (f", held-out {last[1]:.4f} at step {last[0]}" if last else "")
    else:
        tail = f"{r['steps']} steps"
    return f"# simulated {r['method']} N = {r['n']}: {tail} ({r['seconds']:.0f} s)"


def measure(setup: Setup, methods: list[Method], sizes: list[int], target: float,
            eval_every: int, speeds: Speeds, cache: Statistics, jobs: int = 1, log=sys.stderr,
            simulate: bool = True) -> Measured:
    """Every method's steps to target at every N of `sizes`, read from the cache or
    simulated (`jobs` processes at once) and stored; simulate False: a ConfigError naming
    the cells the cache lacks."""
    wanted = [(m, n) for m in methods if not m.same_steps_as for n in sizes]
    keys = {(m, n): key(setup, m, n, eval_every, speeds) for m, n in wanted}
    missing = [(m, n) for m, n in wanted if not answers(cache.cells.get(keys[m, n]), target)]
    if missing and not simulate:
        raise ConfigError(f"--statistics {cache.path}: no simulation of " + ", ".join(
            f"{m.label} at N = {n}" for m, n in missing) + " with this model, data, budget, "
            "speeds and a target as high (leave out --cached-only to simulate them)")
    missing.sort(key=lambda c: -c[1])  # the largest N first: the longest tasks start first
    tasks = list(enumerate((setup, m, n, target, eval_every, speeds) for m, n in missing))
    if jobs > 1 and len(tasks) > 1:
        with multiprocessing.get_context("spawn").Pool(min(jobs, len(tasks))) as pool:
            done = pool.imap_unordered(one_cell, tasks)
            for i, r in done:  # each stored as it finishes
                cache.put(keys[missing[i]], r)
                print(describe(r), file=log, flush=True)
    else:
        for i, r in map(one_cell, tasks):
            cache.put(keys[missing[i]], r)
            print(describe(r), file=log, flush=True)
    points: dict = {}
    runs = []
    for m, n in wanted:
        r = at_target(cache.cells[keys[m, n]], target)
        points.setdefault(m.label, {})[n] = r["steps"]
        runs.append(r)
    return Measured(points, runs, len(missing))
