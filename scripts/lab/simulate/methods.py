"""Between sync and async at scale (dtlab-simulate --methods ...): local SGD, DiLoCo and
compressed gradients, each one's step time beside plain data parallelism's.

    dtlab-simulate --link 100gbit --intra-link nvlink --gpus-per-node 8 --tflops 100 \
        --methods local:8,diloco:50,topk:0.01,randk:0.01,sign,powersgd:4

What each method's step costs, as dtlab-sync runs it (collective/reducers/local_sgd.py,
collective/reducers/compress.py), with ar(n) our ring family's all-reduce of n bytes
(formulas.sync_allreduce_s) and ag(m) a flat ring all-gather of m bytes from every rank,
(N-1) alpha + (N-1) m beta on the ring's link (zero.ring_link):

    local:H, diloco:H   step = compute + (straggler sqrt(H) + ar(Psi)) / H
        every rank takes H steps on its own, then one all-reduce of the outer gradient
        (Stich 2019; Douillard et al. 2023): one H-th of the all-reduce a step, none of
        it behind backward (it follows the H-th step). The ranks meet once per H steps,
        so they wait for the slowest sum of H steps: with independent steps its lateness
        grows as sqrt(H) (the spread of a sum), one H-th of it a step.
    topk:F    ag(k (4 + b))          k = ceil(F E) values and int32 indices a rank
    sign      ag(ceil(E / 8) + b)    the packed signs and one scale
    randk:F   ar(k b)                the same indices everywhere: the values are summed
    powersgd:R  ar(P b) + ar(Q b)    P = sum rows r + the vectors (sent dense), Q = sum
                                     cols r, r = min(R, rows, cols) (Vogels et al. 2019)

with E the gradient's elements and b its bytes per element. Nothing of the compressed
exchange hides behind backward (the compressor needs the whole gradient), and each adds
its compute: on this host (--link local) measured in this run by the very compressors
of models/compress.py at E (compress once, add one payload: top-k and sign add the N
gathered payloads one by one, so their decode grows with N, random-k adds one, PowerSGD
decodes once); at a preset, PASSES memory passes over the gradient at --mem-gbs (counted
from models/compress.py's array operations) and PowerSGD's 4 rows cols r FLOPs a matrix
(its two products and the residual's) at the compute rate. Every method's step also
carries plain data parallelism's straggler wait (every step is a meeting) but local SGD's.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass

import numpy as np

from dtlab.lab.simulate.formulas import Network, sync_allreduce_s
from dtlab.lab.simulate.step import Host, Step
from dtlab.lab.simulate.zero import allgather_s, ring_link
from dtlab.models.compress import CompressConfig, make_compressor, spec
from dtlab.models.config import ConfigError, build
from dtlab.models.zoo import build_model

KINDS = ("local", "diloco", "topk", "randk", "sign", "powersgd")
# memory passes over the gradient (reads and writes of E b bytes): p = g + e, the
# selection or packing, the residual e = p - D(payload); then one per payload added
ENCODE_PASSES = {"topk": 10.0, "randk": 6.0, "sign": 8.0, "powersgd": 8.0}
DECODE_PASSES = {"topk": 0.0, "randk": 0.0, "sign": 4.0, "powersgd": 3.0}


@dataclass(frozen=True)
class Method:
    kind: str
    value: float = 0.0  # H, F or R

    @property
    def label(self) -> str:
        return self.kind if self.kind == "sign" else f"{self.kind}{self.value:g}"


def parse(text: str) -> tuple[Method, ...]:
    """--methods' list, e.g. local:8,diloco:50,topk:0.01,sign,powersgd:4; ConfigError
    naming the entry that is wrong."""
    out = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        kind, _, value = item.partition(":")
        if kind in ("local", "diloco"):
            if not value.isdigit() or int(value) < 1:
                raise ConfigError(f"--methods {item}: {kind}:H needs H, a positive integer "
                                  "of inner steps")
            out.append(Method(kind, int(value)))
        elif kind in KINDS:
            try:  # models/compress.py's own check of topk:F, powersgd:R ...
                kind, v = spec(item)
            except ConfigError as e:
                raise ConfigError(f"--methods {item}: {e}") from None
            out.append(Method(kind, v))
        else:
            raise ConfigError(f"--methods {item}: not one of {', '.join(KINDS)}")
    return tuple(out)


@dataclass(frozen=True)
class Gradient:
    """What the compressed exchange's bytes follow from: E elements of b bytes, and
    PowerSGD's matrices (offset, rows, cols) as models/compress.py matrix_layout finds
    them: every tensor of two or more dimensions, shape[0] x the rest."""

    elements: int
    itemsize: int
    matrices: tuple[tuple[int, int, int], ...]

    @property
    def nbytes(self) -> int:
        return self.elements * self.itemsize

    def power_factors(self, rank: int) -> tuple[int, int]:
        """(P, Q) elements of PowerSGD at `rank`: P holds the vectors too."""
        p = sum(r * min(rank, r, c) for _, r, c in self.matrices)
        q = sum(c * min(rank, r, c) for _, r, c in self.matrices)
        vectors = self.elements - sum(r * c for _, r, c in self.matrices)
        return p + vectors, q


def gradient_of(model_name: str, config, itemsize: int) -> Gradient:
    """The model's gradient layout from its parameter specs (nothing allocated)."""
    mats, offset = [], 0
    for s in build_model(model_name, config).specs():
        if len(s.shape) >= 2:
            mats.append((offset, s.shape[0], math.prod(s.shape[1:])))
        offset += math.prod(s.shape)
    return Gradient(offset, itemsize, tuple(mats))


