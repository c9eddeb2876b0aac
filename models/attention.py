"""Causal multi-head self-attention with an explicit backward pass.

    Attention(Q, K, V) = softmax(Q K^T / sqrt(d_head) + M) V      (Vaswani et al. 2017)

M is the causal mask (-inf above the diagonal), so position t sees 0..t.
Q, K and V come from one fused projection x @ W_qkv, the heads are
concatenated and projected back with W_o, as in GPT-2. The full (T, T)
score matrix is computed (masked entries included), which is what
models/cost.py counts: 4 B T^2 d FLOPs forward, 8 B T^2 d backward.

Backward, per head, with S = Q K^T * scale, A = softmax(S), Y = A V:
    dV = A^T dY
    dA = dY V^T
    dS = A * (dA - rowsum(dA * A)),   rowsum(dA * A) = rowsum(dY * Y)
    dQ = dS K * scale,  dK = dS^T Q * scale
Split over a tensor-parallel communicator (Shoeybi et al. 2019), a rank
runs n_heads / tp heads: the q, k and v columns of its heads (a
ColumnParallelLinear of 3 groups) and the matching rows of W_o (a
RowParallelLinear, whose all-reduce sums the heads' contributions).

With `recompute_scores` (selective activation recomputation, Korthikanti et
al. 2022, "Reducing Activation Recomputation in Large Transformer Models")
the (B, heads, T, T) softmax A is not kept: backward rebuilds it from the
kept q and k by the same operations, so the gradients are bit-identical,
for 2 B T^2 d more FLOPs and B heads T^2 fewer floats held per layer; the
linear layers' inputs and outputs stay kept.

The row sum is taken over (T, d_head) rather than (T, T) through the
identity sum_j dA_ij A_ij = dY_i . sum_j A_ij V_j = dY_i . Y_i (as in
FlashAttention, Dao et al. 2022). The per-head products are written straight
into the (B, T, heads, d_head) layout the projections use, so no transposed
copies are made.

Between the projections, `attend` / `attend_backward` run chunk by chunk of
(batch row, heads), each chunk's (T, T) scores about 1 MB so that they stay in
cache from the product to the softmax and back, and on NumPy the chunks are
shared among as many threads as the BLAS has, each calling it single-threaded
(`over_heads`): a multithreaded BLAS wakes and synchronises its threads for
every (T, T) product, which on a loaded 2-core machine made these products
up to 20x slower than one thread. A product per head is what the
single-threaded BLAS computes whatever the chunking, so the results are
bit-identical (tests/models/test_layers_fused.py); with selective
recomputation a chunk's A is a chunk-sized temporary.
"""

from __future__ import annotations

import math
import threading

from dtlab.models.backend import array_module
from dtlab.models.comm import Comm
from dtlab.models.layers import Linear, Module, numpy_blas, thread_pool
from dtlab.models.tensor_parallel import ColumnParallelLinear, RowParallelLinear


