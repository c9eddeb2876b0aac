"""Checking that all ranks call the same collective on the same kind of buffer.

Ranks that disagree on a buffer's length would otherwise cut it into
different segments and either hang or silently combine the wrong elements.
Before a collective runs, each rank contributes one row

    (operation, element count, dtype, operation-specific detail)

to a small `MPI_Allgather` (4 int64 per rank), and if any row differs from
rank 0's every rank raises the same `MismatchError`, naming both ranks:

    allreduce: ranks disagree: rank 0 has allreduce(1000 x float32, ring),
    rank 2 has allreduce(999 x float32, ring)

Cost: one small Allgather, as long as a whole small all-reduce or longer
(figures: scripts/RESULTS.md). So the default mode "first" checks the first call of each
distinct signature per communicator (a training loop repeats the same
buffers, so after the first step the check is free), "always" checks every
call (debugging), "never" skips it. Set by the communicator's `check`
argument or DTLAB_COLLECTIVE_CHECK. What "first" cannot see (a rank that
switches to a new size later while the others repeat a checked one) ends in
the stall watchdog's report instead of a hang.
"""

from __future__ import annotations

import os
import zlib

import ml_dtypes
import numpy as np

from dtlab.collective.transport.link import Link

CHECK_ENV = "DTLAB_COLLECTIVE_CHECK"
MODES = ("first", "always", "never")
OPS = ("allreduce", "reduce_scatter", "allgather", "alltoallv", "broadcast")
ALGOS = ("ours", "naive", "mpi")


def dtype_code(dtype) -> int:
    """A dtype's number in the agreement row: the CRC-32 of its name. One-character
    codes do not tell ml_dtypes' types apart (float8_e4m3b11fnuz's is uint64's 'L')."""
    return zlib.crc32(np.dtype(dtype).name.encode())


_NAMES = {dtype_code(t): np.dtype(t).name for t in (
    *(np.dtype(c) for c in np.typecodes["All"] if c not in "OMmSUV"),
    *(getattr(ml_dtypes, n) for n in ("bfloat16", "float8_e4m3fn", "float8_e5m2",
                                      "float8_e4m3b11fnuz", "float8_e4m3fnuz",
                                      "float8_e5m2fnuz", "int4", "uint4")))}


class MismatchError(ValueError):
    """Ranks called a collective with buffers that do not match."""


def resolve_mode(mode: str | None) -> str:
    mode = mode or os.environ.get(CHECK_ENV) or "first"
    if mode not in MODES:
        raise ValueError(f"collective check mode must be one of {MODES}, not {mode!r}")
    return mode


def _describe(row) -> str:
    op, count, code, detail = (int(v) for v in row)
    if not 0 <= op < len(OPS):
        return f"an unknown collective (code {op})"
    name = OPS[op]
    what = f"{count} x {_NAMES.get(code, f'dtype #{code}')}"
    if name == "allreduce":
        what += f", {ALGOS[detail % 8]}" + (", average" if detail >= 8 else "")
    elif name == "broadcast":
        what += f", root {detail}"
    elif name in ("allgather", "alltoallv"):
        what += f", rows of {detail}"
    return f"{name}({what})"


class Agreement:
    """The per-communicator checker; `check` is collective (all ranks call it)."""

    def __init__(self, link: Link, mode: str):
        self.link, self.mode = link, mode
        self.seen: set[tuple[str, int, str, int]] = set()

    def check(self, op: str, count: int, dtype, detail: int = 0) -> None:
        key = (op, count, dtype.name, detail)
        if self.mode == "never" or (self.mode == "first" and key in self.seen):
            return
        link = self.link
        if link.size > 1:
            mine = np.array([OPS.index(op), count, dtype_code(dtype), detail],
                            dtype=np.int64)  # (4,)
            table = np.empty((link.size, 4), dtype=np.int64)  # (N, 4)
            link.watch.waiting(f"{op} size check", None)
            link.comm.Allgather(mine, table)
            link.watch.idle()
            bad = np.flatnonzero((table != table[0]).any(axis=1))
            if bad.size:
                other = int(bad[0])
                w = link.world_ranks
                raise MismatchError(
                    f"{op} on {link.label!r}: ranks disagree: rank 0 (world rank {w[0]}) has "
                    f"{_describe(table[0])}, rank {other} (world rank {w[other]}) has "
                    f"{_describe(table[other])}"
                )
        self.seen.add(key)
