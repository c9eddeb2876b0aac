"""Tensor-split (intra-layer) model parallelism, Megatron-LM style.

Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion Parameter Language
Models Using Model Parallelism", section 3. A layer's weight matrix is split
across the `size` ranks of the tensor-parallel communicator `comm`:

    column-parallel  Y_r = X A_r           A = [A_0 ... A_{n-1}] split by columns:
                     X is whole on every rank, Y comes out split by columns
    row-parallel     Y = sum_r X_r B_r     B split by rows: X comes in split by
                     columns, the partial products are summed over the ranks

and the two are joined by conjugate operators (the paper's figure 3):

    f   forward: identity      backward: all-reduce dX    (before a column split)
    g   forward: all-reduce Y  backward: identity         (after a row split)

So an MLP  X -> f -> X A_r -> GeLU -> (.) B_r -> g -> Y  costs one all-reduce
forward (g) and one backward (f), and the hidden activation never leaves its
rank; attention splits the same way by heads (each rank's q, k, v columns
and the matching rows of the output projection).

The vocabulary-parallel embedding holds the rows of its vocabulary slice,
looks up the tokens it owns (zero for the others) and all-reduces (g). The
vocabulary-parallel cross-entropy (section 3, "the output embedding") works
on the logit columns of the rank's vocabulary slice and exchanges per-row
scalars only, never the full logits:

    m    = max over ranks of the local row maxima         (all-gather of (N,))
    s    = sum_r sum_j exp(z_rj - m)                      } one all-reduce
    z_t  = the target's logit, from the rank that owns it } of (N, 2)
    loss = mean(log s - (z_t - m)),  dz_r = (exp(z_r - m) / s - onehot_r) / N

Every shard is a ParamSpec whose index selects its part of the dense tensor,
so a split model starts from its dense twin's exact values; `dense_values`
rebuilds the dense tensors (tests, saving).
"""

from __future__ import annotations

import numpy as np

from dtlab.models.backend import array_module, to_host
from dtlab.models.comm import Comm
from dtlab.models.layers import Embedding, Linear, SwiGLU
from dtlab.models.params import FlatParams, ParamSpec

SPLIT = "tp"  # ParamSpec.split of tensor-split shards ("ep+tp": an expert's, models/moe.py)


def shard_bounds(n: int, comm: Comm, what: str) -> tuple[int, int]:
    """[lo, hi) of this rank's equal share of `n`, or a ValueError naming `what`."""
    if n % comm.size:
        raise ValueError(f"{what} {n} is not divisible by the tensor-parallel size {comm.size}")
    step = n // comm.size
    return comm.rank * step, (comm.rank + 1) * step


def f_backward(comm: Comm, dx):
    """f: the identity forward; backward, the input gradient summed over the ranks
    (each rank's dX covers only its columns' share). In place on a fresh `dx`."""
    return comm.allreduce(dx)


def g_forward(comm: Comm, y):
    """g: the partial products summed over the ranks, in place on a fresh `y`; its
    backward is the identity (every rank needs the whole dY)."""
    return comm.allreduce(y)


class ColumnParallelLinear(Linear):
    """Y_r = f(X) A_r + b_r: this rank's columns of y = x W + b, W (d_in, d_out).

    groups: the output columns form `groups` equal blocks (a fused q | k | v
    projection: 3) and each block is split, so the rank holds the columns of
    its heads in q, k and v. reduce_input_grad: apply f's all-reduce to dX
    here; False when the caller sums dX of several column splits of the same
    input first and reduces once (SwiGLU's gate and up projections).
    """

    def __init__(self, name: str, d_in: int, d_out: int, comm: Comm, bias: bool = True,
                 std: float = 0.02, groups: int = 1, reduce_input_grad: bool = True):
        if d_out % groups:
            raise ValueError(f"{name}: {d_out} output columns are not {groups} equal groups")
        self.block = d_out // groups
        self.lo, self.hi = shard_bounds(self.block, comm, f"{name}: output columns per group")
        super().__init__(name, d_in, groups * (self.hi - self.lo), bias, std)
        self.comm, self.groups, self.full_out = comm, groups, d_out
        self.reduce_input_grad = reduce_input_grad

    def specs(self):
        cols = slice(self.lo, self.hi)
        out = [ParamSpec(f"{self.name}.W", (self.d_in, self.d_out), std=self.std,
                         full_shape=(self.d_in, self.full_out),
                         view=(self.d_in, self.groups, self.block),
                         index=(slice(None), slice(None), cols), split=SPLIT)]
        if self.bias:
            out.append(ParamSpec(f"{self.name}.b", (self.d_out,), init="zeros", decay=False,
                                 full_shape=(self.full_out,), view=(self.groups, self.block),
                                 index=(slice(None), cols), split=SPLIT))
        return out

    def backward(self, P, x, dy):
        dx = super().backward(P, x, dy)  # (..., d_in) this rank's part of dX
        return f_backward(self.comm, dx) if self.reduce_input_grad else dx