class CausalSelfAttention(Module):
    """n_heads heads over d_model; with `tp`, this rank's n_heads / tp.size of them."""

    def __init__(self, name: str, d_model: int, n_heads: int, std: float = 0.02,
                 out_std: float = 0.02, tp: Comm | None = None, recompute_scores: bool = False):
        if d_model % n_heads:
            raise ValueError(f"d_model {d_model} is not divisible by n_heads {n_heads}")
        self.name, self.d, self.recompute_scores = name, d_model, recompute_scores
        self.hs = d_model // n_heads
        if tp is None:
            self.h = n_heads
            self.qkv = Linear(f"{name}.qkv", d_model, 3 * d_model, std=std)
            self.proj = Linear(f"{name}.proj", d_model, d_model, std=out_std)
        else:
            if n_heads % tp.size:
                raise ValueError(f"{name}: {n_heads} heads are not divisible by the "
                                 f"tensor-parallel size {tp.size}")
            self.h = n_heads // tp.size
            self.qkv = ColumnParallelLinear(f"{name}.qkv", d_model, 3 * d_model, tp, std=std,
                                            groups=3)
            self.proj = RowParallelLinear(f"{name}.proj", d_model, d_model, tp, std=out_std)

    def specs(self):
        return self.qkv.specs() + self.proj.specs()

    def forward(self, P, x):
        qkv, qkv_ctx = self.qkv.forward(P, x)  # (B, T, 3C)
        y, core_ctx = self.attend(qkv)  # (B, T, C)
        out, proj_ctx = self.proj.forward(P, y)
        return out, (qkv_ctx, core_ctx, proj_ctx)

    def attend(self, qkv):
        """Y = softmax(Q K^T / sqrt(d_head) + M) V of the fused projection `qkv` (B, T, 3C):
        (Y as (B, T, C), the context attend_backward needs), one chunk of heads at a time."""
        xp = array_module(qkv)
        B, T, _ = qkv.shape
        nh, hs = self.h, self.hs  # this rank's heads
        q, k, v = qkv.reshape(B, T, 3, nh, hs).transpose(2, 0, 3, 1, 4)  # 3 x (B, nh, T, hs)
        kept = None if self.recompute_scores else xp.empty((B, nh, T, T), dtype=qkv.dtype)
        y = xp.empty((B, T, nh, hs), dtype=qkv.dtype)
        y_heads = y.transpose(0, 2, 1, 3)  # (B, nh, T, hs) view
        mask = _causal_mask(xp, T, qkv.dtype)

        def chunk(i):  # i: (batch slice, head slice)
            a = self._softmax(xp, q[i], k[i], mask, None if kept is None else kept[i])
            xp.matmul(a, v[i], out=y_heads[i])  # Y = A V

        over_heads(xp, chunk, B, nh, T)
        return y.reshape(B, T, nh * hs), (q, k, v, kept)

    def _softmax(self, xp, q, k, mask, out=None):
        """A = softmax(Q K^T / sqrt(d_head) + M), (..., T, T), in place in one buffer."""
        a = xp.matmul(q * (1.0 / math.sqrt(self.hs)), k.swapaxes(-1, -2), out=out)  # scores S
        a += mask
        a -= a.max(axis=-1, keepdims=True)
        xp.exp(a, out=a)
        a *= 1.0 / a.sum(axis=-1, keepdims=True)
        return a

    def backward(self, P, ctx, dout):
        qkv_ctx, core_ctx, proj_ctx = ctx
        dy = self.proj.backward(P, proj_ctx, dout)  # (B, T, C)
        return self.qkv.backward(P, qkv_ctx, self.attend_backward(core_ctx, proj_ctx, dy))

    def attend_backward(self, ctx, y, dy):
        """dqkv (B, T, 3C) of attend's output `y` (B, T, C, the projection's input) and its
        gradient `dy`, chunk by chunk; with recompute_scores, A is rebuilt exactly as forward
        made it."""
        xp = array_module(dy)
        q, k, v, kept = ctx
        B, nh, T, hs = q.shape
        dy = dy.reshape(B, T, nh, hs).transpose(0, 2, 1, 3)  # (B, nh, T, hs) dY
        y = y.reshape(B, T, nh, hs).transpose(0, 2, 1, 3)  # (B, nh, T, hs) Y
        dqkv = xp.empty((B, T, 3, nh, hs), dtype=dy.dtype)
        dq, dk, dv = dqkv.transpose(2, 0, 3, 1, 4)  # 3 x (B, nh, T, hs) views
        mask, scale = _causal_mask(xp, T, dy.dtype), 1.0 / math.sqrt(hs)

        def chunk(i):  # i: (batch slice, head slice)
            a = self._softmax(xp, q[i], k[i], mask) if kept is None else kept[i]
            xp.matmul(a.swapaxes(-1, -2), dy[i], out=dv[i])  # dV = A^T dY
            ds = dy[i] @ v[i].swapaxes(-1, -2)  # (b, h, T, T) dA
            ds -= xp.einsum("bhtd,bhtd->bht", dy[i], y[i])[..., None]  # - rowsum(dY * Y)
            ds *= a  # dS
            dq_i, dk_i = dq[i], dk[i]
            xp.matmul(ds, k[i], out=dq_i)  # dQ = dS K
            xp.matmul(ds.swapaxes(-1, -2), q[i], out=dk_i)  # dK = dS^T Q
            dq_i *= scale
            dk_i *= scale

        over_heads(xp, chunk, B, nh, T)
        return dqkv.reshape(B, T, 3 * nh * hs)


