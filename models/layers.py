"""Layers with explicit forward and backward passes.

Every layer is a `Module`:

    specs()                 -> the ParamSpecs it owns (names carry its prefix)
    forward(P, x)           -> (y, ctx)   ctx holds what backward needs
    backward(P, ctx, dy)    -> dx         and accumulates (+=) into P.grads

`P` is a FlatParams. The context is returned rather than kept on the module,
so several micro-batches can be in flight at once (pipeline schedules) and a
wrapper can drop it and recompute it (activation recomputation). Arrays may
have any leading batch shape `(..., d)`; the namespace (NumPy or CuPy) is the
one of the input array.

Speed on the CPU comes from doing less memory traffic, since NumPy runs each
elementwise operation as a separate pass: one GEMM per Linear whatever the
batch shape, elementwise math in place in as few buffers as possible,
einsum for row-wise dot products (no temporary), and float32 throughout
(Python float scalars do not promote under NumPy 2). Backward never writes
into `dy` (Residual hands the same `dy` to its branch and its skip path) nor
into the context, only into arrays it allocated itself. models/cost.py
counts what each context keeps; keep the two in step.
"""

from __future__ import annotations

import math
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from dtlab.models import placement
from dtlab.models.backend import array_module
from dtlab.models.params import FlatParams, ParamSpec

try:
    from dtlab.models import _fused
except ImportError:
    _fused = None


def _one_pass(*arrays) -> bool:
    """Whether models/_fused.c can take these arrays: NumPy, one float dtype, contiguous
    (anything else takes the array lines, which it matches bit for bit)."""
    dtype = arrays[0].dtype
    return (_fused is not None and dtype in (np.float32, np.float64)
            and all(type(a) is np.ndarray and a.dtype == dtype and a.flags.c_contiguous
                    and a.flags.aligned for a in arrays))


def numpy_blas():
    """threadpoolctl's controller of the BLAS NumPy calls (None if it finds none)."""
    if "blas" not in _THREADS:
        from threadpoolctl import ThreadpoolController

        libs = ThreadpoolController().select(user_api="blas").lib_controllers
        ours = [lib for lib in libs if "numpy" in lib.filepath] or libs
        _THREADS["blas"] = ours[0] if ours else None
    return _THREADS["blas"]


def thread_pool(workers: int) -> ThreadPoolExecutor:
    """A pool of `workers` threads of this process (a forked child makes its own), each
    started on its helper's core (models/placement.py)."""
    key = (os.getpid(), workers)
    if key not in _THREADS:
        _THREADS[key] = ThreadPoolExecutor(workers, thread_name_prefix="dtlab-passes",
                                           initializer=placement.bind_pool_thread,
                                           initargs=(workers,))
    return _THREADS[key]


_THREADS: dict = {}
_SPREADING = threading.Lock()  # held by the one caller whose blocks run on the pool
# elements a thread's block of a layer's pass has at least: handing a block to the pool
# thread and waiting for it costs some 40 us; on 2 cores a pass of 256K elements (a bias add
# or GELU backward at 512 x 512) ran up to 2x slower on two threads, one of 1M up to 1.6x faster
THREAD_BLOCK = 1 << 18


