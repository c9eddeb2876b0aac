"""Published training and collective results, as dtlab-simulate's flags: the data of
`dtlab-simulate --reproduce` (simulate/reproduce.py).

Each row names its source (paper or thread, and the table, figure or sentence), what was
measured, the published figure, and the flags that express the run. `fits` names the
constant a row is the one fitted row of (simulate/hardware.py's matmul_efficiency of a
GPU, simulate/links.py's NVLINK_EFFICIENCY); every other row is predicted. `assumed` says
what the source does not state and the row takes; `missing` marks a row the model cannot
express (it is printed, not predicted).

Kinds: "throughput" (achieved model TFLOP/s a GPU, or MFU, of large-model training at a
stated tp, pp, dp and batch), "efficiency" (scaling efficiency against a single-GPU
baseline), "zero3" (tokens/s a GPU of fully sharded data parallelism: ZeRO-3 / FSDP),
"scaling" (plain data parallelism's scaling efficiency: a GPU's rate at N over one
GPU's, the command's eff column), "busbw" (nccl-tests all-reduce bus bandwidth, algbw x
2(N-1)/N).

Figures kept out for want of one we are sure of: the PyTorch FSDP paper's (Zhao et al.
2023) and the ZeRO papers' (Rajbhandari et al. 2020, 2021), which we could not read here
to quote (the FSDP row is torchtitan's published table instead); Goyal et al. 2017's
~90% from 8 to 256 GPUs (its per-GPU compute is given only in plots); torchtitan's Llama
3 8B and Llama 2/3 70B rows (grouped-query attention, which the transformer here does not
have) and its selective-checkpointing rows (per-op and every-other-layer policies, not
--selective-recompute's).
"""

from __future__ import annotations

from dataclasses import dataclass

from dtlab.models.cost import estimate
from dtlab.models.mlp import MLPConfig

NARAYANAN = ("Narayanan et al. 2021, Efficient Large-Scale Language Model Training on GPU "
             "Clusters Using Megatron-LM (SC21), Table 1")
KORTHIKANTI = ("Korthikanti et al. 2022, Reducing Activation Recomputation in Large "
               "Transformer Models, abstract")
SHOEYBI = ("Shoeybi et al. 2019, Megatron-LM: Training Multi-Billion Parameter Language "
           "Models Using Model Parallelism, abstract")
NCCL_212 = ("NVIDIA/nccl-tests issue #212 (2024-05-06), NCCL maintainer S. Jeaugey: 8 x H100 "
            "SXM, NCCL_ALGO=RING")
NCCL_149 = ("NVIDIA/nccl-tests issue #149 (2023-06-27): 8 x A100-SXM4-80GB on NVSwitch "
            "(HPE Apollo 6500), all_reduce_perf to 1 GB")
TORCHTITAN = ("pytorch/torchtitan docs/performance.md (commit 0413364349), the table of "
              "Llama 2 performance numbers: FSDP2 on 64 A100 (80GB)")
HOROVOD = ("Horovod docs/benchmarks.rst (Sergeev & Del Balso 2018, arXiv:1802.05799, "
           "the README's benchmark): 128 servers x 4 Pascal GPUs, RoCE-capable 25 Gbit/s")
NCCL_119 = ("NVIDIA/nccl-tests issue #119 (2022-11-17): 3 servers x 8 A100-SXM4-40GB, 4 HDR "
            "InfiniBand adapters each, all_reduce_perf to 128 MB")


@dataclass(frozen=True)
class Published:
    id: str
    kind: str  # throughput, mfu, efficiency, zero3, scaling, busbw
    source: str
    what: str
    published: float
    unit: str  # "TFLOP/s/GPU", "MFU", "tokens/s/GPU", "x", "GB/s"
    argv: tuple[str, ...] = ()  # dtlab-simulate flags (all but busbw)
    busbw: tuple = ()  # (cluster or link names, ranks, gpus_per_node, nics, bytes)
    fits: str = ""  # the constant this row fits, where it is the fitted row
    assumed: str = ""
    missing: str = ""
    baseline: str = ""  # efficiency rows: the row whose rate is 100%


