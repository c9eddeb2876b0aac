"""A quantized ring all-reduce (dtlab-sync --quantize-grads int8|int4): int8 or 4-bit
payloads with a float32 scale per block, re-quantized at every hop, as INTELLECT-1's
ring all-reduce of pseudo-gradients does (Jaghouar et al. 2024) and ZeRO++'s quantized
gradient reduce-scatter (Wang et al. 2023).

The ring of collective/algorithms/ring.py (its docstring walks it step by step) with a payload of
models/quantize.py in every message:

    reduce-scatter, steps 0..N-2: rank r quantizes its partial sum of segment
        (r - t - 1) mod N, sends it right, and adds the dequantized segment
        (r - t - 2) mod N arriving from its left into its own
    all-gather, steps N-1..2N-3: the owner of a finished segment quantizes it once;
        its payload travels round the ring unchanged and every rank, the owner too,
        takes the dequantized values, so all ranks end with the same bits

Error. A quantization moves an element by at most half its block's scale (models/
quantize.py); an element of the result went through N - 1 quantizations of partial sums
and one of the total, so |result - exact sum| <= the sum of those N half-scales, which
`quantized_allreduce` returns per element (`bound`), plus float32 rounding of the N - 1
additions. Bytes: each of the 2(N - 1) steps sends one segment's payload (its scales,
then its codes), 4 / (4 + 1/64) times fewer than float32 at int8, about 7.5 at 4 bits.

Error feedback (EF-SGD, Karimireddy et al. 2019; --quantize-error-feedback, the default).
Rank r quantizes every segment exactly once: the N - 1 segments it sends in the reduce-
scatter (the first its own contribution alone, the others partial sums it forwards) and
the total of its own. What each of those quantizations dropped, value - D(Q(value)), is
the rank's residual e_r (`residual`), so that the result is exactly sum_r x_r - sum_r e_r
up to the float32 rounding of the additions. The reducer adds e_r to the rank's next
gradient: over T steps the results sum to T times the exact sum less the last residuals,
so their running mean converges to the exact mean, where without it a constant
gradient's bias stays at every step (tests/collective/test_quantized_ring.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from dtlab.collective.algorithms.ring import segment_bounds
from dtlab.collective.comm import Communicator
from dtlab.collective.reducers.exchange import Exchange
from dtlab.models import quantize
from dtlab.models.backend import array_module
from dtlab.models.config import choice, described
from dtlab.models.flag_rules import NoEffectWithout, rules

TAG = 0x51  # the quantized ring's messages


@dataclass
class QuantizedResult:
    sent_bytes: int  # what this rank sent
    bound: object  # (L,) float32: the most quantization can have moved each element
    # (with track_bound; else this rank's own quantizations' share)


def quantized_allreduce(comm: Communicator, x, bits: int = 8, average: bool = False,
                        track_bound: bool = False, residual=None) -> QuantizedResult:
    """x (L,) <- the ranks' sum (or mean) through the quantized ring, in place. With
    `track_bound` the result carries each element's error bound (one more all-reduce, of
    the ranks' half-scales: a check's, not a training step's). With `residual` (L,), it
    becomes what this rank's quantizations dropped (the module docstring's e_r, in the
    sum's units also when `average`)."""
    xp, N, r = array_module(x), comm.size, comm.rank
    bound = xp.zeros(x.size, np.float32)  # (L,)
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual shape {residual.shape} != {x.shape}")
    if N == 1:
        if residual is not None:
            residual.fill(0)
        return QuantizedResult(0, bound)
    seg = segment_bounds(x.size, N)
    right, left = (r + 1) % N, (r - 1) % N
    biggest = quantize.payload_bytes(seg[1] - seg[0], bits)  # the first segments are longest
    send = xp.empty(biggest, np.uint8)  # (payload,)
    recv = xp.empty(biggest, np.uint8)
    sent = 0

    def part(s: int):
        return x[seg[s]:seg[s + 1]]  # (segment,)

    def exchange(out_segment: int, in_segment: int, payload_of_out) -> quantize.Quantized:
        nonlocal sent
        n_out, n_in = part(out_segment).size, part(in_segment).size
        out_bytes = quantize.payload_bytes(n_out, bits)
        in_bytes = quantize.payload_bytes(n_in, bits)
        quantize.pack(payload_of_out, send[:out_bytes])
        comm.sendrecv(send[:out_bytes], right, recv[:in_bytes], left, TAG)
        sent += out_bytes
        return quantize.unpack(recv[:in_bytes], n_in, bits)

    def half_scales(z: quantize.Quantized):
        return xp.repeat(z.scales, quantize.BLOCK)[: z.size] / 2  # (segment,)

    def dropped(s: int, z: quantize.Quantized) -> None:
        """residual's segment s <- x's segment s less what its payload z stands for."""
        if residual is not None:
            e = residual[seg[s]:seg[s + 1]]  # (segment,)
            quantize.dequantize(z, out=e)
            xp.subtract(part(s), e, out=e)

    for t in range(N - 1):  # reduce-scatter: re-quantize the partial sum at every hop
        out_s, in_s = (r - t - 1) % N, (r - t - 2) % N
        z_out = quantize.quantize(part(out_s), bits)
        dropped(out_s, z_out)
        bound[seg[out_s]:seg[out_s + 1]] += half_scales(z_out)
        z_in = exchange(out_s, in_s, z_out)
        part(in_s)[...] += quantize.dequantize(z_in)
    mine = r  # rank r now holds the sum of segment r (the docstring's table)
    z = quantize.quantize(part(mine), bits)
    dropped(mine, z)
    bound[seg[mine]:seg[mine + 1]] += half_scales(z)
    quantize.dequantize(z, out=part(mine))
    for t in range(N - 1):  # all-gather: forward the finished payloads unchanged
        out_s, in_s = (r - t) % N, (r - t - 1) % N
        z = exchange(out_s, in_s, z)  # views of `recv`, packed again before it is reused
        quantize.dequantize(z, out=part(in_s))
    if track_bound:  # each rank added the half-scales of what it quantized: sum them
        comm.allreduce(bound, algo="mpi")
    if average:
        xp.true_divide(x, N, out=x)
        bound /= N
    return QuantizedResult(sent, bound)