def in_blocks(fn, n: int, min_block: int) -> None:
    """fn(lo, hi) over contiguous blocks covering [0, n), on as many threads as NumPy's BLAS
    has (the process's compute threads; the caller is one), each block at least `min_block`
    long and starting at a multiple of 16; one call fn(0, n) when n is too short or another
    thread is already spreading its blocks. For elementwise and row-wise passes in C or
    NumPy, which release the GIL: each element is computed as in one call, so the results
    are bit-identical (as PyTorch's CPU kernels split their loops over its threads)."""
    if n < 2 * max(1, min_block):  # one block: no need to ask the BLAS its threads
        fn(0, n)
        return
    blas = numpy_blas()
    threads = min(1 if blas is None else blas.num_threads, n // max(1, min_block))
    if threads <= 1 or not _SPREADING.acquire(blocking=False):
        fn(0, n)
        return
    try:
        edges = [n * j // threads // 16 * 16 for j in range(threads)] + [n]
        futures = [thread_pool(threads - 1).submit(fn, edges[j], edges[j + 1])
                   for j in range(1, threads)]
        try:
            fn(edges[0], edges[1])
        finally:
            for f in futures:
                f.result()
    finally:
        _SPREADING.release()


class Module:
    name: str = ""

    def specs(self) -> list[ParamSpec]:
        return []

    def forward(self, P: FlatParams, x):
        raise NotImplementedError

    def backward(self, P: FlatParams, ctx, dy):
        raise NotImplementedError


class Linear(Module):
    """y = x @ W + b, with W of shape (d_in, d_out).

    `input_grad=False` (a model's first layer, whose input is data) skips dx = dy W^T and
    returns None, as autograd skips the gradient of an input that does not require one.
    """

    def __init__(self, name: str, d_in: int, d_out: int, bias: bool = True, std: float = 0.02,
                 input_grad: bool = True):
        self.name, self.d_in, self.d_out, self.bias, self.std = name, d_in, d_out, bias, std
        self.input_grad = input_grad

    def specs(self):
        out = [ParamSpec(f"{self.name}.W", (self.d_in, self.d_out), std=self.std)]
        if self.bias:
            out.append(ParamSpec(f"{self.name}.b", (self.d_out,), init="zeros", decay=False))
        return out

    def forward(self, P, x):
        y = x.reshape(-1, self.d_in) @ P[f"{self.name}.W"]  # (N, d_out): one GEMM, any batch shape
        if self.bias:
            b = P[f"{self.name}.b"]
            if array_module(y) is np:  # rows in blocks over the compute threads
                in_blocks(lambda lo, hi: np.add(y[lo:hi], b, out=y[lo:hi]), y.shape[0],
                          max(1, THREAD_BLOCK // self.d_out))
            else:
                y += b
        return y.reshape(*x.shape[:-1], self.d_out), x

    def backward(self, P, x, dy):
        x2 = x.reshape(-1, self.d_in)  # (N, d_in)
        dy2 = dy.reshape(-1, self.d_out)  # (N, d_out)
        P.add_weight_grad(f"{self.name}.W", x2, dy2)  # += x2^T dy2, (d_in, d_out)
        if self.bias:
            P.grads[f"{self.name}.b"] += dy2.sum(axis=0)
        if not self.input_grad:
            return None
        return (dy2 @ P[f"{self.name}.W"].T).reshape(x.shape)  # (..., d_in)


class Embedding(Module):
    """Token embedding plus an optional learned positional embedding.

    x: integer tokens (B, T) -> (B, T, d). Positions 0..T-1 are added when
    `max_len` is given (GPT-2 style learned positions).
    """

    def __init__(self, name: str, vocab: int, d: int, max_len: int | None = None):
        self.name, self.vocab, self.d, self.max_len = name, vocab, d, max_len

    def specs(self):
        out = [ParamSpec(f"{self.name}.W", (self.vocab, self.d))]
        if self.max_len:
            out.append(ParamSpec(f"{self.name}.pos", (self.max_len, self.d), std=0.01))
        return out

    def forward(self, P, tokens):
        y = P[f"{self.name}.W"].take(tokens, axis=0)  # (B, T, d) gather
        if self.max_len:
            T = tokens.shape[-1]
            if T > self.max_len:
                raise ValueError(f"{self.name}: sequence length {T} > max_len {self.max_len}")
            y += P[f"{self.name}.pos"][:T]
        return y, tokens

    def backward(self, P, tokens, dy):
        xp = array_module(dy)
        dW, rows = P.grads[f"{self.name}.W"], dy.reshape(-1, self.d)  # (V, d), (N, d)
        index = tokens.reshape(-1)  # (N,)
        if _one_pass(dW, rows) and index.dtype.kind in "iu":
            # dW[index[i]] += rows[i] in order, in C (models/_fused.c): the same adds in the
            # same order as the ufunc.at below, one row at a time instead of one element
            _fused.rows_add(dW, np.ascontiguousarray(index, dtype=np.intp), rows)
        else:
            # Scatter-add rows dy[i] into dW[tokens[i]]; repeated tokens accumulate. ufunc.at
            # on the flat buffer with one offset per element runs several times faster in
            # NumPy than the row-indexed form (its 1-D fast path); CuPy does it with atomics.
            offsets = (index.reshape(-1, 1) * self.d + xp.arange(self.d)).reshape(-1)  # (N d,)
            xp.add.at(dW.reshape(-1), offsets, rows.reshape(-1))
        if self.max_len:
            T = tokens.shape[-1]
            P.grads[f"{self.name}.pos"][:T] += dy.reshape(-1, T, self.d).sum(axis=0)
        return None  # integer inputs have no gradient


class LayerNorm(Module):
    """y = (x - mean) / sqrt(var + eps) * g + b over the last axis (Ba et al. 2016).

    Backward, with xhat = (x - mean) * rstd and dxhat = dy * g:
        dx = rstd * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat))
    Every row sum is a `sum` over the last axis (NumPy's pairwise summation). On NumPy a
    row's whole forward, and its whole input gradient, run in one call of C each
    (models/_fused.c: the same operations in the same order, its sums added as NumPy's
    pairwise summation adds them, bit-identical): one pass over the rows forward instead
    of 7 NumPy passes, one and the two column sums of the gain's and bias's gradients
    backward instead of 11; the row passes run in blocks of rows spread over the compute
    threads (in_blocks), the column sums whole.
    """

    def __init__(self, name: str, d: int, eps: float = 1e-5):
        self.name, self.d, self.eps = name, d, eps

    def specs(self):
        return [
            ParamSpec(f"{self.name}.g", (self.d,), init="ones", decay=False),
            ParamSpec(f"{self.name}.b", (self.d,), init="zeros", decay=False),
        ]

    def forward(self, P, x):
        xp = array_module(x)
        g, b = P[f"{self.name}.g"], P[f"{self.name}.b"]
        if _one_pass(x, g, b):
            xhat, y = np.empty_like(x), np.empty_like(x)  # (..., d)
            rstd = np.empty((*x.shape[:-1], 1), dtype=x.dtype)  # (..., 1)
            rows = [a.reshape(-1, a.shape[-1]) for a in (y, xhat, rstd, x)]
            in_blocks(lambda lo, hi: _fused.norm_forward(*(a[lo:hi] for a in rows), g, b,
                                                         self.eps),
                      rows[0].shape[0], max(1, THREAD_BLOCK // self.d))
            return y, (xhat, rstd)
        xhat = x - x.mean(axis=-1, keepdims=True)  # (..., d) centred
        var = (xhat * xhat).sum(axis=-1, keepdims=True)  # (..., 1) sum of squares
        var /= self.d
        var += self.eps
        rstd = 1.0 / xp.sqrt(var)  # (..., 1)
        xhat *= rstd
        y = xhat * g
        y += b
        return y, (xhat, rstd)

    def backward(self, P, ctx, dy):
        xp = array_module(dy)
        xhat, rstd = ctx
        g = P[f"{self.name}.g"]
        if _one_pass(dy, xhat, rstd, g):
            tmp, dx = np.empty_like(dy), np.empty_like(dy)  # (..., d)
            rows = [a.reshape(-1, a.shape[-1]) for a in (tmp, dx, dy, xhat, rstd)]
            # tmp = dy xhat and dx; the column sums below stay whole (their order)
            in_blocks(lambda lo, hi: _fused.norm_backward(*(a[lo:hi] for a in rows), g),
                      rows[0].shape[0], max(1, THREAD_BLOCK // self.d))
            P.grads[f"{self.name}.g"] += tmp.reshape(-1, self.d).sum(axis=0)
            P.grads[f"{self.name}.b"] += dy.reshape(-1, self.d).sum(axis=0)
            return dx
        tmp = dy * xhat  # (..., d)
        P.grads[f"{self.name}.g"] += tmp.reshape(-1, self.d).sum(axis=0)
        P.grads[f"{self.name}.b"] += dy.reshape(-1, self.d).sum(axis=0)
        dx = dy * g  # dxhat, (..., d)
        m1 = dx.mean(axis=-1, keepdims=True)  # (..., 1)
        xp.multiply(dx, xhat, out=tmp)
        m2 = tmp.sum(axis=-1, keepdims=True)  # (..., 1)
        m2 /= self.d
        xp.multiply(xhat, m2, out=tmp)
        tmp += m1
        dx -= tmp
        dx *= rstd
        return dx


class RMSNorm(Module):
    """y = x / sqrt(mean(x^2) + eps) * g (Zhang & Sennrich 2019).

    Backward, with xhat = x * rrms and dxhat = dy * g:
        dx = rrms * (dxhat - xhat * mean(dxhat * xhat))
    """

    def __init__(self, name: str, d: int, eps: float = 1e-6):
        self.name, self.d, self.eps = name, d, eps

    def specs(self):
        return [ParamSpec(f"{self.name}.g", (self.d,), init="ones", decay=False)]

    def forward(self, P, x):
        xp = array_module(x)
        ms = xp.einsum("...i,...i->...", x, x)[..., None]  # (..., 1) sum of squares
        ms /= self.d
        ms += self.eps
        rrms = 1.0 / xp.sqrt(ms)  # (..., 1)
        xhat = x * rrms  # (..., d)
        return xhat * P[f"{self.name}.g"], (xhat, rrms)

    def backward(self, P, ctx, dy):
        xp = array_module(dy)
        xhat, rrms = ctx
        tmp = dy * xhat  # (..., d)
        P.grads[f"{self.name}.g"] += tmp.reshape(-1, self.d).sum(axis=0)
        dx = dy * P[f"{self.name}.g"]  # dxhat, (..., d)
        m = xp.einsum("...i,...i->...", dx, xhat)[..., None]  # (..., 1)
        m /= self.d
        xp.multiply(xhat, m, out=tmp)
        dx -= tmp
        dx *= rrms
        return dx


_GELU_C = math.sqrt(2.0 / math.pi)
_GELU_K = 0.044715


class GELU(Module):
    """tanh approximation of GELU (Hendrycks & Gimpel 2016), as in GPT-2:

        gelu(x) = 0.5 x (1 + t),   t = tanh(u),   u = c (x + k x^3),  c = sqrt(2/pi), k = 0.044715
        gelu'(x) = 0.5 (1 + t) + 0.5 x (1 - t^2) u',   u' = c (1 + 3 k x^2)

    Computed in place in two (..., d) buffers each way; the context is (x, t). On NumPy
    the polynomial passes run in one pass of C each (models/_fused.c: the same operations
    in the same order, bit-identical) and tanh is NumPy's: 3 passes forward instead of
    8, one backward instead of 11, each in blocks spread over the compute threads
    (in_blocks).
    """

    def forward(self, P, x):
        xp = array_module(x)
        if _one_pass(x):
            t, y = xp.empty_like(x), xp.empty_like(x)  # (..., d)
            xs, ts, ys = x.reshape(-1), t.reshape(-1), y.reshape(-1)

            def block(lo, hi):
                _fused.gelu_u(ts[lo:hi], xs[lo:hi], _GELU_C * _GELU_K, _GELU_C)
                np.tanh(ts[lo:hi], out=ts[lo:hi])
                _fused.gelu_y(ys[lo:hi], xs[lo:hi], ts[lo:hi])

            in_blocks(block, x.size, THREAD_BLOCK)
            return y, (x, t)
        t = x * x  # (..., d)
        t *= _GELU_C * _GELU_K
        t += _GELU_C
        t *= x  # u
        xp.tanh(t, out=t)
        y = t + 1.0
        y *= x
        y *= 0.5
        return y, (x, t)

    def backward(self, P, ctx, dy):
        x, t = ctx
        if _one_pass(dy, x, t):
            dx = array_module(dy).empty_like(x)  # (..., d)
            flat = [a.reshape(-1) for a in (dx, dy, x, t)]
            in_blocks(lambda lo, hi: _fused.gelu_dx(*(a[lo:hi] for a in flat),
                                                    3 * _GELU_C * _GELU_K, _GELU_C),
                      x.size, THREAD_BLOCK)
            return dx
        dx = x * x  # (..., d)
        dx *= 3 * _GELU_C * _GELU_K
        dx += _GELU_C  # u'
        dx *= x
        tt = t * t
        tt *= dx
        dx -= tt  # x (1 - t^2) u'
        dx += t
        dx += 1.0
        dx *= 0.5
        dx *= dy
        return dx


class ReLU(Module):
    def forward(self, P, x):
        mask = x > 0  # (..., d) bool
        return x * mask, mask

    def backward(self, P, mask, dy):
        return dy * mask


class SwiGLU(Module):
    """Gated feed-forward y = (silu(x W1) * (x W3)) W2 (Shazeer 2020).

    With a = x W1, b = x W3, s = sigmoid(a), h = a s b:
        db = dh * a s,   da = dh * b * s (1 + a (1 - s))     (silu'(a))
    The context keeps (x, a, b, s); h is rebuilt in backward (two products)
    rather than kept.
    """

    def __init__(self, name: str, d: int, d_ff: int, std: float = 0.02, out_std: float = 0.02):
        self.name = name
        self.w1 = Linear(f"{name}.w1", d, d_ff, bias=False, std=std)
        self.w3 = Linear(f"{name}.w3", d, d_ff, bias=False, std=std)
        self.w2 = Linear(f"{name}.w2", d_ff, d, bias=False, std=out_std)

    def specs(self):
        return self.w1.specs() + self.w3.specs() + self.w2.specs()

    def forward(self, P, x):
        xp = array_module(x)
        a, _ = self.w1.forward(P, x)  # (..., d_ff)
        b, _ = self.w3.forward(P, x)  # (..., d_ff)
        s = xp.negative(a)
        xp.exp(s, out=s)
        s += 1.0
        xp.reciprocal(s, out=s)  # sigmoid(a)
        h = a * s
        h *= b  # silu(a) * b
        y, _ = self.w2.forward(P, h)  # (..., d)
        return y, (x, a, b, s)

    def backward(self, P, ctx, dy):
        xp = array_module(dy)
        x, a, b, s = ctx
        sa = a * s  # silu(a), (..., d_ff)
        h = sa * b
        dh = self.w2.backward(P, h, dy)  # (..., d_ff)
        db = sa
        db *= dh
        da = xp.subtract(1.0, s)  # not into h: w2's weight gradient may be deferred
        da *= a
        da += 1.0
        da *= s  # silu'(a)
        da *= b
        da *= dh
        dx = self.w1.backward(P, x, da)
        dx += self.w3.backward(P, x, db)
        return dx


class Sequential(Module):
    """Modules applied in order; backward in reverse.

    `grad_ready(offset)` (optional) is called after each module's backward
    with the lowest buffer offset that module owns: from then on every
    gradient at or above that offset is final, because parameters are laid
    out in forward order. The data-parallel trainer starts a bucket's
    all-reduce from it. Parameters that carry a compute-dtype policy (`P.cast`, a
    mixed-precision working copy: models/precision.py) run each module through it.
    """

    def __init__(self, modules: list[Module]):
        self.modules = modules
        self._names = [[s.name for s in m.specs()] for m in modules]

    def specs(self):
        return [s for m in self.modules for s in m.specs()]

    def forward(self, P, x):
        ctxs = []
        for m in self.modules:
            x, ctx = m.forward(P, x) if P.cast is None else P.cast.forward(m, P, x)
            ctxs.append(ctx)
        return x, ctxs

    def backward(self, P, ctxs, dy, grad_ready=None):
        for m, names, ctx in zip(self.modules[::-1], self._names[::-1], ctxs[::-1], strict=True):
            dy = m.backward(P, ctx, dy) if P.cast is None else P.cast.backward(m, P, ctx, dy)
            if grad_ready is not None and names:
                grad_ready(P.first_offset(names))
        return dy


class Recompute(Module):
    """Activation recomputation (Chen et al. 2016, "gradient checkpointing").

    Keeps only the module's input; backward runs forward again to rebuild
    the context. Costs one extra forward, saves the module's activations.
    """

    def __init__(self, module: Module):
        self.module, self.name = module, module.name

    def specs(self):
        return self.module.specs()

    def forward(self, P, x):
        y, _ = self.module.forward(P, x)
        return y, x

    def backward(self, P, x, dy):
        _, ctx = self.module.forward(P, x)
        return self.module.backward(P, ctx, dy)


class Residual(Module):
    """y = x + f(x): the pre-norm residual branch of a transformer block."""

    def __init__(self, branch: Module):
        self.branch, self.name = branch, branch.name

    def specs(self):
        return self.branch.specs()

    def forward(self, P, x):
        y, ctx = self.branch.forward(P, x)
        return x + y, ctx

    def backward(self, P, ctx, dy):
        return dy + self.branch.backward(P, ctx, dy)