def gpt(h: int, heads: int, layers: int, tp: int, pp: int, gpus: int, batch: int,
        cluster: str, micro: int = 1, precision: str = "fp16", seq: int = 2048,
        vocab: int = 51200, recompute: str = "full", sequence_parallel: bool = False
        ) -> tuple[str, ...]:
    """dtlab-simulate's flags for a GPT (Megatron's: GELU FFN of 4h, LayerNorm, learned
    positions) on `gpus` GPUs: dp = gpus / (tp pp), batch / dp micro-batches of `micro`
    sequences a pipeline (as grad-accum steps when pp = 1). The gradient all-reduce
    after the last backward (--grad-reduce-after): Megatron-LM's local DDP of 2019-21
    all-reduces its gradient buffer once the step's forward-backward has returned
    (megatron/training.py train_step, allreduce_gradients), none of it overlapped."""
    dp = gpus // (tp * pp)
    m = batch // (dp * micro)
    out = ["--model", "transformer", "--vocab", str(vocab), "--seq-len", str(seq),
           "--d-model", str(h), "--n-heads", str(heads), "--n-layers", str(layers),
           "--d-ff", str(4 * h), "--batch-size", str(micro), "--grad-accum", str(m),
           "--precision", precision, "--cluster", cluster, "--workers", str(gpus),
           "--grad-reduce-after"]
    if recompute == "full":
        out.append("--recompute")
    elif recompute == "selective":
        out.append("--selective-recompute")
    if tp > 1:
        out += ["--tp", str(tp), "--sequence-parallel" if sequence_parallel
                else "--scatter-gather"]
    if pp > 1:
        out += ["--pp", str(pp)]
    return tuple(out)


def resnet101_as_mlp(batch: int) -> tuple[tuple[str, ...], int]:
    """(flags, MLP samples) of a generic model with ResNet-101's parameters and training
    FLOPs a step, for `batch` images a GPU: dtlab's models have no convolution, so an MLP
    of 1681 -> 4096 x 3 -> 1000 (44,549,096 parameters; torchvision's ResNet-101 has
    44,549,160) at the batch whose 6 x params FLOPs a sample add up to the images' 3 x
    7.6 GFLOP (He et al. 2016, Table 1: 7.6e9 multiply-adds a forward, 2 FLOPs each)."""
    config = MLPConfig(d_in=1681, d_hidden=4096, n_layers=3, n_classes=1000)
    samples = round(batch * 3 * 2 * RESNET101_MACS / estimate("mlp", config, 1).flops_step)
    return ("--model", "mlp", "--d-in", "1681", "--d-hidden", "4096", "--n-layers", "3",
            "--n-classes", "1000", "--batch-size", str(samples)), samples


RESNET101_MACS = 7.6e9  # He et al. 2016, Table 1 (its "FLOPs" are multiply-adds)
# one Pascal GPU's ResNet-101 rate: the example output in Horovod's docs/benchmarks.rst
# for its 16-GPU command (batch 64, fp32): "total images/sec: 1656.82", over 16 GPUs
HOROVOD_IMAGES_S = 1656.82 / 16
HOROVOD_TFLOPS = HOROVOD_IMAGES_S * 3 * 2 * RESNET101_MACS / 1e12
HOROVOD_MLP, HOROVOD_SAMPLES = resnet101_as_mlp(64)

MEGATRON_ASSUMED = ("micro-batch 1 and the plain 1F1B schedule (Table 1 states neither); "
                    "full recomputation, fp16, Megatron's FLOPs 96 B s l h^2 (1 + s/6h + "
                    "V/16lh) a step")

