"""ZeRO++'s quantized collectives (Wang et al. 2023, "ZeRO++: Extremely Efficient Collective
Communication for Giant Model Training") in ZeRO stages 2 and 3, over our ring.

    mpiexec -n 4 python -m dtlab.collective.train --model transformer --zero 3 \
        --zero-quantize-weights int8 [--zero-quantize-grads int8|int4]

qwZ (--zero-quantize-weights int8, stage 3). Before a unit's forward and backward each rank
block-quantizes its master segment of the unit (models/quantize.py: int8, a float32 scale
per 256 values, absmax, round to nearest) and the ring all-gathers the payloads (scales,
then codes) instead of the values. Every rank, the owner too, dequantizes every segment
into the unit's working buffer, so all ranks compute with the same bits: segment q of the
gathered unit is exactly dequantize(quantize(rank q's master segment)). The master shard
stays float32 and the optimizer steps it; only the gathered working copy is quantized.

qgZ (--zero-quantize-grads int8|int4, stages 2 and 3). ZeRO++ reduce-scatters gradients by
an all-to-all in two levels of the node hierarchy, quantizing once per level; what is built
here is our ring's reduce-scatter with block-quantized payloads re-quantized at every hop,
the first half of collective/algorithms/quantized_ring.py:

    step t = 0..N-2: rank r quantizes its partial sum of segment (r - t - 1) mod N, sends
    it right, and adds the dequantized segment (r - t - 2) mod N from its left into its own

so after N - 1 steps rank r holds the sum of its segment r (its own contribution exact).

Error bound (qgZ). Rounding to nearest moves an element by at most s / 2, s = its block's
absmax / Q (Q = 127 at int8, 7 at 4 bits). Segment r's partial sum is quantized once at
each of the N - 1 ranks before its owner, each adding at most that hop's half-scale, and
the dequantized values are summed in the gradient's dtype, so per element

    |mine - exact sum| <= sum_{k=1}^{N-1} s_k / 2  (+ rounding of the N - 1 additions)

with s_k the block scale of the k-th hop's partial sum: a priori s_k <= (the k ranks' block
absmaxes summed + the errors before it) / Q. `quantized_reduce_scatter(track_bound=True)`
returns the right side's first term, each rank's half-scales summed over the ranks (one
more all-reduce: a check's, not a step's); averaged, everything is divided by N.

Bytes on the wire, from each schedule: a payload of n values is 4 ceil(n / 256) + n bytes
at int8, + ceil(n / 2) at 4 bits (quantize.payload_bytes). The gather is our ring's
all-gather over the ranks' payloads, each padded to 4 bytes so that the next one's scales
stay aligned (RingTraffic over their byte offsets); the reduce-scatter sends segment
(r - t - 1)'s payload at step t. Float32 over the same ring sends
4 / (1 + 4 / 256) = 3.94 times the int8 bytes, 7.76 times the 4-bit ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dtlab.collective.comm import Communicator
from dtlab.models import quantize
from dtlab.models.backend import array_module
from dtlab.models.config import ConfigError, choice, from_namespace

TAG = 0x5A  # the quantized reduce-scatter's messages
BITS = {"": None, "int8": 8, "int4": 4}


@dataclass(frozen=True)
class ZeroQuantConfig:
    """--zero-quantize-weights / --zero-quantize-grads ("": off, ZeRO as without them)."""

    zero_quantize_weights: str = choice("", "", "int8",
                                        help="--zero 3: all-gather each unit's parameters as "
                                             "int8 with a float32 scale per 256 values "
                                             "(ZeRO++'s qwZ; the master shard stays float32; "
                                             "collective/zero/quantized.py); empty: off")
    zero_quantize_grads: str = choice("", "", "int8", "int4",
                                      help="--zero 2|3: reduce-scatter each unit's gradient "
                                           "through our ring with block-quantized payloads "
                                           "re-quantized at every hop (ZeRO++'s qgZ on a "
                                           "ring); empty: off")

    @property
    def weight_bits(self) -> int | None:
        return BITS[self.zero_quantize_weights]

    @property
    def grad_bits(self) -> int | None:
        return BITS[self.zero_quantize_grads]

    @property
    def enabled(self) -> bool:
        return bool(self.zero_quantize_weights or self.zero_quantize_grads)

    def fields(self) -> dict:
        """The metrics header's record of the flags ({} when off: the header as before)."""
        return {"zero_quantize_weights": self.zero_quantize_weights,
                "zero_quantize_grads": self.zero_quantize_grads} if self.enabled else {}

    def describe(self) -> str:
        """'; ZeRO++: weights gathered as int8, gradients reduce-scattered as int4 ...'."""
        parts = ([f"weights gathered as {self.zero_quantize_weights}"]
                 if self.weight_bits else []) + \
            ([f"gradients reduce-scattered as {self.zero_quantize_grads} (re-quantized at "
              "every hop)"] if self.grad_bits else [])
        return f"; ZeRO++: {', '.join(parts)}, a float32 scale per {quantize.BLOCK} values" \
            if parts else ""

    def validate(self) -> None:
        """Each flag alone: its widths are the flag's choices. Across flags: `compose`."""

    def compose(self, zero: int, pp: int, wire: str, precision: str) -> None:
        """ConfigError naming both flags where one of these flags meets one it does not
        compose with (RULES)."""
        others = {"zero": zero, "pp": pp, "wire": wire, "precision": precision}
        for mine, other, refuses, why in RULES:
            value = getattr(self, mine)
            if value and refuses(others[other]):
                raise ConfigError(f"--{mine.replace('_', '-')} {value} with "
                                  f"--{other} {others[other]}: {why}")