class RowParallelLinear(Linear):
    """Y = g(X_r B_r) + b: rows [lo, hi) of W (d_in, d_out); b is replicated.

    The input is this rank's columns of x (a column split's output); the bias
    is added once, after the all-reduce, and its gradient is the same on every rank.
    reduce_output=False leaves g to the caller: the output is this rank's partial
    sum (rank 0's carrying the bias), which a Mixture-of-Experts layer combines over
    its experts before one all-reduce; the bias gradient, sum of dY, is still every
    rank's.
    """

    def __init__(self, name: str, d_in: int, d_out: int, comm: Comm, bias: bool = True,
                 std: float = 0.02, reduce_output: bool = True):
        self.lo, self.hi = shard_bounds(d_in, comm, f"{name}: input rows")
        super().__init__(name, self.hi - self.lo, d_out, bias, std)
        self.comm, self.full_in, self.reduce_output = comm, d_in, reduce_output

    def specs(self):
        out = [ParamSpec(f"{self.name}.W", (self.d_in, self.d_out), std=self.std,
                         full_shape=(self.full_in, self.d_out),
                         index=(slice(self.lo, self.hi), slice(None)), split=SPLIT)]
        if self.bias:
            out.append(ParamSpec(f"{self.name}.b", (self.d_out,), init="zeros", decay=False))
        return out

    def forward(self, P, x):
        y = x.reshape(-1, self.d_in) @ P[f"{self.name}.W"]  # (N, d_out) partial sum
        if self.reduce_output:
            g_forward(self.comm, y)
        if self.bias and (self.reduce_output or self.comm.rank == 0):
            y += P[f"{self.name}.b"]
        return y.reshape(*x.shape[:-1], self.d_out), x

    # backward: Linear's (g's backward is the identity)


class ParallelSwiGLU(SwiGLU):
    """SwiGLU with gate (w1) and up (w3) split by columns, down (w2) by rows.

    silu(x W1_r) * (x W3_r) is elementwise, so it runs on the rank's columns;
    dX of the two column splits is summed, then reduced once (f). reduce=False
    leaves both f and g to the caller (an MoE layer's experts: partial outputs and
    partial dX, each reduced once for all experts).
    """

    def __init__(self, name: str, d: int, d_ff: int, comm: Comm, std: float = 0.02,
                 out_std: float = 0.02, reduce: bool = True):
        self.name, self.comm, self.reduce = name, comm, reduce
        self.w1 = ColumnParallelLinear(f"{name}.w1", d, d_ff, comm, bias=False, std=std,
                                       reduce_input_grad=False)
        self.w3 = ColumnParallelLinear(f"{name}.w3", d, d_ff, comm, bias=False, std=std,
                                       reduce_input_grad=False)
        self.w2 = RowParallelLinear(f"{name}.w2", d_ff, d, comm, bias=False, std=out_std,
                                    reduce_output=reduce)

    def backward(self, P, ctx, dy):
        dx = super().backward(P, ctx, dy)
        return f_backward(self.comm, dx) if self.reduce else dx


