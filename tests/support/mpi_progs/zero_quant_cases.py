"""ZeRO++'s quantized collectives (collective/zero/quantized.py) checked and trained in one
launch.

    mpiexec -n 3 python -m mpi4py tests/support/mpi_progs/zero_quant_cases.py CASES.json OUT

1. The quantized all-gather, at lengths that leave segments empty, of one block, of
   several with a partial last one: every rank's output against dequantize(quantize(
   segment q)) of every rank q (the segments re-drawn here), float32 and float64 outputs.
2. The quantized reduce-scatter, int8 and 4 bits, summed and averaged: each rank's segment
   against the float64 sum of the ranks' draws, with the tracked bound (the hops'
   half-scales) and the a-priori one; its bytes against the schedule's count.
3. The training cases of CASES.json ([{"name", "argv"}], dtlab-sync's flags), each
   saving its whole final parameters.

World rank 0 writes OUT/checks.json (1 and 2's figures) and OUT/params.npz (3's).
"""

from __future__ import annotations

import json
import os
import sys

import numpy as np

from dtlab.collective.algorithms.ring import segment_bounds
from dtlab.collective.comm import world
from dtlab.collective.train import parse_args, train
from dtlab.collective.zero.quantized import (
    payload_offsets,
    quantized_allgather,
    quantized_reduce_scatter,
    reduce_scatter_sent,
    slot_bytes,
)
from dtlab.models import backend, quantize

comm = world()
N, r = comm.size, comm.rank
LENGTHS = (1, 2, 7, 256, 1000, 3 * 256 + 5)
PROFILE = (1e-3, 1.0, 30.0, 0.0, 2.0)  # per fifth of a vector: its magnitude (a zero run)


def draw(rank: int, n: int, salt: int) -> np.ndarray:
    """Rank `rank`'s vector of n values, magnitudes from 1e-3 to 30 and a run of zeros."""
    rng = np.random.default_rng(salt * 100 + rank)
    scale = np.repeat(PROFILE, -(-n // len(PROFILE)))[:n]
    return (rng.standard_normal(n) * scale).astype(np.float32)


def block_absmax(v: np.ndarray) -> np.ndarray:
    """(len(v),): each element's block absmax, blocks from v's start (as quantize cuts)."""
    rows = np.abs(np.pad(v, (0, -v.size % quantize.BLOCK))).reshape(-1, quantize.BLOCK)
    return np.repeat(rows.max(axis=1), quantize.BLOCK)[: v.size]


def gather_checks() -> list[dict]:
    out = []
    for n in LENGTHS:
        bounds = segment_bounds(n, N)
        counts = [bounds[q + 1] - bounds[q] for q in range(N)]
        want = np.concatenate([quantize.dequantize(quantize.quantize(
            draw(q, n, 1)[bounds[q]:bounds[q + 1]], 8)) for q in range(N)])  # (n,)
        scratch = np.empty(payload_offsets(counts, 8)[-1], np.uint8)
        for dtype in (np.float32, np.float64):
            got = np.full(n, np.nan, dtype)
            quantized_allgather(comm, draw(r, n, 1)[bounds[r]:bounds[r + 1]], got, counts, 8,
                                scratch)
            out.append({"n": n, "dtype": np.dtype(dtype).name,
                        "exact": bool(np.array_equal(got, want.astype(dtype))),
                        "same_on_every_rank": len(set(comm.mpi.allgather(got.tobytes()))) == 1})
    return out


def scatter_checks() -> list[dict]:
    out = []
    for n in LENGTHS:
        bounds = segment_bounds(n, N)
        lo, hi = bounds[r], bounds[r + 1]
        draws = [draw(q, n, 2) for q in range(N)]
        exact = sum(d.astype(np.float64) for d in draws)[lo:hi]  # (segment,)
        for bits in (8, 4):
            for average in (False, True):
                x = draws[r].copy()
                half = max(slot_bytes(bounds[s + 1] - bounds[s], bits) for s in range(N))
                got = quantized_reduce_scatter(comm, x, bounds, bits,
                                               np.empty(2 * half, np.uint8), average=average,
                                               track_bound=True)
                div = N if average else 1
                err = np.abs(got.mine.astype(np.float64) - exact / div)
                # float32 rounding of the N - 1 additions of partial sums
                rounding = 4 * np.finfo(np.float32).eps * \
                    sum(np.abs(d[lo:hi]).astype(np.float64) for d in draws) / div
                # a priori: N - 1 hops, each partial sum's block absmax at most the ranks'
                # block absmaxes summed (blocks from the segment's start), (1 + 1/(2Q))
                # per earlier hop for the errors it carries
                Q = quantize.QMAX[bits]
                absmax = sum(block_absmax(d[lo:hi]) for d in draws)  # (segment,)
                prior = (N - 1) * absmax / (2 * Q) * (1 + 1 / (2 * Q)) ** (N - 1) / div
                zeros = np.repeat(PROFILE, -(-n // len(PROFILE)))[:n][lo:hi] == 0
                over = err - (got.bound * (1 + 1e-6) + rounding)
                out.append({"n": n, "bits": bits, "average": average,
                            "within_tracked": bool(np.all(over <= 0)),
                            "tracked_within_prior": bool(np.all(got.bound <= prior * (1 + 1e-6))),
                            "zeros_stay_zero": bool(np.all(got.mine[zeros] == 0)),
                            "max_err": float(err.max(initial=0.0)),
                            "max_bound": float(got.bound.max(initial=0.0)),
                            "worst_err_over_bound": float(np.max(
                                err / np.maximum(got.bound + rounding, 1e-30), initial=0.0)),
                            "sent_bytes": got.sent_bytes,
                            "counted": reduce_scatter_sent(bounds, r, bits)})
    return out


def trained(argv: list[str]) -> np.ndarray:
    session, _, _ = train(parse_args(argv))
    return backend.to_host(session.replica.zero.full_values())


cases_path, out_dir = sys.argv[1], sys.argv[2]
checks = {"gather": gather_checks(), "scatter": scatter_checks()}
every = comm.mpi.gather(checks, root=0)
with open(cases_path) as f:
    cases = json.load(f)
params = {c["name"]: trained(c["argv"]) for c in cases}
if r == 0:
    with open(os.path.join(out_dir, "checks.json"), "w") as f:
        json.dump(every, f)
    np.savez(os.path.join(out_dir, "params.npz"), **params)
