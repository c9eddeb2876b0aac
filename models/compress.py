"""Gradient compressors with error feedback, on flat buffers.

Error feedback (Stich et al. 2018, "Sparsified SGD with memory"; Karimireddy et
al. 2019, "Error feedback fixes SignSGD and other gradient compression schemes"):

    p_t     = g_t + e_t            the gradient and what earlier steps did not send
    send      C(p_t)               a payload
    e_{t+1} = p_t - D(C(p_t))      what this step did not send (e_0 = 0; off: e = 0)

The compressors, with the bytes of a payload of n elements of b bytes each:

    topk:F      the k = ceil(F n) largest |p_i|, indices (int32, int64 past 2^31)
                and values                                               k (4 + b)
    randk:F     k = ceil(F n) elements drawn without replacement from (seed, step),
                unscaled (Stich et al. 2018): the values only, since every replica
                with the same seed draws the same indices (the values can be summed) k b + 8
    sign        (|p|_1 / n) sign(p), sign(0) = +1, as bits (Karimireddy et al. 2019's
                scaled sign; Bernstein et al. 2018's signSGD without the scale)  ceil(n/8) + b
    powersgd:R  every matrix M (rows x cols) of the layout as P^ Q^T of rank
                r = min(R, rows, cols), one power-iteration step per call with the
                previous step's Q as its start (Vogels et al. 2019, Algorithm 1):
                    P = M Q            first Q: seeded standard normal, the same on every replica
                    P <- mean P        reduction 1 (the caller's; vectors ride along dense)
                    P^ = orth(P)       Householder QR
                    Q = M^T P^         e <- M - P^ Q^T: this replica's unsent part
                    Q <- mean Q        reduction 2 (the caller's); kept as the next start
                    D = P^ Q^T
                vectors (biases, norm gains) are sent as they are   sum (rows + cols) r b + vectors

Top-k and random-k send each element in full or not at all, so the residual holds
exactly what was not sent: e_{t+1} + D(C(p_t)) == p_t bit for bit. Sign and
PowerSGD subtract, e = fl(p - D): exact where the subtraction is, else within one
rounding, |e + D - p| <= u |e|. At F = 1 top-k and random-k send every element
(D == p exactly); PowerSGD at full rank (R >= min(rows, cols)) projects onto a basis
of M's column space, D = M up to rounding.

Every compressor is `compress(grad) -> payload` and `decompress(payload) -> dense`
(and `accumulate(payload, out)`, out += dense), payload.nbytes its size on the wire.
PowerSGD's two reductions are steps the caller runs between
`p_factors(grad)`, `q_factors(p)` and `finish(q)`; `compress` runs the three with
no reduction (a world of one).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from dtlab.models.config import ConfigError, described
from dtlab.models.params import FlatParams

KINDS = ("topk", "randk", "sign", "powersgd")


@dataclass
class CompressConfig:
    compress: str = described("", "compress gradients: topk:F | randk:F (a fraction F of the "
                                  "elements) | sign | powersgd:R (rank R); empty: off")
    error_feedback: bool = described(True, "add what earlier steps did not send to the next "
                                           "gradient (Karimireddy et al. 2019)")

    def validate(self):
        if self.compress:
            spec(self.compress)
        elif not self.error_feedback:
            raise ConfigError("--no-error-feedback needs --compress")


def spec(text: str) -> tuple[str, float]:
    """'topk:0.01' -> ('topk', 0.01); 'sign' -> ('sign', 0); a ConfigError naming
    --compress for anything else."""
    kind, _, value = text.partition(":")
    if kind not in KINDS:
        raise ConfigError(f"--compress {text!r}: the kind is one of {', '.join(KINDS)}")
    if kind == "sign":
        if value:
            raise ConfigError(f"--compress {text!r}: sign takes no value")
        return kind, 0.0
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if kind == "powersgd" and not (number.is_integer() and number >= 1):
        raise ConfigError(f"--compress {text!r}: powersgd:R takes a rank R >= 1")
    if kind != "powersgd" and not 0 < number <= 1:
        raise ConfigError(f"--compress {text!r}: {kind}:F takes a fraction F in (0, 1]")
    return kind, number


@dataclass(frozen=True)
class TopKPayload:
    indices: object  # (k,) int32 / int64, ascending
    values: object  # (k,)

    @property
    def nbytes(self) -> int:
        return self.indices.nbytes + self.values.nbytes


@dataclass(frozen=True)
class RandKPayload:
    step: int  # the draw's step: the indices follow from (seed, step)
    values: object  # (k,) in the order of the ascending indices

    @property
    def nbytes(self) -> int:
        return self.values.nbytes + 8


@dataclass(frozen=True)
class SignPayload:
    bits: object  # (ceil(n/8),) uint8, 1 for p_i >= 0
    scale: np.floating  # |p|_1 / n, in the gradient's dtype

    @property
    def nbytes(self) -> int:
        return self.bits.nbytes + self.scale.itemsize


@dataclass(frozen=True)
class PowerPayload:
    p: object  # (sum rows r + vector elements,) P^ of every matrix, then the vectors
    q: object  # (sum cols r,) Q of every matrix

    @property
    def nbytes(self) -> int:
        return self.p.nbytes + self.q.nbytes


class Compressor:
    """The error-feedback round around a compressor's `encode` / `accumulate`."""

    def __init__(self, size: int, dtype=np.float32, xp=np, error_feedback: bool = True):
        self.size, self.dtype, self.xp = size, np.dtype(dtype), xp
        self.residual = xp.zeros(size, self.dtype) if error_feedback else None  # (n,) e
        self._p = xp.empty(size, self.dtype)  # (n,) p = g + e

    def corrected(self, grad):
        """p = grad + e (grad itself without error feedback), in a buffer of this one's."""
        if grad.shape != (self.size,):
            raise ValueError(f"gradient shape {grad.shape} != ({self.size},)")
        if self.residual is None:
            self._p[...] = grad
        else:
            self.xp.add(grad, self.residual, out=self._p)
        return self._p

    def compress(self, grad):
        p = self.corrected(grad)
        payload = self.encode(p)
        self.remember(p, payload)
        return payload

    def remember(self, p, payload) -> None:
        """e <- p - D(payload): what was not sent."""
        if self.residual is not None:
            self.residual[...] = p
            self.residual -= self.decompress(payload)

    def decompress(self, payload, out=None):
        out = self.xp.zeros(self.size, self.dtype) if out is None else out
        out.fill(0)
        self.accumulate(payload, out)
        return out

    def encode(self, p):
        raise NotImplementedError

    def accumulate(self, payload, out) -> None:
        raise NotImplementedError