class VocabParallelEmbedding(Embedding):
    """Token embedding holding rows [lo, hi) of W (vocab, d); positions replicated.

    Each rank looks up the tokens of its slice (zero rows for the others),
    the all-reduce (g) completes every row; the gradient of W goes to the
    rows of the tokens this rank owns.
    """

    def __init__(self, name: str, vocab: int, d: int, comm: Comm, max_len: int | None = None):
        super().__init__(name, vocab, d, max_len)
        self.comm = comm
        self.lo, self.hi = shard_bounds(vocab, comm, f"{name}: vocabulary")

    def specs(self):
        out = [ParamSpec(f"{self.name}.W", (self.hi - self.lo, self.d), full_shape=(self.vocab,
                         self.d), index=(slice(self.lo, self.hi), slice(None)), split=SPLIT)]
        if self.max_len:
            out.append(ParamSpec(f"{self.name}.pos", (self.max_len, self.d), std=0.01))
        return out

    def forward(self, P, tokens):
        xp = array_module(tokens)
        local = tokens - self.lo  # (B, T) row in this rank's slice
        outside = (local < 0) | (local >= self.hi - self.lo)  # (B, T) bool
        local[outside] = 0
        y = P[f"{self.name}.W"].take(local, axis=0)  # (B, T, d)
        y[outside] = 0
        g_forward(self.comm, y)
        if self.max_len:
            T = tokens.shape[-1]
            if T > self.max_len:
                raise ValueError(f"{self.name}: sequence length {T} > max_len {self.max_len}")
            y += P[f"{self.name}.pos"][:T]
        mine = xp.flatnonzero(~outside)  # (M,) positions of this rank's tokens
        return y, (tokens.shape, local.reshape(-1)[mine], mine)

    def backward(self, P, ctx, dy):
        xp = array_module(dy)
        shape, rows, mine = ctx
        d2 = dy.reshape(-1, self.d)[mine]  # (M, d)
        offsets = (rows.reshape(-1, 1) * self.d + xp.arange(self.d)).reshape(-1)  # (M d,)
        xp.add.at(P.grads[f"{self.name}.W"].reshape(-1), offsets, d2.reshape(-1))
        if self.max_len:
            T = shape[-1]
            P.grads[f"{self.name}.pos"][:T] += dy.reshape(-1, T, self.d).sum(axis=0)
        return None


class VocabParallelCrossEntropy:
    """Mean cross-entropy over logits split by vocabulary columns (see the module
    docstring); a Model's loss: (logits shard, targets, scale) -> (loss, dlogits shard)."""

    def __init__(self, comm: Comm, vocab: int):
        self.comm, self.vocab = comm, vocab
        self.lo, self.hi = shard_bounds(vocab, comm, "cross-entropy: vocabulary")

    def __call__(self, logits, targets, scale: float = 1.0):
        xp = array_module(logits)
        V = self.hi - self.lo
        if logits.shape[-1] != V or targets.shape != logits.shape[:-1]:
            raise ValueError(f"logits {logits.shape} and targets {targets.shape}: expected "
                             f"(..., {V}) logits of vocabulary [{self.lo}, {self.hi}) and "
                             "targets of their leading shape")
        z = logits.reshape(-1, V)  # (N, V) this rank's columns
        N = z.shape[0]
        maxima = self.comm.allgather(xp.ascontiguousarray(z.max(axis=1)))  # (size N,)
        m = maxima.reshape(self.comm.size, N).max(axis=0)  # (N,) global row max
        p = z - m[:, None]  # (N, V) shifted logits, then probabilities
        t = targets.reshape(-1) - self.lo  # (N,) target column in this slice
        mine = xp.flatnonzero((t >= 0) & (t < V))  # (M,) rows whose target is here
        stats = xp.zeros((N, 2), dtype=p.dtype)  # (N, 2): sum of exp, target's shifted logit
        stats[mine, 1] = p[mine, t[mine]]
        xp.exp(p, out=p)
        stats[:, 0] = p.sum(axis=1)
        self.comm.allreduce(stats)
        sum_p = stats[:, :1]  # (N, 1)
        loss = float((xp.log(sum_p[:, 0]) - stats[:, 1]).mean())
        p *= (scale / N) / sum_p  # softmax * scale / N
        p[mine, t[mine]] -= scale / N
        return loss, p.reshape(logits.shape)


def dense_values(P: FlatParams, comm: Comm, grads: bool = False) -> dict[str, np.ndarray]:
    """name -> the dense tensor (host, float64) of every parameter (or gradient).

    Each rank writes its shard into zeros at its index and the shards are
    summed over `comm`; they are disjoint, so the sum is exact. Replicated
    tensors are this rank's own. Collective over `comm`.
    """
    out = {}
    for spec in P.specs:
        mine = to_host(P.grads[spec.name] if grads else P.params[spec.name]).astype(np.float64)
        if spec.split not in (SPLIT, "ep+tp"):
            out[spec.name] = mine.copy()
            continue
        full = np.zeros(spec.full_shape)
        part = full.reshape(spec.view) if spec.view else full
        part[spec.index] = mine.reshape(part[spec.index].shape)
        out[spec.name] = comm.allreduce(full)
    return out
