"""ZeRO's checkpoints: sharded (each dp rank saves its own slice) and universal (a resume
at another dp size cuts the saved slices again), as DeepSpeed's universal checkpoints do
(Rajbhandari et al. 2020, "ZeRO"; the DeepSpeed universal checkpoint format, 2023).

    mpiexec -n 2 python -m dtlab.collective.train --zero 3 --checkpoint-dir ck --steps 50
    mpiexec -n 3 python -m dtlab.collective.train --zero 3 --checkpoint-dir ck --steps 100 \
        --resume            # dp 2 -> dp 3: the shards re-cut for three ranks

Every dp rank writes its own directory (models/run/checkpoint.py, atomic, verified):

    ck/dp<r>of<n>/step-NNNNNNNN/
        params.npy       this rank's master parameters: its segment of every unit, back to
                         back (collective/zero/layout.py's packed layout); float32 under
                         --precision fp16/bf16, whose half copy is their cast
        opt.<name>.npy   each optimizer state buffer's shard, in the same layout
        meta.json        step, config, optimizer steps, data position (epoch, position:
                         the data order's only random state is seeded by (seed, epoch)),
                         loss scaler, MoE routers' noise steps, and "zero": stage, dp,
                         rank, the units and this rank's ranges; rank 0's also
                         "every_rank": every rank's ranges (the manifest)

With --tp or --pp each (pp, tp) shard is sliced over its own dp ranks (Megatron-LM's
distributed optimizer) and every slice has its directory, ck/dp<r>of<n>-pp<r>of<n>-tp<r>of<n>/
(the dimensions of size 1 left out); a shard's resume reads only its own slices, agrees
on the step with every other shard, and re-cuts them for another dp size as below.

A resume finds the newest step that verifies on every shard of a saved dp size (newest
first over the sizes present, this run's on a tie) and cuts it for this run's layout
(`recut`): each unit's new segment is copied from the saved segments it overlaps, so at
the same dp size each rank reads its own file and goes on bit for bit, at another it
reads the one or two files its segments overlap and holds exactly the saved values.
A plain data-parallel checkpoint (ck/step-NNNNNNNN/, the whole buffers) is one shard
holding every unit whole, and is cut the same way (a tensor-split or pipelined plain run's:
ck/pp<r>of<n>-tp<r>of<n>/). What cannot be cut is refused by name before anything changes:
a dp size with a shard directory missing, a grid of another --pp, --ep or --tp, another
config, a shard lacking a state buffer this optimizer needs, or one whose ranges disagree
with the manifest. All stages save the same state, so a checkpoint of one stage resumes
into another.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

import numpy as np

from dtlab.models.run import checkpoint
from dtlab.models.run.checkpoint import CheckpointError
from dtlab.models.run.trainer import shard_grid

DP_DIR = re.compile(r"dp(\d+)of(\d+)(?:-(.+))?")  # dp<q>of<n>[-<model-parallel shard>]


def manifest(zero) -> dict:
    """The "zero" entry of a shard's meta.json: stage, dp, rank, the units (name, lo, hi)
    and this rank's [lo, hi) of each; rank 0's adds every rank's."""
    layout = zero.layout
    out = {"stage": zero.stage, "dp": layout.n, "rank": layout.rank,
           "units": [[u.name, u.lo, u.hi] for u in layout.units],
           "ranges": [list(r) for r in layout.mine]}
    if layout.rank == 0:
        out["every_rank"] = [[[u.lo + b[q], u.lo + b[q + 1]]
                              for u, b in zip(layout.units, layout.bounds, strict=True)]
                             for q in range(layout.n)]
    return out


@dataclass
class Saved:
    """The checkpoints of one saved dp size: shard q's under roots[q] (a plain
    data-parallel checkpoint: one shard, the directory itself)."""

    roots: list[str]
    step: int = -1  # the newest step that verifies in every root, once agreed

    @property
    def shards(self) -> int:
        return len(self.roots)

    def path(self, q: int) -> str:
        return os.path.join(self.roots[q], checkpoint.step_dir(self.step))


