"""Expert parallelism: the MoE layer's experts spread over the ranks of an `ep` group
(GShard, Lepikhin et al. 2021, section 2.2; Switch Transformer, Fedus et al. 2021), with
the dispatched rows moved to their experts' ranks and back by all-to-all(v).

An ep group of e ranks splits N experts into contiguous blocks: rank r holds experts
[r E, (r + 1) E), E = N / e. Each rank routes its own tokens, so its dispatched rows
(grouped by expert, models/moe.py) are already grouped by destination rank:

    rank s:   xs (A_s, d) rows of experts 0..N-1      send_counts[r] = rows for rank r's E
    all-to-all(v)  ->  rank r: rows from s = 0..e-1, each source's block grouped by
                       expert: counts C (e, E); reordered expert-major (every source's rows
                       of expert a, sources in order) so each expert's rows are contiguous
    experts on their rows, reordered back, all-to-all(v) back, combined where they came from

The backward pass makes the same two exchanges with the gradients of the rows.

Chunked overlap (`chunks` k > 1; Tutel, Hwang et al. 2023, and DeepSpeed-MoE's
pipelined all-to-all): every expert's rows are cut into k equal parts, chunk c taking
part c of each. The exchanges run on one helper thread in a fixed order (every chunk's
dispatch, then each chunk's return as soon as its experts are done), so chunk c+1's
all-to-all runs while the calling thread computes chunk c, and chunk c's return while it
computes chunk c+1. MPI waits and NumPy's matmuls release the GIL. Per row the result
is the same as with one chunk; a weight gradient is summed over the chunks' rows.

The per-(source, expert, chunk) counts travel once per forward in one small all-to-all;
the backward pass reuses them. The MoE layer's "compute" phase time (models/moe_stats.py)
includes the exchanges.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from dtlab.models.backend import array_module
from dtlab.models.comm import Comm


def source_to_expert(counts) -> np.ndarray:
    """Indices reordering rows laid out source-major (for s: for e: counts[s, e] rows) into
    expert-major order (for e: for s: ...); counts (S, E) host ints; returns (sum,) int64."""
    counts = np.asarray(counts, dtype=np.int64)
    start = (np.cumsum(counts.reshape(-1)) - counts.reshape(-1)).reshape(counts.shape)
    c_em, st_em = counts.T.reshape(-1), start.T.reshape(-1)  # blocks in expert-major order
    at = np.cumsum(c_em) - c_em  # where each block lands
    total = int(c_em.sum())
    return np.arange(total) + np.repeat(st_em - at, c_em)


def chunk_rows(counts, k: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Rows grouped by expert (counts (N,)) cut into k chunks, chunk c taking part c of
    every expert's rows: [(row indices (A_c,), counts per expert (N,))] for c = 0..k-1."""
    counts = np.asarray(counts, dtype=np.int64)
    start = np.cumsum(counts) - counts  # (N,)
    out = []
    for c in range(k):
        lo, hi = (c * counts) // k, ((c + 1) * counts) // k  # (N,) within each expert
        cc = hi - lo
        at = np.cumsum(cc) - cc
        idx = np.arange(int(cc.sum())) + np.repeat(start + lo - at, cc)
        out.append((idx, cc))
    return out


@dataclass
class ChunkPlan:
    """One chunk's exchange: its rows of the local dispatch, the rows per destination,
    the rows arriving from each source per local expert (e, E), and their reordering."""

    rows: object  # (A_c,) indices into the dispatched rows
    send: list[int]  # (e,) rows to each rank
    arrive: np.ndarray  # (e, E) rows from each source for each local expert
    order: object  # (sum arrive,) source-major -> expert-major

    @property
    def recv(self) -> list[int]:
        return [int(v) for v in self.arrive.sum(axis=1)]

    @property
    def local_counts(self) -> list[int]:
        return [int(v) for v in self.arrive.sum(axis=0)]


class ExpertParallel:
    """How an MoE layer's experts are spread: `comm` the ep group; `alltoallv` the
    exchange (default comm.alltoallv; a launcher may hand MPI's); `chunks` the overlap
    chunks; `loads` the ranks whose expert loads the bias balancing sums (all the ranks
    with their own tokens: dp x ep); `group` this rank's token group (its data rank: the
    router noise's seed)."""

    def __init__(self, comm: Comm, alltoallv: Callable | None = None, chunks: int = 1,
                 loads: Comm | None = None, group: int = 0):
        if chunks < 1:
            raise ValueError(f"chunks {chunks} must be at least 1")
        self.comm, self.chunks, self.loads, self.group = comm, chunks, loads, group
        self.alltoallv = alltoallv or comm.alltoallv

    def owned(self, n_experts: int) -> range:
        """This rank's experts: [r N/e, (r + 1) N/e)."""
        e, r = self.comm.size, self.comm.rank
        if n_experts % e:
            raise ValueError(f"{n_experts} experts are not divisible by {e} ep ranks")
        E = n_experts // e
        return range(r * E, (r + 1) * E)

    def plan(self, counts, xp) -> list[ChunkPlan]:
        """Cut the local dispatch (rows per expert, counts (N,) host ints) into chunks and
        exchange every chunk's counts with the other ranks (one small all-to-all)."""
        e, k = self.comm.size, self.chunks
        N = len(counts)
        E = N // e
        parts = chunk_rows(counts, k)
        mine = np.stack([cc for _, cc in parts])  # (k, N)
        send = np.ascontiguousarray(mine.reshape(k, e, E).transpose(1, 0, 2)).reshape(-1)
        got, _ = self.alltoallv(send, [k * E] * e, recv_counts=[k * E] * e)
        got = np.asarray(got).reshape(e, k, E)  # (sources, chunks, local experts)
        plans = []
        for c, (idx, cc) in enumerate(parts):
            arrive = got[:, c, :]
            plans.append(ChunkPlan(xp.asarray(idx), [int(v) for v in cc.reshape(e, E).sum(1)],
                                   arrive, xp.asarray(source_to_expert(arrive))))
        return plans

    def run(self, plans: list[ChunkPlan], xs, compute: Callable) -> object:
        """out (A, d) for rows xs (A, d) grouped by expert: each chunk's rows sent to their
        experts' ranks, `compute(c, rows, counts per local expert)` run on the rows that
        arrive (expert-major), the results sent back to their rows."""
        out = array_module(xs).empty_like(xs)  # (A, d)
        if len(plans) == 1:
            self._back(plans[0], compute(0, self._there(plans[0], xs),
                                         plans[0].local_counts), out)
            return out
        pool = ThreadPoolExecutor(1, thread_name_prefix="moe-alltoall")
        try:
            there = [pool.submit(self._there, p, xs) for p in plans]
            back = []
            for c, p in enumerate(plans):
                y = compute(c, there[c].result(), p.local_counts)
                back.append(pool.submit(self._back, p, y, out))
            for b in back:
                b.result()
        except BaseException:
            # no waiting for exchanges the other ranks may never join: the error goes on
            # to the abort handler, which ends the job
            pool.shutdown(wait=False, cancel_futures=True)
            raise
        pool.shutdown()
        return out

    def _there(self, p: ChunkPlan, xs):
        rows, _ = self.alltoallv(xs.take(p.rows, axis=0), p.send, recv_counts=p.recv)
        return rows.take(p.order, axis=0)  # (A_c', d) expert-major

    def _back(self, p: ChunkPlan, y, out) -> None:
        xp = array_module(y)
        by_source = xp.empty_like(y)  # (A_c', d)
        by_source[p.order] = y
        rows, _ = self.alltoallv(by_source, p.recv, recv_counts=p.send)
        out[p.rows] = rows