# (this config's field, the other flag, when its value refuses the field, why)
RULES = (
    ("zero_quantize_weights", "zero", lambda z: z != 3,
     "quantized weights are stage 3's per-unit all-gathers (give --zero 3); stages 1 and 2 "
     "all-gather the stepped parameters, which must stay whole-precision"),
    ("zero_quantize_grads", "zero", lambda z: z not in (2, 3),
     "quantized gradients are stages 2 and 3's per-unit reduce-scatters (give --zero 2 or 3)"),
    ("zero_quantize_weights", "pp", lambda pp: pp > 1,
     "stage 3 does not run pipeline stages"),
    ("zero_quantize_grads", "pp", lambda pp: pp > 1,
     "a pipeline stage runs stage 2 as stage 1, its gradient reduced whole after the last "
     "backward"),
    ("zero_quantize_grads", "wire", lambda wire: wire != "fp32",
     "the reduce-scatter's payload is either the quantized codes or the --wire dtype"),
    ("zero_quantize_grads", "precision", lambda precision: precision != "fp32",
     "a half-precision gradient's overflow (inf, on which the step is skipped) would pass "
     "through its block's scale as undefined codes, not reliably as inf"),
)


def zero_quant_config(setup) -> ZeroQuantConfig:
    """The flags as a checked config (ConfigError naming both flags where they clash)."""
    cfg = from_namespace(ZeroQuantConfig, setup.extra)
    cfg.compose(setup.extra.zero, setup.extra.pp, setup.extra.wire, setup.run.precision)
    return cfg


