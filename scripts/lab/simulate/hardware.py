"""GPUs from their spec sheets, and the rate a model's step achieves on one.

    gpu = GPUS["a100-sxm-80gb"]
    rate = achieved_rate(gpu, "transformer", config, batch=1, precision="bf16", tp=8)
    rate.flops_per_s        # the model's matmul FLOPs over its step's time on one GPU

Constants (per GPU, dense, no sparsity) are the vendor's data sheets: NVIDIA V100 SXM2
(2017; 125 TFLOP/s fp16 tensor, 15.7 fp32, 7.8 fp64, 900 GB/s HBM2), A100 SXM4 80GB (2020/21;
312 bf16/fp16, 19.5 fp32 without TF32, 19.5 fp64 tensor, 2,039 GB/s HBM2e), H100 SXM5
(2022; 989 bf16/fp16, 67 fp32, 67 fp64 tensor, 3,350 GB/s HBM3), H200 SXM (2024; the
H100's compute, 4,800 GB/s HBM3e).

The achieved rate, by size. A step's time on one GPU is its matmuls plus the
elementwise work between them (norms, softmax, activation functions, residual adds),
which models/cost.py does not count:

    matmul (m, k, n)   max(2 m k n / (e P), (m k + k n + m n) s / H)    a roofline
    elementwise        3 K' / H  (+ K' / H with recomputation)  +  S B / H

with P the peak rate at the compute precision, H the HBM bandwidth, s the bytes of an
element, e the one fitted constant of the GPU (the fraction of peak a large matmul
reaches: `matmul_efficiency`, fitted on the row named in `fitted_on`), and K the bytes
the forward keeps for backward (kept_bytes: a transformer block's as Korthikanti et al.
2022 count them for Megatron-LM, 34 s b h + 5 a s^2 b a layer at 2 bytes), K' those
of them outside the attention scores (the 34 s b h): each is written by the forward,
read by the backward and its gradient written there (3 passes; one more when the
block's forward runs again). The a s^2 b attention scores (S of them on a rank) move B
bytes each, counted kernel by kernel as Megatron-LM's unfused attention runs them
(score_bytes; the scores' writes and reads by the Q K^T and A V matmuls are in those
matmuls' rooflines): forward the fused scale-mask-softmax reads and writes them (2 v)
and dropout reads them and writes its output and a 1-byte mask (2 v + 1); backward
dropout's gradient reads the gradient and the mask and writes one (2 v + 1) and
softmax's reads its output and the gradient and writes one (3 v); v the activation
bytes. The forward runs again under full or selective recomputation (selective
recomputation recomputes exactly this part, Korthikanti et al. 2022 section 5): B =
9 + 11 = 20 bytes at v = 2, 29 recomputed, where 3 (4) passes over the 5 kept bytes
gave 15 (20). With fused (flash) attention (Dao et al. 2022; `flash`) no score reaches
memory: Q K^T and A V run at the large matmuls' rate e P (assumed; Dao 2023 reports
50-73% of A100's peak), their backward recomputing Q K^T (FlashAttention-2: 5 matmuls
to the forward's 2, so 2.5 forward passes where unfused attention has 2), and K' is
all the block keeps. Small matmuls are
memory-bound and the elementwise share falls as 1 / width, so a model's achieved rate
rises with its width, as measured runs do (Narayanan et al. 2021, Table 1). Tensor
parallelism (t ranks) divides the matmuls and the split layers' bytes by t (a weight's
columns or rows; the attention's per-head matmuls by their count, a / t heads of the
same shape on a rank); the 10 s b h of the norms and dropouts outside the split regions
are divided by t only with sequence parallelism (Korthikanti et al. 2022, equations 2
and 4), else every tp rank repeats them.

Kernel launch latency is not modelled. Launches are asynchronous: the GPU idles only
where its kernels take less time than the host takes to launch them (some 5 us each,
CUDA's launch overhead). In every GPU row of simulate/published.py a layer's
micro-batch runs for milliseconds against some 100 kernels (a fraction of a
millisecond to launch); its smallest matmul takes 30 us or more and its smallest
elementwise kernels (a tp-split activation read and written) 3 to 14 us at the HBM
rate, the few under 5 us (tp 4 and 8 rows) a handful a layer: a floor of 5 us a kernel
would move no row by as much as 1%. A tiny model's rate here is an upper bound.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from dtlab.lab.simulate.step import ComputeRate
from dtlab.models.config import ConfigError
from dtlab.models.zoo import MODELS

ELEMENTWISE_PASSES = 3  # forward writes, backward reads, backward writes the gradient


def score_bytes(v: int, recomputed: bool) -> float:
    """Bytes one attention score moves in the elementwise kernels of a step (module
    docstring): forward softmax 2 v and dropout 2 v + 1, again if recomputed; backward
    dropout 2 v + 1 and softmax 3 v."""
    forward = 2 * v + (2 * v + 1)
    return forward * (2 if recomputed else 1) + (2 * v + 1) + 3 * v


FLASH_BACKWARD_PASSES = 2.5  # FlashAttention-2's backward: 5 matmuls to the forward's 2


@dataclass(frozen=True)
class GPU:
    name: str
    peak_flops: dict  # compute precision (bf16, fp16, fp32, float64) -> FLOP/s, dense
    hbm_bytes_per_s: float
    memory_bytes: float
    matmul_efficiency: float  # the one fitted constant: a large matmul's fraction of peak
    fitted_on: str  # the row it was fitted on (simulate/published.py)
    source: str

    def peak(self, precision: str) -> float:
        if precision not in self.peak_flops:
            raise ConfigError(f"{self.name}: no peak rate for {precision} (known: "
                              f"{', '.join(self.peak_flops)})")
        return self.peak_flops[precision]

    def matmul_s(self, m: float, k: float, n: float, precision: str, itemsize: int) -> float:
        """Seconds of one (m, k) @ (k, n) matmul: the roofline of the module docstring."""
        compute = 2 * m * k * n / (self.matmul_efficiency * self.peak(precision))
        memory = (m * k + k * n + m * n) * itemsize / self.hbm_bytes_per_s
        return max(compute, memory)


T = 1e12
# matmul_efficiency: fitted by dtlab-simulate --reproduce on the named row (the value
# here is what that fit gives; tests/lab/test_simulate_reproduce.py checks it is)
GPUS = {
    "v100-sxm2-32gb": GPU("V100 SXM2 32GB", {"fp16": 125 * T, "fp32": 15.7 * T,
                                             "float64": 7.8 * T},
                          900e9, 32e9, 0.352, "shoeybi2019-1gpu",
                          "NVIDIA Tesla V100 data sheet (2017)"),
    "a100-sxm-80gb": GPU("A100 SXM4 80GB", {"bf16": 312 * T, "fp16": 312 * T, "fp32": 19.5 * T,
                                            "float64": 19.5 * T},
                         2039e9, 80e9, 0.682, "narayanan2021-t1-1008b",
                         "NVIDIA A100 Tensor Core GPU data sheet (2021)"),
    "h100-sxm": GPU("H100 SXM5 80GB", {"bf16": 989 * T, "fp16": 989 * T, "fp32": 67 * T,
                                       "float64": 67 * T},
                    3350e9, 80e9, 0.700, "none: the A100's fit",
                    "NVIDIA H100 Tensor Core GPU data sheet (2022)"),
    "h200-sxm": GPU("H200 SXM 141GB", {"bf16": 989 * T, "fp16": 989 * T, "fp32": 67 * T,
                                       "float64": 67 * T},
                    4800e9, 141e9, 0.700, "none: the A100's fit",
                    "NVIDIA H200 Tensor Core GPU data sheet (2024)"),
}
GPU_NAMES = tuple(GPUS)


def gpu(name: str, flag: str = "--gpu") -> GPU:
    if name not in GPUS:
        raise ConfigError(f"{flag}: unknown GPU {name!r} (known: {', '.join(GPUS)})")
    return GPUS[name]


def matmuls(model_name: str, c, batch: int
            ) -> list[tuple[float, float, float, float, bool, bool]]:
    """(count, m, k, n, in_block, per_head) of every matmul of one forward
    (models/parts.py's layers): the roofline's shapes; in_block: recomputed with the
    block. Attention's Q K^T and A V are (T, d/h) @ (d/h, T) and (T, T) @ (T, d/h) per
    head and sequence (per_head: tensor parallelism splits their count, the heads, not
    their shape; the others it splits along n or k, one operand's columns or rows)."""
    if model_name == "mlp":
        widths = [c.d_in] + [c.d_hidden] * c.n_layers + [c.n_classes]
        return [(1, batch, a, b, False, False)
                for a, b in zip(widths, widths[1:], strict=False)]
    N, d, T, h, L = batch * c.seq_len, c.d_model, c.seq_len, c.n_heads, c.n_layers
    up = 2 if c.ffn == "swiglu" else 1  # SwiGLU: two input matmuls
    return [(L, N, d, 3 * d, True, False), (L, N, d, d, True, False),  # qkv, projection
            (L * batch * h, T, d // h, T, True, True),  # Q K^T
            (L * batch * h, T, T, d // h, True, True),  # A V
            (up * L, N, d, c.d_ff, True, False), (L, N, c.d_ff, d, True, False),  # FFN
            (1, N, d, c.vocab, False, False)]  # head


def scores(model_name: str, c, batch: int, tp: int = 1) -> float:
    """Attention scores (a s^2 b a layer) on one of tp ranks: the heads split over t."""
    if model_name != "transformer":
        return 0.0
    return c.n_layers * batch * c.n_heads * c.seq_len ** 2 / tp


def kept_bytes(model_name: str, c, batch: int, act_itemsize: int, tp: int = 1,
               sequence_parallel: bool = False, with_scores: bool = True) -> float:
    """Bytes one tp rank's forward keeps for backward, without recomputation.

    A transformer block as Megatron-LM runs it (Korthikanti et al. 2022, section 4.1,
    equations 1 and 2; 2-byte activations, 1-byte dropout masks): s b h (10 + 24 / t +
    5 a s / (h t)) a layer, s b h (34 + 5 a s / h) / t with sequence parallelism; scaled
    by act_itemsize / 2 for wider activations; without the 5 a s^2 b of the attention
    scores where not with_scores. The final norm, head and loss from models/parts.py
    (the logits split over t). An MLP: models/parts.py's act_floats."""
    if model_name != "transformer":
        return sum(p.count * p.act_bytes(act_itemsize)
                   for p in MODELS[model_name].cost.parts(c, batch))
    s_, b, h, a, t = c.seq_len, batch, c.d_model, c.n_heads, tp
    score = 5 * a * s_ / h if with_scores else 0.0
    per_token = (34 + score) / t if sequence_parallel else 10 + 24 / t + score / t
    layers = c.n_layers * s_ * b * h * per_token * act_itemsize / 2
    c = dataclasses.replace(c, recompute=False, selective_recompute=False)
    tail = sum(p.count * p.act_floats / (1 if p.name == "ln_f" else t)
               for p in MODELS[model_name].cost.parts(c, batch)
               if p.name in ("ln_f", "head") or p.name.startswith("loss"))
    return layers + tail * act_itemsize


@dataclass(frozen=True)
class Achieved:
    """One GPU's step of a model: matmul and elementwise seconds, and the rate."""

    matmul_s: float
    elementwise_s: float
    flops: float  # the step's matmul FLOPs on this rank (models/cost.py, over tp)

    @property
    def seconds(self) -> float:
        return self.matmul_s + self.elementwise_s

    @property
    def flops_per_s(self) -> float:
        return self.flops / self.seconds


def achieved(g: GPU, model_name: str, c, batch: int, precision: str, itemsize: int,
             act_itemsize: int, tp: int = 1, sequence_parallel: bool = False,
             flash: bool = False) -> Achieved:
    """One micro-batch of `batch` samples on one of tp ranks (the module docstring):
    forward, backward (2x the forward's matmuls), the recomputed forward if the config
    recomputes; flash: fused attention (no score in memory)."""
    recompute = getattr(c, "recompute", False)
    selective = getattr(c, "selective_recompute", False)
    mm_s = flops = 0.0
    for count, m, k, n, in_block, per_head in matmuls(model_name, c, batch):
        passes = 3 + (1 if recompute and in_block else 0)  # forward, 2 backward, recompute
        count, n = (count / tp, n) if per_head else (count, n / tp)  # this rank's share
        flops += count * passes * 2 * m * k * n
        if per_head and flash:  # fused: at the matmul rate, backward recomputing Q K^T
            timed = passes - 2 + FLASH_BACKWARD_PASSES
            mm_s += count * timed * 2 * m * k * n / (g.matmul_efficiency * g.peak(precision))
        else:
            mm_s += count * passes * g.matmul_s(m, k, n, precision, itemsize)
    kept = kept_bytes(model_name, c, batch, act_itemsize, tp, sequence_parallel,
                      with_scores=False)
    elem = (ELEMENTWISE_PASSES + (1 if recompute else 0)) * kept
    if not flash:
        elem += scores(model_name, c, batch, tp) * score_bytes(act_itemsize,
                                                               recompute or selective)
    return Achieved(mm_s, elem / g.hbm_bytes_per_s, flops)


def achieved_rate(g: GPU, model_name: str, c, batch: int, precision: str, itemsize: int,
                  act_itemsize: int, tp: int = 1, sequence_parallel: bool = False,
                  flash: bool = False) -> ComputeRate:
    """The ComputeRate (step.py) of the model on `g`: its FLOPs over achieved()'s time."""
    a = achieved(g, model_name, c, batch, precision, itemsize, act_itemsize, tp,
                 sequence_parallel, flash)
    return ComputeRate(a.flops_per_s, source=(
        f"{g.name} at {precision}: {a.flops_per_s / 1e12:.4g} TFLOP/s achieved "
        f"(matmuls at {g.matmul_efficiency:.3g} of {g.peak(precision) / 1e12:g} peak, "
        f"elementwise at {g.hbm_bytes_per_s / 1e9:,.0f} GB/s)"))