def _count(fraction: float, size: int) -> int:
    return min(size, max(1, math.ceil(fraction * size)))


def _index_dtype(size: int):
    return np.int32 if size < 2**31 else np.int64


class TopK(Compressor):
    def __init__(self, size: int, fraction: float, **kw):
        super().__init__(size, **kw)
        self.k = _count(fraction, size)

    def encode(self, p) -> TopKPayload:
        xp, n = self.xp, self.size
        idx = xp.argpartition(xp.abs(p), n - self.k)[n - self.k:] if self.k < n \
            else xp.arange(n)
        idx = xp.sort(idx).astype(_index_dtype(n))
        return TopKPayload(idx, p[idx])

    def accumulate(self, payload: TopKPayload, out) -> None:
        out[payload.indices] += payload.values  # indices are distinct


class RandK(Compressor):
    def __init__(self, size: int, fraction: float, seed: int = 0, **kw):
        super().__init__(size, **kw)
        self.k, self.seed, self.steps = _count(fraction, size), seed, 0
        self._drawn: tuple[int, object] | None = None  # (step, indices) of the last draw

    def indices(self, step: int):
        """The ascending indices of `step`'s draw (every replica with this seed: the same)."""
        if self._drawn is None or self._drawn[0] != step:
            rng = np.random.default_rng([self.seed, step])
            idx = np.sort(rng.choice(self.size, self.k, replace=False)).astype(
                _index_dtype(self.size))
            self._drawn = (step, self.xp.asarray(idx))
        return self._drawn[1]

    def encode(self, p) -> RandKPayload:
        step, self.steps = self.steps, self.steps + 1
        return RandKPayload(step, p[self.indices(step)])

    def accumulate(self, payload: RandKPayload, out) -> None:
        out[self.indices(payload.step)] += payload.values


class Sign(Compressor):
    def encode(self, p) -> SignPayload:
        xp = self.xp
        scale = self.dtype.type(float(xp.abs(p).sum(dtype=np.float64)) / self.size)
        return SignPayload(xp.packbits(p >= 0), scale)

    def accumulate(self, payload: SignPayload, out) -> None:
        xp = self.xp
        plus = xp.unpackbits(payload.bits)[: self.size].astype(bool)  # (n,)
        s = payload.scale
        out += xp.where(plus, s, -s)


def matrix_layout(params: FlatParams) -> list[tuple[int, int, int]]:
    """(offset, rows, cols) of every tensor of two or more dimensions, viewed as
    shape[0] x the rest: PowerSGD's matrices; the other tensors are vectors."""
    out = []
    for s in params.specs:
        if len(s.shape) >= 2:
            out.append((params.offsets[s.name][0], s.shape[0], math.prod(s.shape[1:])))
    return out