def slot_bytes(size: int, bits: int) -> int:
    """A payload of `size` values padded to 4 bytes, so the next one's float32 scales are
    aligned (what the gather sends per rank)."""
    return -(-quantize.payload_bytes(size, bits) // 4) * 4


def payload_offsets(counts: list[int], bits: int) -> list[int]:
    """Byte offsets (n + 1) of the ranks' payload slots for segments of `counts` values."""
    out = [0]
    for c in counts:
        out.append(out[-1] + slot_bytes(c, bits))
    return out


def dequantize_into(z: quantize.Quantized, out) -> None:
    """out (z.size,) <- the values z stands for, in out's dtype."""
    if out.dtype == np.float32:
        quantize.dequantize(z, out=out)
    else:
        out[...] = quantize.dequantize(z)


def quantized_allgather(comm: Communicator, segment, out, counts: list[int], bits: int,
                        scratch) -> None:
    """out (sum(counts),) <- every rank's `segment` (counts[rank],) as
    dequantize(quantize(segment)), through our ring's all-gather of the payloads; scratch:
    uint8, at least payload_offsets(counts, bits)[-1] bytes."""
    offsets, r = payload_offsets(counts, bits), comm.rank
    payloads = scratch[: offsets[-1]]  # (every rank's payload,) uint8
    mine = payloads[offsets[r] : offsets[r + 1]]
    quantize.pack(quantize.quantize(segment, bits), mine)
    mine[quantize.payload_bytes(counts[r], bits) :] = 0  # the padding
    comm.allgather(mine, out=payloads,
                   counts=[offsets[q + 1] - offsets[q] for q in range(comm.size)])
    at = 0
    for q, c in enumerate(counts):
        dequantize_into(quantize.unpack(payloads[offsets[q] : offsets[q + 1]], c, bits),
                        out[at : at + c])
        at += c


@dataclass
class Scattered:
    mine: object  # (bounds[rank + 1] - bounds[rank],) view of x: the sum (or mean)
    sent_bytes: int
    bound: object  # (same,) float32 with track_bound (module docstring), else None


def quantized_reduce_scatter(comm: Communicator, x, bounds: list[int], bits: int, scratch,
                             average: bool = False, track_bound: bool = False) -> Scattered:
    """x (L,): rank r's segment x[bounds[r]:bounds[r + 1]] <- the ranks' sum (or mean)
    through the ring with payloads re-quantized at every hop (module docstring); the rest
    of x is overwritten with partial sums. scratch: uint8, twice the largest payload."""
    xp, N, r = array_module(x), comm.size, comm.rank
    bound = xp.zeros(x.size, np.float32) if track_bound else None  # (L,)
    sent = 0

    def part(s: int):
        return x[bounds[s] : bounds[s + 1]]  # (segment,)

    if N > 1:
        half = max(slot_bytes(bounds[s + 1] - bounds[s], bits) for s in range(N))
        send, recv = scratch[:half], scratch[half : 2 * half]
        for t in range(N - 1):
            out_s, in_s = (r - t - 1) % N, (r - t - 2) % N
            n_out, n_in = part(out_s).size, part(in_s).size
            z = quantize.quantize(part(out_s), bits)
            if bound is not None:
                bound[bounds[out_s] : bounds[out_s + 1]] += \
                    xp.repeat(z.scales, quantize.BLOCK)[:n_out] / 2
            out_bytes = quantize.payload_bytes(n_out, bits)
            quantize.pack(z, send[:out_bytes])
            comm.sendrecv(send[:out_bytes], (r + 1) % N,
                          recv[: quantize.payload_bytes(n_in, bits)], (r - 1) % N, TAG)
            sent += out_bytes
            got = quantize.unpack(recv[: quantize.payload_bytes(n_in, bits)], n_in, bits)
            part(in_s)[...] += quantize.dequantize(got)
        if bound is not None:  # each rank added the half-scales it quantized: sum them
            comm.allreduce(bound, algo="mpi")
    mine = part(r)
    if average:
        xp.true_divide(mine, N, out=mine)
    if bound is None:
        return Scattered(mine, sent, None)
    return Scattered(mine, sent, bound[bounds[r] : bounds[r + 1]] / (N if average else 1))


def reduce_scatter_sent(bounds: list[int], rank: int, bits: int) -> int:
    """Bytes rank `rank` sends in quantized_reduce_scatter over segments `bounds`."""
    n = len(bounds) - 1
    return sum(quantize.payload_bytes(bounds[s + 1] - bounds[s], bits)
               for s in ((rank - t - 1) % n for t in range(n - 1)))


class QuantizedUnits:
    """The quantized gathers and reduce-scatters of one rank's units (collective/zero/
    params.py's hooks call them on the stream's thread, one at a time, so one scratch
    buffer serves them all), and the bytes each sends."""

    def __init__(self, cfg: ZeroQuantConfig, layout, traffic, xp):
        self.weight_bits, self.grad_bits = cfg.weight_bits, cfg.grad_bits
        self.layout, self.traffic = layout, traffic
        widest = max((b for b in (self.weight_bits, self.grad_bits) if b), default=8)
        need = [2 * slot_bytes(b[1] - b[0], widest) for b in layout.bounds]
        if self.weight_bits:
            need += [payload_offsets(layout.counts(u), self.weight_bits)[-1]
                     for u in range(len(layout.units))]
        self.scratch = xp.empty(max(need, default=0), np.uint8)  # (bytes,)

    def gather(self, comm: Communicator, u: int, segment, out) -> None:
        """out (unit,) <- unit u's segments, each as dequantize(quantize(segment))."""
        quantized_allgather(comm, segment, out, self.layout.counts(u), self.weight_bits,
                            self.scratch)

    def gather_bytes(self, u: int) -> int:
        return self.traffic.allgather(payload_offsets(self.layout.counts(u), self.weight_bits),
                                      1)

    def reduce_scatter(self, comm: Communicator, u: int, buf):
        """buf (unit,): this rank's segment of the ranks' mean, a view of buf."""
        return quantized_reduce_scatter(comm, buf, self.layout.bounds[u], self.grad_bits,
                                        self.scratch, average=True).mine

    def reduce_scatter_bytes(self, u: int) -> int:
        return reduce_scatter_sent(self.layout.bounds[u], self.layout.rank, self.grad_bits)