def saved_in(directory: str, mine: str, part: str = "") -> list[Saved]:
    """Every saved dp size of model-parallel shard `part` ("pp0of2-tp1of2"; "" for an
    unsplit model) in `directory`, or a CheckpointError naming what cannot be re-sliced:
    a shard grid of another kind, a dp size with shards missing. `mine`: this run's grid
    in words. ZeRO slices are dp<q>of<n>[-part], a plain run's checkpoints are under
    part/ (or `directory` itself); the other (pp, tp) shards' are not this rank's."""
    if not os.path.isdir(directory):
        return []
    found: dict[int, set[int]] = {}
    for name in sorted(os.listdir(directory)):
        if not shard_grid(name):
            continue
        match = DP_DIR.fullmatch(name)
        own = (match[3] or "") if match else name  # the name's model-parallel shard
        if (shard_grid(own) if own else "") != (shard_grid(part) if part else ""):
            raise CheckpointError(f"{directory} holds checkpoints of a run with "
                                  f"{shard_grid(name)}; this run has {mine}: only ZeRO slices "
                                  "and plain checkpoints of the same --pp and --tp can be "
                                  "re-sliced")
        if match and own == part:
            found.setdefault(int(match[2]), set()).add(int(match[1]))
    suffix = f"-{part}" if part else ""
    out = []
    for n, ranks in sorted(found.items()):
        missing = [f"dp{q}of{n}{suffix}" for q in range(n) if q not in ranks]
        if missing:
            raise CheckpointError(f"{directory} holds ZeRO shards of --dp {n} without "
                                  f"{', '.join(missing)}: they cannot be re-sliced (each "
                                  "shard holds its own slice of the parameters and optimizer "
                                  "state)")
        out.append(Saved([os.path.join(directory, f"dp{q}of{n}{suffix}") for q in range(n)]))
    plain = os.path.join(directory, part) if part else directory
    if checkpoint.latest(plain) is not None:
        out.append(Saved([plain]))
    return out


def newest_common(comm, roots: list[str], others=()) -> tuple[int, list]:
    """(step, skipped): the newest step whose checkpoint verifies under every one of
    `roots` (-1: none), rank r of `comm` verifying roots[r::n], and under every rank's of
    the communicators `others` (the model-parallel groups, whose ranks verify their own
    roots) (collective); skipped: (path, why) for the damaged newer ones this rank passed
    over."""
    mine, at_most, skipped = roots[comm.rank::comm.size], None, {}
    none = 1 << 62  # a rank with no roots to verify bounds nothing
    while True:
        steps = []
        for root in mine:
            path, passed = checkpoint.latest_valid(root, at_most)
            skipped.update(passed)
            steps.append(checkpoint.step_of(path) if path else -1)
        bound = (min(steps, default=none), max(steps, default=-1))
        for group in (comm, *others):
            bounds = group.mpi.allgather(bound)
            bound = (min(b[0] for b in bounds), max(b[1] for b in bounds))
        low, high = bound
        if low < 0 or low == high:
            return low, list(skipped.items())
        at_most = low  # the roots above it look again at or below it


def saved_ranges(meta: dict, layout, path: str) -> list[list[tuple[int, int]]]:
    """ranges[q][u]: shard q's [lo, hi) of unit u, from the manifest (rank 0's meta.json
    at `path`; a plain checkpoint's one shard holds every unit whole), checked against
    this run's units and to tile each of them in rank order."""
    units = [(u.name, u.lo, u.hi) for u in layout.units]
    zero = meta.get("zero")
    if zero is None:
        return [[(lo, hi) for _, lo, hi in units]]
    if "every_rank" not in zero:
        raise CheckpointError(f"{path}: its meta.json holds no manifest (\"every_rank\"), "
                              "so its shards cannot be placed")
    if [tuple(u) for u in zero["units"]] != units:
        raise CheckpointError(f"{path}: its units {zero['units']} are not this model's "
                              f"{[list(u) for u in units]}")
    ranges = [[tuple(r) for r in rank] for rank in zero["every_rank"]]
    for u, (name, lo, hi) in enumerate(units):
        cuts = [rank[u] if len(rank) == len(units) else (hi, lo) for rank in ranges]
        if len(ranges) != zero["dp"] or cuts[0][0] != lo or cuts[-1][1] != hi or \
                any(a > b for a, b in cuts) or \
                any(cuts[q][1] != cuts[q + 1][0] for q in range(len(cuts) - 1)):
            raise CheckpointError(f"{path}: the manifest's ranges do not tile unit {name} "
                                  f"[{lo}, {hi}) over its {zero['dp']} ranks")
    return ranges


def recut(ranges: list[list[tuple[int, int]]], mine: list[tuple[int, int]], names: list[str],
          read, dtype) -> dict:
    """name -> this rank's packed shard of each saved buffer (of `dtype`): unit u's segment
    mine[u] = [lo, hi) copied from the saved shards q whose ranges[q][u] overlap it
    (`read(q)`: shard q's arrays, each packed as its ranges say; read once, when needed)."""
    size = sum(hi - lo for lo, hi in mine)
    out = {name: np.empty(size, dtype=dtype) for name in names}  # (shard,) each
    held: dict[int, dict] = {}
    at = 0
    for u, (lo, hi) in enumerate(mine):
        for q, rank in enumerate(ranges):
            qlo, qhi = rank[u]
            a, b = max(lo, qlo), min(hi, qhi)
            if a >= b:
                continue
            if q not in held:
                held[q] = read(q)
            qat = sum(end - start for start, end in rank[:u])  # unit u's place in shard q
            for name in names:
                out[name][at + a - lo : at + b - lo] = held[q][name][qat + a - qlo : qat + b - qlo]
        at += hi - lo
    return out