class PowerSGD(Compressor):
    """Vogels et al. 2019's rank-R compressor of the `matrices` (offset, rows, cols) of
    the flat buffer; the elements outside them are vectors, sent dense with P."""

    def __init__(self, size: int, matrices: list[tuple[int, int, int]], rank: int,
                 seed: int = 0, **kw):
        super().__init__(size, **kw)
        xp = self.xp
        ends = sorted((o, o + r * c) for o, r, c in matrices)
        if any(lo < 0 or hi > size for lo, hi in ends) or any(
                a[1] > b[0] for a, b in zip(ends, ends[1:], strict=False)):
            raise ValueError(f"matrices {matrices} do not lie apart inside [0, {size})")
        self.mats = []  # (offset, rows, cols, r, p_at, q_at)
        p_at = q_at = 0
        for o, rows, cols in matrices:
            r = min(rank, rows, cols)
            self.mats.append((o, rows, cols, r, p_at, q_at))
            p_at, q_at = p_at + rows * r, q_at + cols * r
        self.vectors = _gaps(ends, size)  # [(lo, hi)] outside every matrix
        self._vec_at = p_at
        n_vec = sum(hi - lo for lo, hi in self.vectors)
        self.p = xp.empty(p_at + n_vec, self.dtype)  # (sum rows r + vectors,)
        self.q = xp.asarray(np.random.default_rng(seed).standard_normal(q_at)
                            .astype(self.dtype))  # (sum cols r,) the warm start
        self._q_local = xp.empty_like(self.q)

    def _views(self, m, flat):
        o, rows, cols, r, p_at, q_at = m
        M = flat[o : o + rows * cols].reshape(rows, cols)  # (rows, cols)
        return M, self.p[p_at : p_at + rows * r].reshape(rows, r)  # (rows, r)

    def p_factors(self, grad):
        """Step 1: P = M Q of every matrix, then the vectors; the caller averages the
        returned buffer over the replicas in place, then calls q_factors."""
        p = self.corrected(grad)
        for m in self.mats:
            M, P = self._views(m, p)
            q_at, cols, r = m[5], m[2], m[3]
            self.xp.matmul(M, self.q[q_at : q_at + cols * r].reshape(cols, r), out=P)
        at = self._vec_at
        for lo, hi in self.vectors:
            self.p[at : at + hi - lo] = p[lo:hi]
            at += hi - lo
        return self.p

    def q_factors(self, p_mean):
        """Step 2: P^ = orth(mean P), Q = M^T P^ (this replica's), and the residual
        e = M - P^ Q^T (the vectors are sent whole: none); the caller averages the
        returned buffer over the replicas in place, then calls finish."""
        if p_mean is not self.p:
            self.p[...] = p_mean
        m_flat = self._p
        for m in self.mats:
            M, P = self._views(m, m_flat)
            P[...] = self.xp.linalg.qr(P, mode="reduced")[0]  # (rows, r) orthonormal
            q_at, cols, r = m[5], m[2], m[3]
            self.xp.matmul(M.T, P, out=self._q_local[q_at : q_at + cols * r].reshape(cols, r))
        if self.residual is not None:
            self.residual[...] = m_flat
            for m in self.mats:
                o, rows, cols, r, _, q_at = m
                _, P = self._views(m, m_flat)
                Q = self._q_local[q_at : q_at + cols * r].reshape(cols, r)
                self.residual[o : o + rows * cols] -= (P @ Q.T).ravel()
            for lo, hi in self.vectors:
                self.residual[lo:hi] = 0
        return self._q_local

    def finish(self, q_mean, out=None):
        """Step 3: D = P^ (mean Q)^T and the (averaged) vectors, dense; mean Q is the
        next step's start."""
        self.q[...] = q_mean
        return self.decompress(PowerPayload(self.p, self.q), out)

    def compress(self, grad) -> PowerPayload:
        """The three steps with no reduction between them (one replica)."""
        q = self.q_factors(self.p_factors(grad))
        self.q[...] = q
        return PowerPayload(self.p.copy(), self.q.copy())

    def remember(self, p, payload) -> None:
        """q_factors already did."""

    def accumulate(self, payload: PowerPayload, out) -> None:
        for o, rows, cols, r, p_at, q_at in self.mats:
            P = payload.p[p_at : p_at + rows * r].reshape(rows, r)
            Q = payload.q[q_at : q_at + cols * r].reshape(cols, r)
            out[o : o + rows * cols] += (P @ Q.T).ravel()
        at = self._vec_at
        for lo, hi in self.vectors:
            out[lo:hi] += payload.p[at : at + hi - lo]
            at += hi - lo


def _gaps(ends: list[tuple[int, int]], size: int) -> list[tuple[int, int]]:
    """The ranges of [0, size) outside the sorted disjoint `ends`."""
    out, at = [], 0
    for lo, hi in ends:
        if lo > at:
            out.append((at, lo))
        at = hi
    return out + ([(at, size)] if at < size else [])


def make_compressor(cfg: CompressConfig, size: int, dtype=np.float32, xp=np,
                    matrices: list[tuple[int, int, int]] | None = None,
                    seed: int = 0) -> Compressor | None:
    """The compressor `cfg` names (None: off) for flat gradients of `size`; `matrices`:
    PowerSGD's (matrix_layout); `seed`: random-k's draws and PowerSGD's first Q, to be
    the same on every replica."""
    if not cfg.compress:
        return None
    kind, value = spec(cfg.compress)
    kw = {"dtype": dtype, "xp": xp, "error_feedback": cfg.error_feedback}
    if kind == "topk":
        return TopK(size, value, **kw)
    if kind == "randk":
        return RandK(size, value, seed=seed, **kw)
    if kind == "sign":
        return Sign(size, **kw)
    if matrices is None:
        raise ConfigError("--compress powersgd needs the model's matrices (matrix_layout)")
    return PowerSGD(size, matrices, int(value), seed=seed, **kw)
