"""Compressed gradient averaging for the sync trainer, with error feedback.

    mpiexec -n 4 python -m dtlab.collective.train --model mlp --compress topk:0.01
    mpiexec -n 4 python -m dtlab.collective.train --model mlp --compress sign --no-error-feedback
    mpiexec -n 4 python -m dtlab.collective.train --model mlp --compress powersgd:2

After backward every rank compresses its gradient plus what it did not send before
(models.compress: Stich et al. 2018, Karimireddy et al. 2019; --no-error-feedback drops
the residual) and the ranks exchange the payloads over our collectives:

    topk:F      one ring all-gather of every rank's packed (values, indices): the
                indices differ by rank, so the payloads cannot be summed on the way;
                each rank adds all W into a zero gradient and divides by W
    randk:F     one ring all-reduce (average) of the k values: every rank draws the
                same indices from (seed, step), so the values can be summed
    sign        one ring all-gather of every rank's packed (scale, sign bits), each
                decoded, added and divided by W (Karimireddy et al. 2019's scaled sign)
    powersgd:R  two ring all-reduces (average) of the low-rank factors, P then Q, the
                mean Q kept as the next step's start (Vogels et al. 2019, Algorithm 1)

Every rank ends with the same averaged gradient, which the trainer clips and steps
as it would the plain all-reduce's. Each step's record carries `sent_bytes` (what this
rank sent, from our ring's schedule, payload padding included), `comm_rounds` (the
collectives: 1, or 2 for PowerSGD), `wire_bytes` (this rank's payload), `comm_s` (the
collectives) and `compress_s` (compressing, decoding, adding). Payloads are padded to a
multiple of 8 bytes, so every rank's slice of the all-gather is aligned for its values.

Truth (tests/collective/test_compress_sync.py): topk:1.0 at dp 2 is plain data parallelism
bit for bit (every element sent; a + b = b + a as in the ring); PowerSGD at full rank
within 1e-12 in float64 (a projection onto a basis of the mean gradient's columns); the
residual is exactly what the transport did not carry.
"""

from __future__ import annotations

import time

import numpy as np

from dtlab.collective.comm import Communicator
from dtlab.collective.reducers.exchange import Exchange
from dtlab.collective.zero.layout import RingTraffic
from dtlab.models.backend import array_module
from dtlab.models.compress import (
    CompressConfig,
    PowerSGD,
    RandK,
    RandKPayload,
    Sign,
    SignPayload,
    TopK,
    TopKPayload,
    make_compressor,
    matrix_layout,
    spec,
)

ALIGN = 8  # bytes: every packed payload is padded to a multiple of this