def payload_bytes(m: Method, g: Gradient) -> int:
    """Bytes of one rank's compressed gradient (module docstring's table)."""
    b = g.itemsize
    if m.kind == "topk":
        return math.ceil(m.value * g.elements) * (4 + b)
    if m.kind == "sign":
        return math.ceil(g.elements / 8) + b
    if m.kind == "randk":
        return math.ceil(m.value * g.elements) * b
    return sum(g.power_factors(int(m.value))) * b


def exchange_s(m: Method, g: Gradient, n: int, net: Network) -> float:
    """Seconds of a compressed exchange over n ranks."""
    payload = payload_bytes(m, g)
    if m.kind in ("topk", "sign"):
        return allgather_s(payload * n, n, ring_link(net, n))
    if m.kind == "randk":
        return sync_allreduce_s("ring", payload, n, net)[0]
    p, q = g.power_factors(int(m.value))
    return (sync_allreduce_s("ring", p * g.itemsize, n, net)[0]
            + sync_allreduce_s("ring", q * g.itemsize, n, net)[0])


@dataclass(frozen=True)
class CompressCompute:
    """Seconds a rank computes for compression: encode + added payloads x decode, measured
    on this host or from memory passes at a preset (module docstring)."""

    encode_s: dict[str, float]
    decode_s: dict[str, float]
    source: str

    def seconds(self, m: Method, n: int) -> float:
        adds = n if m.kind in ("topk", "sign") else 1
        return self.encode_s[m.label] + adds * self.decode_s[m.label]


def preset_compute(methods, g: Gradient, mem_gbs: float, flops_per_s: float
                   ) -> CompressCompute:
    enc, dec = {}, {}
    pass_s = g.nbytes / (mem_gbs * 1e9)
    for m in methods:
        if m.kind in ENCODE_PASSES:
            matmul = 4 * sum(r * c * min(int(m.value), r, c) for _, r, c in g.matrices) \
                if m.kind == "powersgd" else 0
            enc[m.label] = ENCODE_PASSES[m.kind] * pass_s + matmul / flops_per_s
            dec[m.label] = (DECODE_PASSES[m.kind] * pass_s
                            + 2 * payload_bytes(m, g) / (mem_gbs * 1e9))
    return CompressCompute(enc, dec, f"{mem_gbs:g} GB/s memory passes")


def measured_compute(methods, g: Gradient, repeats: int = 3) -> CompressCompute:
    """Each compressor of models/compress.py timed on this host at the gradient's size:
    the median of `repeats` compress() calls and of adding one payload."""
    dtype = np.float64 if g.itemsize == 8 else np.float32
    grad = np.random.default_rng(0).standard_normal(g.elements).astype(dtype)  # (E,)
    enc, dec = {}, {}
    for m in methods:
        if m.kind not in ENCODE_PASSES:
            continue
        cfg = build(CompressConfig, {"compress": f"{m.kind}:{m.value:g}"
                                     if m.kind != "sign" else "sign"})
        c = make_compressor(cfg, g.elements, dtype, np, list(g.matrices), seed=0)
        out = np.zeros_like(grad)
        e_times, d_times = [], []
        for _ in range(repeats):
            t = time.perf_counter()
            payload = c.compress(grad)
            t1 = time.perf_counter()
            c.accumulate(payload, out)
            e_times.append(t1 - t)
            d_times.append(time.perf_counter() - t1)
        enc[m.label], dec[m.label] = statistics.median(e_times), statistics.median(d_times)
    return CompressCompute(enc, dec, "measured on this host (models/compress.py)")


def method_step(m: Method, g: Gradient, n: int, net: Network, compute_s: float,
                host: Host, straggler_s: float, cc: CompressCompute) -> Step:
    """One step of method `m` over n ranks (module docstring)."""
    share = host.share(n)
    if m.kind in ("local", "diloco"):
        H = int(m.value)
        ar = sync_allreduce_s("ring", g.nbytes, n, net, one_host_shm=bool(host.cores))[0]
        wait = straggler_s * math.sqrt(H)
        return Step(m.label, n, compute_s, (wait + ar * share) / H, "ring",
                    {"allreduce_s": ar * share / H, "straggler_s": wait / H,
                     "sent_bytes": 2 * (n - 1) / n * g.nbytes / H, "rounds": 1 / H})
    comm, payload = exchange_s(m, g, n, net) * share, payload_bytes(m, g)
    work = cc.seconds(m, n) if n > 1 else 0.0
    sent = (n - 1) * payload if m.kind in ("topk", "sign") else 2 * (n - 1) / n * payload
    return Step(m.label, n, compute_s, straggler_s + comm + work, "ring",
                {"exchange_s": comm, "compress_s": work, "straggler_s": straggler_s,
                 "sent_bytes": sent, "payload_bytes": payload,
                 "rounds": 2 if m.kind == "powersgd" else 1})


def method_columns(methods, g: Gradient, n: int, net: Network, compute_s: float, host: Host,
                   straggler_s: float, cc: CompressCompute) -> dict:
    """A prediction row's "method:<label>" entries: comm_s, step_s and their parts."""
    out = {}
    for m in methods:
        s = method_step(m, g, n, net, compute_s, host, straggler_s, cc)
        out[f"method:{m.label}"] = {"comm_s": s.comm_s, "step_s": s.step_s, **s.parts}
    return out