@rules(NoEffectWithout("quantize_error_feedback", "quantize_grads"))
@dataclass
class QuantizedConfig:
    quantize_grads: str = choice("", "", "int8", "int4",
                                 help="average the gradients through the quantized ring "
                                      "all-reduce (collective/algorithms/quantized_ring.py: "
                                      "every hop re-quantized, a float32 scale per 256 values); "
                                      "empty: off")
    quantize_error_feedback: bool = described(True, "with --quantize-grads: each rank adds what "
                                                    "its quantizations dropped to its next "
                                                    "gradient (EF-SGD), so the average over "
                                                    "steps is unbiased")

    def validate(self) -> None:
        """The choice is checked by the flag; nothing else to check."""


class QuantizedReducer(Exchange):
    """The trainer's gradient reducer under --quantize-grads: after backward the whole
    gradient buffer averaged through `quantized_allreduce` on a ring-only communicator,
    with error feedback (the default) the last step's residual added to it first."""

    def __init__(self, comm: Communicator, grad, bits: int, error_feedback: bool = True):
        super().__init__(comm)
        self.ring = comm.dup("quantized-ring", ours="ring")
        self.grad, self.bits = grad, bits
        self.nbytes = quantize.payload_bytes(grad.size, bits)
        # (n,) e_r: added to the next gradient, then what this step's quantizations dropped
        self.residual = array_module(grad).zeros_like(grad) if error_feedback else None

    def ready(self, offset: int) -> None:
        """Nothing starts before backward ends: a segment's scale needs all of it."""

    def wait(self) -> dict:
        t = time.perf_counter()
        if self.residual is not None:
            self.grad += self.residual
        got = quantized_allreduce(self.ring, self.grad, self.bits, average=True,
                                  residual=self.residual)
        seconds = time.perf_counter() - t
        return {"comm_s": seconds, "wait_s": seconds, "wire_bytes": self.nbytes,
                "sent_bytes": got.sent_bytes, "comm_rounds": 1}

    def plan(self) -> list[dict]:
        return [{"algorithm": f"quantized ring (int{self.bits})", "bytes": self.nbytes}]

    def close(self) -> None:
        self.ring.free()
