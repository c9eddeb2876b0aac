"""Bytes per element of each class of tensor a step moves, from the trainers' own flags.

    p = Precision.of(dtype="float32", precision="bf16", wire="fp32")
    p.compute, p.activation, p.p2p, p.tp, p.gradient, p.gather    # bf16 2 2 2 2 2

As dtlab's trainers run them (models/precision.py, collective/reducers/buckets.py,
collective/zero/sharding.py):

    tensor class                 --dtype D (--precision fp32)   --precision fp16|bf16
    compute (the matmuls' rate)  D (float32: fp32, no TF32)     the half dtype
    activations kept             itemsize(D)                    2 (half storage of contexts)
    tp all-reduces, pp sends     itemsize(D)                    2 (half outputs)
    gradient all-reduce (wire)   itemsize(D); 2 with --wire     2 (the half copy's gradient,
                                 fp16|bf16                      MixedReplica.compute_params)
    ZeRO gathers (parameters)    itemsize(D)                    2 (the half working copy)

--wire fp16|bf16 casts each gradient bucket (and ZeRO's reduce-scatters) to that dtype
before the all-reduce; the parameters are gathered at the compute dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

from dtlab.models.config import ConfigError

ITEMSIZE = {"float32": 4, "float64": 8}
HALF = ("fp16", "bf16")


@dataclass(frozen=True)
class Precision:
    compute: str  # the peak rate the matmuls run at: bf16, fp16, fp32, float64
    activation: int  # bytes of an element kept for backward
    p2p: int  # an activation or its gradient sent between pipeline stages
    tp: int  # tensor parallelism's all-reduces
    gradient: int  # the gradient all-reduce's (or ZeRO reduce-scatter's) elements
    gather: int  # ZeRO's gathered parameters
    label: str = ""

    @staticmethod
    def of(dtype: str = "float32", precision: str = "fp32", wire: str = "fp32") -> Precision:
        if dtype not in ITEMSIZE:
            raise ConfigError(f"--dtype must be one of {', '.join(ITEMSIZE)} (got {dtype!r})")
        if precision not in ("fp32", *HALF):
            raise ConfigError(f"--precision must be fp32, fp16 or bf16 (got {precision!r})")
        if wire not in ("fp32", *HALF):
            raise ConfigError(f"--wire must be fp32, fp16 or bf16 (got {wire!r})")
        if precision in HALF:
            return Precision(precision, 2, 2, 2, 2, 2, f"{precision} (master fp32)")
        size = ITEMSIZE[dtype]
        compute = "fp32" if dtype == "float32" else "float64"
        return Precision(compute, size, size, size, 2 if wire in HALF else size, size,
                         dtype + (f", {wire} wire" if wire in HALF else ""))

    def describe(self) -> str:
        return (f"{self.label}: compute {self.compute}, bytes per element: activations "
                f"{self.activation}, pp {self.p2p}, tp {self.tp}, gradient {self.gradient}, "
                f"ZeRO gathers {self.gather}")