_MASKS: dict = {}


def _causal_mask(xp, T: int, dtype):
    """(T, T) additive mask: 0 on and below the diagonal, -inf above."""
    key = (xp.__name__, T, str(dtype))
    if key not in _MASKS:
        _MASKS[key] = xp.triu(xp.full((T, T), -xp.inf, dtype=dtype), k=1)
    return _MASKS[key]


SCORES_PER_CHUNK = 1 << 18  # (T, T) score floats a chunk aims at: 1 MB, about an L2 cache
# fewer score floats a thread are not worth waking it for: at 2^17 in all (the benchmark's
# small transformer, 8 rows x 4 heads x 64^2) two threads make its step 5% shorter
# (scripts/RESULTS.md, stop 45)
SCORES_PER_THREAD = 1 << 16


def head_chunks(B: int, nh: int, T: int, n: int) -> list[tuple[slice, slice]]:
    """(batch slice, head slice) chunks covering (B, nh): whole batch rows while a row's
    scores are under SCORES_PER_CHUNK, else groups of heads of one row; at least `n`
    chunks where there are that many heads."""
    per_head = T * T
    if nh * per_head <= SCORES_PER_CHUNK and B >= n:
        count = min(B, max(n, -(-B * nh * per_head // SCORES_PER_CHUNK)))
        edges = [B * j // count for j in range(count + 1)]
        return [(slice(edges[j], edges[j + 1]), slice(None)) for j in range(count)]
    group = max(1, min(SCORES_PER_CHUNK // per_head, -(-nh * B // n)))
    return [(slice(b, b + 1), slice(h, h + group)) for b in range(B) for h in range(0, nh, group)]


def over_heads(xp, chunk, B: int, nh: int, T: int) -> None:
    """chunk(i) for every head chunk i of (B, nh): on NumPy, spread over as many threads as
    the BLAS has, each calling it single-threaded; on CuPy, once over the whole batch.

    A (T, T) product per head is too small for a multithreaded BLAS: its threads are woken
    and synchronised once per head, which on a busy machine costs several times the
    product. Heads are independent and each product is computed as the single-threaded
    BLAS computes it, so the results are bit-identical to one batched call."""
    if xp.__name__ != "numpy":
        chunk((slice(None), slice(None)))
        return
    blas = numpy_blas()
    threads = 1 if blas is None else blas.num_threads
    chunks = head_chunks(B, nh, T, threads)
    n = min(threads, len(chunks), B * nh * T * T // SCORES_PER_THREAD)
    # one caller at a time changes the BLAS's thread count (another thread's attention
    # meanwhile runs its chunks as they are)
    if n <= 1 or not _LIMITING.acquire(blocking=False):
        _each(chunk, chunks)
        return
    blas.set_num_threads(1)
    try:
        futures = [thread_pool(n - 1).submit(_each, chunk, chunks[j::n]) for j in range(1, n)]
        try:
            _each(chunk, chunks[0::n])
        finally:
            for f in futures:
                f.result()
    finally:
        blas.set_num_threads(threads)
        _LIMITING.release()


def _each(chunk, chunks) -> None:
    for i in chunks:
        chunk(i)


_LIMITING = threading.Lock()