def _padded(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class CompressReducer(Exchange):
    """The trainer's gradient reducer under --compress: `grad` (the flat gradient buffer)
    replaced in wait() by the mean of the ranks' decompressed payloads."""

    def __init__(self, comm: Communicator, grad, cfg: CompressConfig, params, seed: int):
        super().__init__(comm)
        xp = array_module(grad)
        self.comm, self.grad, self.cfg = comm, grad, cfg
        self.ring = comm.dup("compress", ours="ring")  # our ring at every size: bytes known
        self.W = comm.size
        self.c = make_compressor(cfg, grad.size, grad.dtype, xp, matrix_layout(params), seed)
        traffic = RingTraffic(self.ring)
        b = grad.dtype.itemsize
        if isinstance(self.c, (TopK, Sign)):
            payload = self.c.k * (b + 4) if isinstance(self.c, TopK) else \
                b + -(-grad.size // 8)
            self.nbytes = _padded(payload)
            self._send = xp.zeros(self.nbytes, np.uint8)  # (nbytes,) this rank's packed
            self._all = xp.empty(self.W * self.nbytes, np.uint8)  # (W nbytes,) every rank's
            bounds = [r * self.nbytes for r in range(self.W + 1)]
            self.sent = traffic.allgather(bounds, 1)
            self.collectives = [("ring allgather", self.nbytes)]
        elif isinstance(self.c, RandK):
            self._values = xp.empty(self.c.k, grad.dtype)  # (k,)
            self.nbytes = self._values.nbytes
            self.sent = traffic.allreduce(self.c.k, b)
            self.collectives = [("ring allreduce", self.nbytes)]
        else:
            p, q = self.c.p.size, self.c.q.size
            self.nbytes = (p + q) * b
            self.sent = traffic.allreduce(p, b) + traffic.allreduce(q, b)
            self.collectives = [("ring allreduce (P)", p * b), ("ring allreduce (Q)", q * b)]
        self._comm_s = 0.0

    def ready(self, offset: int) -> None:
        """Nothing starts before backward ends: the compressor needs the whole gradient."""

    def wait(self) -> dict:
        t = time.perf_counter()
        self._comm_s = 0.0
        if isinstance(self.c, PowerSGD):
            self._power()
        elif isinstance(self.c, RandK):
            self._randk()
        else:
            self._gathered()
        total = time.perf_counter() - t
        return {"comm_s": self._comm_s, "wait_s": total, "compress_s": total - self._comm_s,
                "wire_bytes": self.nbytes, "sent_bytes": self.sent,
                "comm_rounds": len(self.collectives)}

    def _collective(self, run) -> None:
        """run() (one collective), its time added to this step's comm_s."""
        t = time.perf_counter()
        run()
        self._comm_s += time.perf_counter() - t

    def _gathered(self) -> None:
        """top-k and sign: all-gather the packed payloads, add all W, divide by W."""
        payload = self.c.compress(self.grad)  # the residual updated: what was not sent
        self._pack(payload)
        self._collective(lambda: self.ring.allgather(self._send, self._all))
        self.grad.fill(0)
        for r in range(self.W):
            chunk = self._all[r * self.nbytes : (r + 1) * self.nbytes]  # (nbytes,)
            self.c.accumulate(self._unpack(chunk), self.grad)
        array_module(self.grad).true_divide(self.grad, self.W, out=self.grad)

    def _pack(self, payload) -> None:
        """values then indices (top-k), scale then bits (sign), into the send buffer."""
        send = self._send
        if isinstance(payload, TopKPayload):
            v = payload.values.view(np.uint8)
            send[: v.size] = v
            i = payload.indices.view(np.uint8)
            send[v.size : v.size + i.size] = i
        else:
            s = array_module(send).asarray(payload.scale).reshape(1).view(np.uint8)
            send[: s.size] = s
            send[s.size : s.size + payload.bits.size] = payload.bits

    def _unpack(self, chunk):
        dtype = self.grad.dtype
        if isinstance(self.c, TopK):
            k = self.c.k
            values = chunk[: k * dtype.itemsize].view(dtype)  # (k,)
            index = np.int32 if self.c.size < 2**31 else np.int64
            indices = chunk[k * dtype.itemsize : k * (dtype.itemsize + 4)].view(index)  # (k,)
            return TopKPayload(indices, values)
        b = dtype.itemsize
        return SignPayload(chunk[b : b + -(-self.c.size // 8)], chunk[:b].view(dtype)[0])

    def _randk(self) -> None:
        """random-k: the same indices on every rank, so one all-reduce of the values."""
        payload = self.c.compress(self.grad)
        self._values[...] = payload.values
        self._collective(lambda: self.ring.allreduce(self._values, average=True))
        self.c.decompress(RandKPayload(payload.step, self._values), self.grad)

    def _power(self) -> None:
        """PowerSGD: P averaged, orthogonalised, Q averaged, D = P^ Q^T."""
        p = self.c.p_factors(self.grad)
        self._collective(lambda: self.ring.allreduce(p, average=True))
        q = self.c.q_factors(p)
        self._collective(lambda: self.ring.allreduce(q, average=True))
        self.c.finish(q, out=self.grad)

    def plan(self) -> list[dict]:
        """The collectives of one step (the header's allreduce_buckets)."""
        return [{"algorithm": name, "bytes": int(nbytes)} for name, nbytes in self.collectives]

    def close(self) -> None:
        self.ring.free()


def describe(cfg: CompressConfig) -> str:
    """'top-1% (error feedback)', 'sign (no error feedback)', 'PowerSGD rank 2 (...)'."""
    kind, value = spec(cfg.compress)
    what = {"topk": f"top-{value:.3g} fraction", "randk": f"random-{value:.3g} fraction",
            "sign": "scaled sign", "powersgd": f"PowerSGD rank {int(value)}"}[kind]
    return f"{what} ({'error feedback' if cfg.error_feedback else 'no error feedback'})"