ROWS: tuple[Published, ...] = (
    # (1) large-model training throughput on A100s (Selene: DGX A100, 8 HDR a node)
    Published("narayanan2021-t1-1.7b", "throughput", NARAYANAN,
              "GPT 1.7B (h 2304, 24 layers), tp 1, pp 1, 32 GPUs, batch 512", 137,
              "TFLOP/s/GPU", gpt(2304, 24, 24, 1, 1, 32, 512, "dgx-a100-hdr"),
              assumed=MEGATRON_ASSUMED),
    Published("narayanan2021-t1-3.6b", "throughput", NARAYANAN,
              "GPT 3.6B (h 3072, 30 layers), tp 2, pp 1, 64 GPUs, batch 512", 138,
              "TFLOP/s/GPU", gpt(3072, 32, 30, 2, 1, 64, 512, "dgx-a100-hdr"),
              assumed=MEGATRON_ASSUMED),
    Published("narayanan2021-t1-7.5b", "throughput", NARAYANAN,
              "GPT 7.5B (h 4096, 36 layers), tp 4, pp 1, 128 GPUs, batch 512", 142,
              "TFLOP/s/GPU", gpt(4096, 32, 36, 4, 1, 128, 512, "dgx-a100-hdr"),
              assumed=MEGATRON_ASSUMED),
    Published("narayanan2021-t1-18.4b", "throughput", NARAYANAN,
              "GPT 18.4B (h 6144, 40 layers), tp 8, pp 1, 256 GPUs, batch 1024", 135,
              "TFLOP/s/GPU", gpt(6144, 48, 40, 8, 1, 256, 1024, "dgx-a100-hdr"),
              assumed=MEGATRON_ASSUMED),
    Published("narayanan2021-t1-39.1b", "throughput", NARAYANAN,
              "GPT 39.1B (h 8192, 48 layers), tp 8, pp 2, 512 GPUs, batch 1536", 138,
              "TFLOP/s/GPU", gpt(8192, 64, 48, 8, 2, 512, 1536, "dgx-a100-hdr"),
              assumed=MEGATRON_ASSUMED),
    Published("narayanan2021-t1-76.1b", "throughput", NARAYANAN,
              "GPT 76.1B (h 10240, 60 layers), tp 8, pp 4, 1024 GPUs, batch 1792", 140,
              "TFLOP/s/GPU", gpt(10240, 80, 60, 8, 4, 1024, 1792, "dgx-a100-hdr"),
              assumed=MEGATRON_ASSUMED),
    Published("narayanan2021-t1-145.6b", "throughput", NARAYANAN,
              "GPT 145.6B (h 12288, 80 layers), tp 8, pp 8, 1536 GPUs, batch 2304", 148,
              "TFLOP/s/GPU", gpt(12288, 96, 80, 8, 8, 1536, 2304, "dgx-a100-hdr"),
              assumed=MEGATRON_ASSUMED),
    Published("narayanan2021-t1-310.1b", "throughput", NARAYANAN,
              "GPT 310.1B (h 16384, 96 layers), tp 8, pp 16, 1920 GPUs, batch 2160", 155,
              "TFLOP/s/GPU", gpt(16384, 128, 96, 8, 16, 1920, 2160, "dgx-a100-hdr"),
              assumed=MEGATRON_ASSUMED),
    Published("narayanan2021-t1-529.6b", "throughput", NARAYANAN,
              "GPT 529.6B (h 20480, 105 layers), tp 8, pp 35, 2520 GPUs, batch 2520", 163,
              "TFLOP/s/GPU", gpt(20480, 128, 105, 8, 35, 2520, 2520, "dgx-a100-hdr"),
              assumed=MEGATRON_ASSUMED),
    Published("narayanan2021-t1-1008b", "throughput", NARAYANAN,
              "GPT 1008B (h 25600, 128 layers), tp 8, pp 64, 3072 GPUs, batch 3072", 163,
              "TFLOP/s/GPU", gpt(25600, 160, 128, 8, 64, 3072, 3072, "dgx-a100-hdr"),
              fits="matmul_efficiency of a100-sxm-80gb", assumed=MEGATRON_ASSUMED),
    # with sequence parallelism and selective recomputation, against full recomputation
    Published("korthikanti2022-530b-sp", "mfu", KORTHIKANTI,
              "GPT 530B (h 20480, 105 layers), tp 8 sequence-parallel, pp 35, 2240 A100s, "
              "selective recomputation", 0.542, "MFU",
              gpt(20480, 128, 105, 8, 35, 2240, 2240, "dgx-a100-hdr", precision="bf16",
                  recompute="selective", sequence_parallel=True),
              assumed="global batch 2240 (micro-batch 1, 280 a pipeline) and plain 1F1B "
                      "(the abstract states neither); bf16"),
    Published("korthikanti2022-530b-full", "mfu", KORTHIKANTI,
              "the same with full recomputation (no sequence parallelism)", 0.421, "MFU",
              gpt(20480, 128, 105, 8, 35, 2240, 2240, "dgx-a100-hdr", precision="bf16",
                  recompute="full"),
              assumed="as the row above"),
    # scaling efficiency against a single-GPU baseline (V100, DGX-2H: 16 a node, NVSwitch,
    # 8 EDR a node)
    Published("shoeybi2019-1gpu", "throughput", SHOEYBI,
              "GPT 1.2B (h 1536, 40 layers) on one V100, batch 8: the 100% baseline", 39,
              "TFLOP/s/GPU", gpt(1536, 16, 40, 1, 1, 1, 8, "v100-dgx2-edr", micro=8, seq=1024),
              fits="matmul_efficiency of v100-sxm2-32gb",
              assumed="activation checkpointing per layer and fp16; FLOPs as Megatron's "
                      "formula (the 2019 paper does not print its count)"),
    Published("shoeybi2019-512gpu", "efficiency", SHOEYBI,
              "GPT 8.3B (h 3072, 72 layers), 8-way model x 64-way data parallel, 512 V100s, "
              "batch 512: 15.1 PFLOP/s", 0.76, "x",
              gpt(3072, 32, 72, 8, 1, 512, 512, "v100-dgx2-edr", micro=8, seq=1024),
              baseline="shoeybi2019-1gpu", assumed="as the 1-GPU row; tp's activations not "
              "scattered between stages (pp 1)"),
    # (2) fully sharded data parallelism (FSDP2, ZeRO-3's sharding) at 64 A100s
    Published("torchtitan-llama2-13b-fsdp", "zero3", TORCHTITAN,
              "Llama 2 13B (h 5120, 40 layers, SwiGLU 13824), FSDP over 64 A100s, batch 2 "
              "of 4096 tokens a GPU, no activation checkpointing", 2162, "tokens/s/GPU",
              ("--model", "transformer", "--vocab", "32000", "--seq-len", "4096",
               "--d-model", "5120", "--n-heads", "40", "--n-layers", "40", "--d-ff",
               "13824", "--ffn", "swiglu", "--norm", "rmsnorm", "--batch-size", "2",
               "--precision", "bf16", "--cluster", "dgx-a100-hdr", "--workers", "64",
               "--zero", "3", "--flash-attention"),
              assumed="the cluster's network (the table names only the GPUs; DGX A100 with "
                      "8 HDR a node assumed); torchtitan's defaults: bf16 parameters, flash "
                      "attention (F.scaled_dot_product_attention), every block resharded "
                      "after forward; its gradients are reduce-scattered in fp32, here at "
                      "bf16 as dtlab's trainers do (the reduce-scatters hide behind "
                      "backward either way: the first unit's alone is exposed); Llama's "
                      "RoPE and no dropout costed as Megatron's block (kept bytes)"),
    # (3) plain data parallelism's scaling efficiency at 512 GPUs
    Published("horovod-resnet101-512", "scaling", HOROVOD,
              "ResNet-101, 512 GPUs (4 a server, one 25 Gbit/s RoCE port a server), "
              "batch 64 a GPU, Horovod's ring all-reduce: scaling efficiency", 0.90, "x",
              (*HOROVOD_MLP, "--dtype", "float32", "--tflops", f"{HOROVOD_TFLOPS:.4g}",
               "--link", "roce-100", "--gbit", "25", "--gpus-per-node", "4",
               "--nics-per-node", "1", "--intra-gbit", "96", "--bucket-mb", "64",
               "--workers", "512"),
              assumed=f"not a CNN: an MLP with ResNet-101's parameters (gradient 178 MB "
                      f"fp32) and training FLOPs a step ({HOROVOD_SAMPLES:,} samples for "
                      f"64 images; simulate/published.py resnet101_as_mlp); one GPU at "
                      f"{HOROVOD_IMAGES_S:.1f} images/s (the docs' example output for 16 "
                      f"GPUs, over 16: {HOROVOD_TFLOPS:.3g} TFLOP/s); PCIe 3 x16 between "
                      f"a server's GPUs (12 GB/s; the docs say only 'Pascal'); Horovod's "
                      f"64 MB fusion buffer as the bucket; missing: a convolution's own "
                      f"compute rate and the GPU (no Pascal preset)"),
    # (4) all-reduce bus bandwidth on named hardware
    Published("nccl-h100-ring", "busbw", NCCL_212,
              "8 x H100 SXM (NVLink 4, NVSwitch), ring all-reduce, large messages", 370,
              "GB/s", busbw=("nvlink4", "nvlink4", 8, 8, 0, 8 << 30),
              fits="links.NVLINK_EFFICIENCY"),
    Published("nccl-h100-nvls", "busbw", NCCL_212,
              "8 x H100 SXM, NVLink SHARP all-reduce (NCCL's default), large messages", 480,
              "GB/s", missing="in-switch reduction (NVLink SHARP) is not modelled: "
              "formulas.py has no all-reduce whose data crosses each link once"),
    Published("nccl-a100-8", "busbw", NCCL_149,
              "8 x A100-SXM4-80GB (NVLink 3, NVSwitch), all-reduce at 1 GB", 200, "GB/s",
              busbw=("nvlink3", "nvlink3", 8, 8, 0, 1 << 30),
              assumed="the thread's ~200 GB/s (its own rounding)"),
    Published("nccl-a100-3x8-hdr", "busbw", NCCL_119,
              "3 x 8 A100-SXM4-40GB, 4 HDR (200 Gbit/s) a node, all-reduce to 128 MB: peak",
              96, "GB/s", busbw=("nvlink3", "ib-hdr", 24, 8, 4, 128 << 20),
              assumed="the peak at the largest size (the thread: average 84.8, peak ~96)"),
)
