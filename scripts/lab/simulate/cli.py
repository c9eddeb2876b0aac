"""The cost model at scale: step time and time to target of ring, naive and parameter-server
training, predicted by alpha-beta-gamma formulas, calibrated on this host, validated on it.

    dtlab-simulate --calibrate --bench runs/allreduce.json runs/rounds.json \\
        runs/model.json                                      # -> runs/calibration.json
    dtlab-simulate --link 400gbit --intra-link nvlink --gpus-per-node 8 \\
        --tflops 400 --steps-to-target 5000 --d-model 4096 --n-layers 32 --json pred.json
    dtlab-simulate --link local                  # N ranks on this host
    dtlab-simulate --link 400gbit --intra-link nvlink --gpus-per-node 8 \
        --tflops 400 --zero 1,2,3                # ZeRO stages' steps and memory per rank
    dtlab-simulate --link 400gbit --intra-link nvlink --gpus-per-node 8 \\
        --tflops 400 --pp 4 --pp-schedule zb-h1 --grad-accum 16 --tp 8 \\
        --moe-experts 64 --moe-top-k 2 --ep 8 --d-model 4096 --n-layers 32
    dtlab-simulate --cluster dgx-a100-hdr --precision bf16 --tp 8 --pp 4 \\
        --pp-schedule interleaved --sequence-parallel --grad-accum 16 --d-model 8192
    dtlab-simulate --reproduce                   # published results against predictions
    flock /tmp/dtlab-bench.lock dtlab-simulate --validate-parallel \\
        --out runs/sim-par                          # pipelines (pp 2) and MoE ep 2, measured
    flock /tmp/dtlab-bench.lock dtlab-simulate --validate --ranks 2,3,4 \\
        --val-steps 200 --out runs/sim-val               # or --measured DIR: earlier runs
    flock /tmp/dtlab-bench.lock dtlab-simulate --validate --hosts 2 \\
        --link-gbit 1,0.1 --ranks 2 --val-runs sync-ring,async-bsp --config run.json

Predictions (the default): for N = 1, 2, 4, ... 1024 (--workers) ranks or
workers, the model of --config (default scripts/lab/configs/transformer.json)
and model/run flags, one row each: compute (models/cost.py FLOPs over the
calibrated rate, or --tflops), our ring family's exposed all-reduce and
step, the naive reduce + broadcast's, the parameter server's with --shards
S, and step x --steps-to-target (a measured run's statistical efficiency;
the same K at every N: how K falls with a larger global batch is not
modelled, McCandlish et al. 2018). The formulas are in
simulate/formulas.py, the overlap and core-sharing rules in
simulate/step.py.

ZeRO: --zero S (a stage or a comma-separated list of them, 1..3) adds each
stage's exposed reduce-scatter and all-gathers, its step and its memory per
rank beside plain data parallelism's (simulate/zero.py: the ring's bytes,
2(N-1)/N Psi for stages 1 and 2, 3(N-1)/N Psi for stage 3; memory by the
paper's per-parameter bytes, models/cost.py zero_memory, at the config's
--dtype and run precision and optimizer). Data parallelism alone: not with
--pp, --tp or --ep.

Between sync and async: --methods local:H,diloco:H,topk:F,randk:F,sign,powersgd:R
adds each method's exposed communication and step beside plain data parallelism's
(simulate/methods.py: local SGD and DiLoCo one all-reduce per H steps, compression its
payload's all-gather or all-reduce plus the compressors' compute, measured here with
--link local, from memory passes at --mem-gbs at a preset).

Model parallelism: --pp P (--pp-schedule and --virtual-stages, --grad-accum M
micro-batches a step and --stages as dtlab-sync takes them), --tp T, --ep E (with
--moe-experts N --moe-top-k k) predict a dp x pp x ep x tp layout instead:
N = dp P E T ranks (N not a multiple of P E T is left out); the step is the
schedule's op lists (models/schedule.py) replayed with each stage's F/B/W
times (its models/cost.py FLOPs / T at the compute rate) and the receives of
the activations and gradients between stages at the link's alpha-beta
(simulate/pipeline.py), with Megatron's 4 all-reduces of (b, T, d) per
block inside the passes (simulate/tensor.py, on --intra-link), the MoE
layers' 4 all-to-alls of the dispatched rows per micro-batch
(simulate/moe.py), and the gradient all-reduce, dense over dp x ep,
experts over dp (simulate/parallel.py). The table gains the bubble, p2p,
tp and a2a columns of the dimensions used.

Links: --link (between nodes) and --intra-link (within one, default the
same) name a preset (simulate/links.py: nvlink, 400gbit, 200gbit,
100gbit, 25gbit, 10gbit, 1gbit, and the spec-sheet generations nvlink2/3/4,
ib-edr/hdr/ndr, roce-100/200) or `local`, this host as --calibration
measured it (every rank on it, sharing its cores). --alpha-us / --gbit
replace the inter-node link's figures (a cluster measured elsewhere, an
emulated one at a set rate), --intra-alpha-us / --intra-gbit the intra-node
link's, --nics-per-node how many NICs a node's GPUs share.

GPUs: --gpu NAME computes at that GPU's achieved rate for the model's width
(simulate/hardware.py: spec-sheet peak and HBM bandwidth, a roofline per
matmul, the elementwise work at HBM speed, one fitted efficiency per GPU) in
place of --tflops; --cluster NAME (simulate/clusters.py) sets the GPU, both
links, GPUs and NICs a node at once. Bytes per tensor class follow the
trainers' --dtype, --precision fp16|bf16 and --wire (simulate/precision.py).
On GPU presets the naive and parameter-server columns print only when
--shards is given. --sequence-parallel and --scatter-gather (Korthikanti et
al. 2022; Narayanan et al. 2021) send 1/tp of an activation between stages;
--recompute repeats the blocks' tp all-reduces in backward. Two flags predict
other frameworks' runs: --flash-attention (fused attention, no score in memory)
and --grad-reduce-after (the gradient all-reduce after the last backward, as
Megatron-LM's local DDP ran it).

--reproduce prints published results (simulate/published.py: Megatron-LM's
throughput tables, torchtitan's FSDP throughput, Horovod's scaling efficiency,
nccl-tests bus bandwidths) beside the predictions of their flags, with each
ratio (simulate/reproduce.py).

--calibrate fits the constants to benchmark JSON (simulate/calibration_fit.py)
and writes them to --calibration with their fit errors. --validate runs
dtlab-compare at each N of --ranks (or reads --measured DIR) and
prints predicted against measured step time per run, the relative error
and whether it is within 25% (simulate/validate.py); with --hosts H the
runs go across H emulated hosts (dtlab-compare --hosts H --link-gbit X, at every
rate of --link-gbit) and are predicted with that link (simulate/emulated.py:
one rank or worker per host). --validate-parallel measures the pipeline rows of
dtlab.lab.bench.parallel (pp 2: GPipe, 1F1B, ZB-H1 at m 4 and 8) and a
dtlab-sync MoE run with --ep 2 (or reads --measured DIR: an earlier
--validate-parallel folder) and prints predicted against measured step time
and bubble (simulate/validate_parallel.py). Exit status: 0, 1
when a validated run is off by more than the bound, 2 for a bad flag.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
from dataclasses import replace
from pathlib import Path

from dtlab.lab import presets
from dtlab.lab.compare import cluster
from dtlab.lab.simulate import (
    calibration_fit,
    clusters,
    hardware,
    links,
    methods,
    parallel,
    pipeline,
    scale,
    table,
    validate,
    validate_parallel,
    zero,
)
from dtlab.lab.simulate.calibration_links import (
    host_alltoall,
    host_network,
    host_p2p,
    host_server,
    preset_server,
)
from dtlab.lab.simulate.emulated import Cluster
from dtlab.lab.simulate.formulas import Network
from dtlab.lab.simulate.step import ComputeRate, Host, Workload, compute_rate
from dtlab.models.config import ConfigError
from dtlab.models.cost import estimate
from dtlab.models.partition import check_pipeline
from dtlab.models.run.cli import run_cli
from dtlab.models.run.session import parse, replica_cost
from dtlab.models.schedule import SCHEDULES

PROG = "dtlab-simulate"
DEFAULT_CALIBRATION = "runs/calibration.json"
DEFAULT_RANKS = "2,3,4"


def apply_cluster(o) -> None:
    """--cluster NAME: its GPU, links, GPUs and NICs a node wherever their own flags are
    left at their defaults."""
    if not o.cluster:
        return
    c = clusters.cluster(o.cluster)
    if o.link == links.LOCAL:
        o.link = c.inter
    o.intra_link = o.intra_link or c.intra
    if o.gpus_per_node == 1:
        o.gpus_per_node = c.gpus_per_node
    if o.nics_per_node is None:
        o.nics_per_node = c.nics_per_node
    if not o.gpu and o.tflops is None:
        o.gpu = c.gpu


def int_list(text: str, flag: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{flag} must be comma-separated integers (got {text!r})") from None
    if not values or min(values) < 1:
        raise ConfigError(f"{flag} must name N >= 1 (got {text!r})")
    return values


def float_list(text: str, flag: str) -> tuple[float, ...]:
    try:
        values = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"{flag} must be comma-separated numbers (got {text!r})") from None
    if not values or not all(math.isfinite(v) and v > 0 for v in values):
        raise ConfigError(f"{flag} must name positive rates (got {text!r})")
    return values


def add_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("simulation")
    g.add_argument("--link", default=links.LOCAL,
                   help=f"link between nodes: {', '.join(links.NAMES)} (default local: this "
                        "host, from --calibration)")
    g.add_argument("--intra-link", default="", help="link within a node (default: --link)")
    g.add_argument("--gpus-per-node", type=int, default=1,
                   help="ranks per node: a two-level all-reduce above it (default 1)")
    g.add_argument("--alpha-us", type=float, default=None,
                   help="latency of the link between nodes, in place of the preset's")
    g.add_argument("--gbit", type=float, default=None,
                   help="bandwidth of the link between nodes in Gbit/s, in place of the preset's")
    g.add_argument("--intra-alpha-us", type=float, default=None,
                   help="latency of the link within a node, in place of the preset's")
    g.add_argument("--intra-gbit", type=float, default=None,
                   help="bandwidth of the link within a node in Gbit/s (a GPU's, one "
                        "direction), in place of the preset's")
    g.add_argument("--nics-per-node", type=int, default=None,
                   help="NICs a node: its GPUs share them across nodes (default one a GPU)")
    g.add_argument("--cluster", default="", choices=("", *clusters.NAMES), metavar="NAME",
                   help="a GPU cluster preset (simulate/clusters.py: "
                        f"{', '.join(clusters.NAMES)}): its GPU, links, GPUs and NICs a "
                        "node; each can still be set by its own flag")
    g.add_argument("--gpu", default="", choices=("", *hardware.GPU_NAMES), metavar="NAME",
                   help="compute at this GPU's achieved rate for the model's size "
                        f"(simulate/hardware.py: {', '.join(hardware.GPU_NAMES)}) at the "
                        "--precision's (or --dtype's) compute dtype")
    g.add_argument("--grad-reduce-after", action="store_true",
                   help="the gradient all-reduce after the last micro-batch's backward, none "
                        "of it hidden (Megatron-LM's local DDP of 2019-21; dtlab-sync hides it "
                        "behind the last micro-batch's backward)")
    g.add_argument("--flash-attention", action="store_true",
                   help="--gpu's achieved rate with fused (flash) attention: no attention "
                        "score in memory (simulate/hardware.py; a prediction of other "
                        "frameworks' runs: dtlab's attention keeps its scores)")
    g.add_argument("--tflops", type=float, default=None,
                   help="a rank's sustained TFLOP/s (default: this host's calibrated rate)")
    g.add_argument("--wire", choices=("fp32", "fp16", "bf16"), default="fp32",
                   help="dtype the gradient all-reduce moves, as dtlab-sync's --wire "
                        "(--precision fp16|bf16 moves half gradients already)")
    g.add_argument("--reproduce", action="store_true",
                   help="the table of published results against this model's predictions "
                        "(simulate/published.py, simulate/reproduce.py)")
    g.add_argument("--workers", default=",".join(map(str, scale.DEFAULT_WORKERS)),
                   help="N to predict, comma-separated (default 1,2,4,...,1024)")
    g.add_argument("--shards", type=int, default=None,
                   help="parameter-server shards S of the predictions; the naive and "
                        "parameter-server columns print with --link local or when this is "
                        "given (default 8)")
    g.add_argument("--steps-to-target", type=int, default=None,
                   help="steps to the target loss (from a measured run) for time to target")
    g.add_argument("--bucket-mb", type=float, default=clusters.BUCKET_MB,
                   help="gradient bucket size in MB, as dtlab-sync's (default "
                        f"{clusters.BUCKET_MB:g})")
    g.add_argument("--calibration", default=DEFAULT_CALIBRATION,
                   help=f"the calibration JSON read, or written by --calibrate "
                        f"(default {DEFAULT_CALIBRATION})")
    g.add_argument("--calibrate", action="store_true",
                   help="fit the constants to --bench files and write --calibration")
    g.add_argument("--bench", nargs="+", default=[], metavar="FILE",
                   help="benchmark JSON (bench_allreduce, bench_pserver, bench_model) to fit")
    g.add_argument("--validate", action="store_true",
                   help="predicted vs measured step time of dtlab-compare runs on this host")
    g.add_argument("--measured", default="", metavar="DIR",
                   help="--validate: read dtlab-compare folders under DIR instead of running")
    g.add_argument("--ranks", default=None,
                   help=f"--validate: N of the runs (default {DEFAULT_RANKS})")
    g.add_argument("--val-runs", default="sync-ring,sync-naive,async-bsp",
                   help="--validate: dtlab-compare runs at every N (default "
                        "sync-ring,sync-naive,async-bsp)")
    g.add_argument("--val-shards", type=int, default=2,
                   help="--validate: shards of the async runs (default 2)")
    g.add_argument("--hosts", type=int, default=1,
                   help="--validate: run dtlab-compare across this many emulated hosts (root; "
                        "one rank or worker per host) and predict with their shaped links "
                        "(simulate/emulated.py); 1: this host (default)")
    g.add_argument("--link-gbit", default="1,0.1",
                   help="--validate --hosts H: the link rates in Gbit/s, comma-separated, "
                        "each measured and predicted (default 1,0.1)")
    g.add_argument("--tcp-cc", default="reno",
                   help="--validate --hosts H: the emulated hosts' TCP congestion control "
                        "(dtlab-compare --tcp-cc; default reno)")
    g.add_argument("--val-steps", type=int, default=200,
                   help="--validate: steps of every run (default 200)")
    g.add_argument("--out", default="", metavar="DIR",
                   help="--validate: a new or empty folder for the runs (default "
                        "runs/simulate-DATE-TIME)")
    g.add_argument("--launches", type=int, default=3,
                   help="--validate: launches of every run, N interleaved; the median is "
                        "compared (default 3)")
    g.add_argument("--timeout", type=float, default=600.0,
                   help="--validate: seconds a run may take (default 600)")
    g.add_argument("--json", default="", metavar="PATH", help="write the rows here")
    g.add_argument("--zero", default="", metavar="S",
                   help="ZeRO stages to predict beside plain DP, e.g. 3 or 1,2,3: each one's "
                        "step and memory per rank (simulate/zero.py; default none)")
    g.add_argument("--methods", default="", metavar="LIST",
                   help="methods between sync and async to predict beside plain DP, e.g. "
                        "local:8,diloco:50,topk:0.01,randk:0.01,sign,powersgd:4: each one's "
                        "exposed communication and step (simulate/methods.py; default none)")
    g.add_argument("--mem-gbs", type=float, default=2000.0,
                   help="--methods at a preset link: a rank's memory bandwidth in GB/s, "
                        "which the compressors' passes over the gradient go at (default "
                        "2000, an H100-class GPU's HBM at about 60%%)")
    m = p.add_argument_group("model parallelism (a dp x pp x ep x tp layout)")
    m.add_argument("--pp", type=int, default=1, help="pipeline stages (default 1)")
    m.add_argument("--pp-schedule", choices=sorted(SCHEDULES), default="1f1b",
                   help="pipeline schedule, as dtlab-sync's (default 1f1b); its micro-batches "
                        "are --grad-accum")
    m.add_argument("--virtual-stages", type=int, default=None,
                   help="--pp-schedule interleaved: model chunks per rank (default 2)")
    m.add_argument("--sequence-parallel", action="store_true",
                   help="Megatron's sequence parallelism (Korthikanti et al. 2022): norms "
                        "split over tp, 1/tp of an activation sent between stages (a "
                        "prediction of Megatron-LM's runs: dtlab-sync has none)")
    m.add_argument("--scatter-gather", action="store_true",
                   help="Megatron's scatter-gather (Narayanan et al. 2021): each tp rank sends "
                        "1/tp of an activation between stages (on with --sequence-parallel; "
                        "dtlab-sync sends it whole)")
    m.add_argument("--stages", default="",
                   help="modules per stage, e.g. 3,2 (default: balanced by FLOPs)")
    m.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel ranks (Megatron split, within a node; default 1)")
    m.add_argument("--ep", type=int, default=1,
                   help="expert-parallel ranks (must divide --moe-experts; default 1)")
    m.add_argument("--moe-alltoall", choices=("ours", "mpi"), default="ours",
                   help="--link local: the all-to-all whose calibration is used (default ours)")
    m.add_argument("--validate-parallel", action="store_true",
                   help="predicted vs measured pipeline (bench parallel, pp 2) and MoE "
                        "(dtlab-sync --ep 2) steps on this host")
    m.add_argument("--moe-steps", type=int, default=60,
                   help="--validate-parallel: steps of each MoE run (default 60)")


def parse_args(argv: list[str]):
    named = any(a.split("=", 1)[0] in ("--config", "--model") for a in argv)
    setup = parse(presets.resolve(argv) if named else
                  ["--config", str(presets.config_path(presets.DEFAULT)), *argv], prog=PROG,
                  description=__doc__.split("\n\n")[0], add_extra=add_flags,
                  flags={"optim": ("optimizer",),
                         "run": ("batch_size", "grad_accum", "dtype", "precision")},
                  why="the simulation runs no training of its own")
    o = setup.extra
    if o.reproduce:
        others = [a.split("=", 1)[0] for i, a in enumerate(argv) if a.startswith("--")
                  and a.split("=", 1)[0] not in ("--reproduce", "--json")]
        if others:
            raise ConfigError(f"--reproduce takes only --json: its rows carry their own "
                              f"flags (simulate/published.py); got {' '.join(others)}")
    if o.ranks is not None and not o.validate:
        raise ConfigError(f"--ranks {o.ranks} is --validate's (the N of the runs it measures); "
                          "a prediction's N are --workers")
    o.shards_given = o.shards is not None
    o.shards = 8 if o.shards is None else o.shards
    apply_cluster(o)
    for flag, value in (("--link", o.link), ("--intra-link", o.intra_link)):
        if value and value != links.LOCAL:
            links.preset(value, flag)  # an unknown name is a ConfigError
    if o.link == links.LOCAL and any(v is not None for v in (
            o.alpha_us, o.gbit, o.intra_alpha_us, o.intra_gbit, o.nics_per_node)):
        raise ConfigError("--alpha-us, --gbit, --intra-alpha-us, --intra-gbit and "
                          "--nics-per-node replace a preset's figures; with --link local "
                          "they come from --calibration")
    if o.gpu and o.tflops is not None:
        raise ConfigError(f"--gpu {o.gpu} and --tflops {o.tflops:g} both set the compute "
                          "rate: give one")
    if o.gpu and o.link == links.LOCAL:
        raise ConfigError(f"--gpu {o.gpu} predicts GPUs: give their links (--link, "
                          "--intra-link) or a --cluster, not this host's calibration")
    if o.nics_per_node is not None and o.nics_per_node < 1:
        raise ConfigError(f"--nics-per-node must be at least 1 (got {o.nics_per_node})")
    if o.link != links.LOCAL:
        preset_network(o)  # a figure out of range is a ConfigError naming its flag
    if o.flash_attention and not o.gpu:
        raise ConfigError("--flash-attention acts on a GPU's achieved rate: it needs --gpu "
                          "or --cluster")
    if (o.sequence_parallel or o.scatter_gather) and o.tp == 1:
        raise ConfigError("--sequence-parallel and --scatter-gather split over tp ranks: "
                          "they need --tp > 1")
    if o.virtual_stages is not None and o.pp_schedule != "interleaved":
        raise ConfigError(f"--virtual-stages {o.virtual_stages} has no effect without "
                          "--pp-schedule interleaved")
    if o.intra_link == links.LOCAL and o.link != links.LOCAL:
        raise ConfigError("--intra-link local needs --link local: the host's calibration is "
                          "one host")
    for flag, value in (("--gpus-per-node", o.gpus_per_node), ("--shards", o.shards),
                        ("--val-shards", o.val_shards), ("--val-steps", o.val_steps),
                        ("--launches", o.launches)):
        if value < 1:
            raise ConfigError(f"{flag} must be at least 1 (got {value})")
    if o.steps_to_target is not None and o.steps_to_target < 1:
        raise ConfigError(f"--steps-to-target must be at least 1 (got {o.steps_to_target})")
    if o.tflops is not None and not o.tflops > 0:
        raise ConfigError(f"--tflops must be positive (got {o.tflops})")
    if not o.bucket_mb > 0:
        raise ConfigError(f"--bucket-mb must be positive (got {o.bucket_mb})")
    if o.calibrate and o.validate:
        raise ConfigError("--calibrate and --validate are separate steps: calibrate first")
    if o.hosts < 1:
        raise ConfigError(f"--hosts must be at least 1 (got {o.hosts})")
    o.rates = float_list(o.link_gbit, "--link-gbit")
    o.ranks = o.ranks or DEFAULT_RANKS
    if o.hosts > 1 and not o.measured and max(int_list(o.ranks, "--ranks")) > o.hosts:
        raise ConfigError(f"--hosts {o.hosts}: the emulated-cluster model takes one rank or "
                          f"worker per host; give --ranks of at most {o.hosts}")
    if o.hosts > 1 and o.validate and not o.measured and cluster.check():
        raise ConfigError(f"--hosts {o.hosts}: {cluster.check()}")
    for flag, value in (("--pp", o.pp), ("--tp", o.tp), ("--ep", o.ep),
                        ("--moe-steps", o.moe_steps)):
        if value < 1:
            raise ConfigError(f"{flag} must be at least 1 (got {value})")
    o.parallel = o.pp > 1 or o.tp > 1 or o.ep > 1
    for flag, value, default, needs in (
            ("--pp-schedule", o.pp_schedule, "1f1b", o.pp > 1),
            ("--moe-alltoall", o.moe_alltoall, "ours", o.ep > 1 and o.link == links.LOCAL)):
        if value != default and not needs:
            raise ConfigError(f"{flag} {value} has no effect here (it needs --pp for the "
                              "schedule, a model-parallel layout for micro-batches, --ep "
                              "with --link local for the all-to-all)")
    if o.stages and o.pp == 1:
        raise ConfigError(f"--stages {o.stages} has no effect without --pp")
    if o.link != links.LOCAL and o.tp > o.gpus_per_node:
        raise ConfigError(f"--tp {o.tp} exceeds --gpus-per-node {o.gpus_per_node}: tensor "
                          "parallelism runs within a node")
    if o.parallel and (o.calibrate or o.validate or o.validate_parallel):
        raise ConfigError("--pp, --tp and --ep are predictions' flags; --calibrate and the "
                          "validations take none")
    if o.validate_parallel and (o.calibrate or o.validate):
        raise ConfigError("--validate-parallel is a step of its own: not with --calibrate or "
                          "--validate")
    o.workers_list = int_list(o.workers, "--workers")
    o.ranks_list = int_list(o.ranks, "--ranks")
    o.zero_stages = zero_stages(setup, o)
    o.method_list = method_list(o)
    return setup


def method_list(o) -> tuple[methods.Method, ...]:
    """The methods --methods names (none without it), or a ConfigError naming the flag."""
    if not o.methods:
        return ()
    if o.parallel or o.calibrate or o.validate or o.validate_parallel:
        raise ConfigError(f"--methods {o.methods} predicts data parallelism's relatives: "
                          "not with --pp, --tp, --ep, --calibrate or the validations")
    if o.mem_gbs <= 0:
        raise ConfigError(f"--mem-gbs must be positive (got {o.mem_gbs:g})")
    return methods.parse(o.methods)


def zero_stages(setup, o) -> tuple[int, ...]:
    """The stages --zero names (none without it), or a ConfigError naming the flag."""
    if not o.zero:
        return ()
    stages = tuple(sorted(set(int_list(o.zero, "--zero"))))
    if not set(stages) <= set(zero.STAGES):
        raise ConfigError(f"--zero names ZeRO stages 1, 2 or 3 (got {o.zero!r})")
    if o.parallel:
        raise ConfigError(f"--zero {o.zero} predicts ZeRO over data parallelism alone (as "
                          "dtlab-sync runs it): not with --pp, --tp or --ep")
    if o.calibrate or o.validate or o.validate_parallel:
        raise ConfigError(f"--zero {o.zero} is a prediction's flag; --calibrate and the "
                          "validations take none")
    if getattr(setup.model, "moe_experts", 0):
        raise ConfigError(f"--zero {o.zero} with --moe-experts: dtlab-sync shards no experts")
    return stages


def write_json(path: str, data: dict) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(data, indent=1) + "\n")


def do_calibrate(o) -> int:
    cal = calibration_fit.calibrate(o.bench, os.cpu_count() or 1)
    write_json(o.calibration, cal)
    print(f"# calibration of this host ({cal['cores']} cores) from "
          f"{', '.join(s['path'] for s in cal['sources'])} -> {o.calibration}")
    print(table.fits(cal))
    write_json(o.json, cal)
    return 0


def new_folder(given: str) -> Path:
    if given:
        out = Path(given)
        if out.exists() and (not out.is_dir() or any(out.iterdir())):
            raise ConfigError(f"--out {given}: exists and is not an empty folder; give a new one")
    else:
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        out = Path("runs") / f"simulate-{stamp}"
    out.mkdir(parents=True, exist_ok=True)
    return out


def do_validate(setup, o) -> int:
    cal = calibration_fit.load(o.calibration)
    host = Host(os.cpu_count() or 1)
    if o.measured:
        folders = validate.measured_dirs(o.measured)
        out = Path(o.measured)
        config = str(folders[0] / "config.json")
    else:
        out = new_folder(o.out)
        config = str(out / "config.json")
        Path(config).write_text(json.dumps(setup.as_dict(), indent=1) + "\n")
        folders = None
    n_list = o.ranks_list
    threads = sorted({host.threads(n) for n in n_list})
    benches, together = [], []
    roles = validate.roles_of(o.val_runs)
    if folders is None:
        folders = []
        for k in range(o.launches):  # the compute benchmark beside each launch's runs
            launch = out / f"launch{k}"
            launch.mkdir()
            before = os.getloadavg()[0]
            benches += validate.bench_compute(config, threads, launch)
            if o.hosts == 1:  # emulated hosts are pinned to their own cores: not this host's
                together += validate.bench_together(config, n_list, roles, launch, o.timeout)
            folders += validate.run_comparisons(config, n_list, o.val_runs, o.val_shards,
                                                o.val_steps, launch, o.timeout, o.hosts,
                                                o.rates, o.tcp_cc)
            (launch / "load.json").write_text(json.dumps(
                {"before": before, "after": os.getloadavg()[0]}))
    else:
        benches = sorted(out.glob("**/model-t*.json"))
        if not benches:
            bench_dir = out / "model-bench"
            bench_dir.mkdir(exist_ok=True)
            benches = validate.bench_compute(config, threads, bench_dir)
        together = sorted(out.glob("**/together-*.json"))
        if not together and validate.any_local(folders):
            bench_dir = out / "model-bench"
            bench_dir.mkdir(exist_ok=True)
            together = validate.bench_together(config, n_list, roles, bench_dir, o.timeout)
    cal["compute_rows"] = [*cal.get("compute_rows", []), *validate.compute_rows(benches)]
    rows = validate.validate(folders, cal, host, o.bucket_mb * 1e6,
                             validate.together_rows(together))
    print(f"# validation on this host: {host.cores} cores; calibration {o.calibration}; "
          f"compute: {len(together)} benchmark(s) of N processes stepping together "
          f"(bench together) and {len(benches)} of the model in one process "
          f"({', '.join(str(p) for p in benches[:3])}{' ...' if len(benches) > 3 else ''}); "
          f"runs in {out}, {len(folders)} dtlab-compare folder(s)")
    for gbit in sorted({r["link_gbit"] for r in rows if r["link_gbit"]}, reverse=True):
        hosts = next(r["hosts"] for r in rows if r["link_gbit"] == gbit)
        print(f"# emulated: {Cluster(hosts, gbit).describe(cal)}; rank, worker or shard i on "
              "host i mod H; gRPC on the calibration's session path (TCP), plus the link")
    loads = [r["max_load"] for r in rows if r["max_load"] is not None]
    if loads and max(loads) > host.cores:
        print(f"# warning: the host's 1-minute load average reached {max(loads):.1f} on "
              f"{host.cores} cores around the launches: other processes took cores from the "
              "runs, which the model does not know of (rerun on a quiet host)")
    if any(r["share"] > 1 for r in rows):
        print(f"# N > {host.cores} ranks or workers oversubscribe the {host.cores} cores: their "
              "compute is the N processes' measured stepping together (else one process's "
              "rate over N / cores), the all-reduce takes N / cores turns, and no "
              "communication hides behind backward")
    print(table.validation(rows, host.cores))
    write_json(o.json, {"calibration": o.calibration, "cores": host.cores, "bound": validate.BOUND,
                        "rows": rows})
    return 0 if all(r["within"] for r in rows) else 1


def parallel_work(setup, o) -> parallel.Work:
    """The layout's step as `setup` and the model-parallel flags describe it."""
    b = setup.run.batch_size
    m = setup.run.grad_accum
    check_pipeline(o.pp, m, o.pp_schedule, o.virtual_stages, "--grad-accum")
    w = validate.workload_of(setup)
    bounds = pipeline.stage_bounds(setup.model_name, setup.model, b, o.pp, o.stages)
    flops = estimate(setup.model_name, setup.model, b, optimizer=w.optimizer).flops_step
    work = parallel.Work(setup.model_name, setup.model, b, m, o.pp_schedule,
                         8 if setup.run.dtype == "float64" else 4, tuple(bounds), flops,
                         validate.precision_of(setup), o.scatter_gather or o.sequence_parallel,
                         o.virtual_stages, not o.grad_reduce_after)
    parallel.check(work, parallel.Layout(1, o.pp, o.ep, o.tp))
    return work


def gpu_rate(setup, o, tp: int = 1) -> ComputeRate:
    """--gpu: the achieved rate of one micro-batch of the model on one of tp ranks (at
    o.gpu_spec where set: simulate/reproduce.py's fit tries other constants)."""
    p = validate.precision_of(setup)
    g = getattr(o, "gpu_spec", None) or hardware.gpu(o.gpu)
    return hardware.achieved_rate(g, setup.model_name, setup.model,
                                  setup.run.batch_size, p.compute, p.activation,
                                  p.activation, tp, o.sequence_parallel, o.flash_attention)


def rate_of(o, cal: dict | None, work: Workload, local: bool,
            on_gpu: ComputeRate | None = None):
    """threads -> the compute rate of `work`: --tflops, --gpu's achieved rate (`on_gpu`),
    or the calibration's fit at that many threads (on this host) or at the calibrated
    host's cores."""
    def rate_at(threads: int) -> ComputeRate:
        if o.tflops is not None:
            return ComputeRate(o.tflops * 1e12, source=f"--tflops {o.tflops:g}")
        if on_gpu is not None:
            return on_gpu
        try:
            return compute_rate(cal, work, threads if local else cal["cores"])
        except LookupError as e:
            raise ConfigError(f"--calibration {o.calibration}: {e}") from None
    return rate_at


def preset_network(o) -> Network:
    """The links of --link / --intra-link (or --cluster), with the flags that replace
    their figures."""
    inter = links.custom(links.preset(o.link), o.alpha_us, o.gbit)
    intra = links.custom(links.preset(o.intra_link) if o.intra_link else inter,
                         o.intra_alpha_us, o.intra_gbit, ("--intra-alpha-us", "--intra-gbit"))
    return Network(intra, inter, o.gpus_per_node, nics_per_node=o.nics_per_node or 0)


def where_words(o, net: Network | None) -> str:
    if net is None:
        return "this host (all ranks on it, sharing its cores)"
    k = net.nics_per_node
    nics = f", {k:g} NIC{'' if k == 1 else 's'} a node" if k else ""
    return (f"{net.gpus_per_node} per node{nics}; within: {net.intra.describe()}; between: "
            f"{net.inter.describe()}" + (f" (cluster {o.cluster})" if o.cluster else ""))


def parallel_prediction(setup, o) -> tuple[parallel.Work, list[dict], Network | None]:
    """(the layout's work, one row per N of --workers, the preset network or None on this
    host): what do_predict_parallel prints, and simulate/reproduce.py's rows use."""
    work = parallel_work(setup, o)
    layout = parallel.Layout(1, o.pp, o.ep, o.tp)
    local = o.link == links.LOCAL
    cal = calibration_fit.load(o.calibration) if local or (o.tflops is None and not o.gpu) \
        else None
    w = validate.workload_of(setup)
    micro = replace(w, batch_size=work.batch, flops_step=work.flops_microbatch)
    net = None
    if local:
        host = Host(os.cpu_count() or 1)
        a2a = host_alltoall(cal, o.moe_alltoall) if o.ep > 1 else None
        p2p = host_p2p(cal) if o.pp > 1 else None

        def fabric_at(n: int) -> parallel.Fabric:
            return parallel.Fabric(host_network(cal, n), p2p, a2a, one_host=True)
    else:
        host = Host(0)
        net = preset_network(o)

        def fabric_at(n: int) -> parallel.Fabric:
            return parallel.Fabric(net)

    rate_at = rate_of(o, cal, micro, local, gpu_rate(setup, o, o.tp) if o.gpu else None)
    rows = scale.parallel_rows(work, layout, o.workers_list, fabric_at, rate_at, host,
                               o.bucket_mb * 1e6)
    if not rows:
        raise ConfigError(f"--workers {o.workers}: no N is a multiple of pp x ep x tp = "
                          f"{layout.model_parallel}")
    return work, rows, net


def do_predict_parallel(setup, o) -> int:
    work, rows, net = parallel_prediction(setup, o)
    w = validate.workload_of(setup)
    sizes = [hi - lo for lo, hi in zip(work.bounds, work.bounds[1:], strict=False)]
    cost = replica_cost(setup)
    print(f"# {work.model}: {cost.params_total:,} parameters; pp {o.pp} ({o.pp_schedule}, "
          f"{work.microbatches} micro-batches of {work.batch}, modules per stage "
          f"{','.join(map(str, sizes))}), tp {o.tp}"
          + (" sequence-parallel" if o.sequence_parallel else "")
          + (" scatter-gather" if work.scatter_gather and not o.sequence_parallel else "")
          + f", ep {o.ep}; {work.flops_microbatch / 1e9:.4g} GFLOP a micro-batch of the "
          f"whole model; {work.precision.describe()}; {where_words(o, net)}; "
          f"compute {rows[0]['compute_source']}; steps to target "
          f"{o.steps_to_target if o.steps_to_target else 'not given'}")
    print(table.parallel_predictions(rows, o.steps_to_target))
    write_json(o.json, {"model": work.model, "config": w.config, "params": cost.params_total,
                        "flops_step": work.flops_microbatch * work.microbatches,
                        "flops_microbatch": work.flops_microbatch,
                        "grad_bytes": w.grad_bytes,
                        "precision": vars(work.precision), "pp": o.pp, "tp": o.tp,
                        "ep": o.ep, "schedule": o.pp_schedule, "microbatches": work.microbatches,
                        "virtual_stages": o.virtual_stages,
                        "sequence_parallel": o.sequence_parallel,
                        "scatter_gather": work.scatter_gather,
                        "batch_size": work.batch, "stage_bounds": list(work.bounds),
                        "link": o.link, "intra_link": o.intra_link or o.link,
                        "gpus_per_node": o.gpus_per_node, "cluster": o.cluster or None,
                        "gpu": o.gpu or None,
                        "steps_to_target": o.steps_to_target, "rows": rows})
    return 0


def dp_prediction(setup, o):
    """(workload, one row per N of --workers, the preset network or None on this host,
    precision, the ZeRO spec, the methods' compute, whether the ps columns show): what
    do_predict prints, and simulate/reproduce.py's data-parallel rows use."""
    cost = replica_cost(setup)
    w = validate.workload_of(setup)
    prec = validate.precision_of(setup)
    local = o.link == links.LOCAL
    need_cal = local or (o.tflops is None and not o.gpu)
    # a preset with --tflops needs none, but takes the servers' apply rate from one there is
    cal = calibration_fit.load(o.calibration) if need_cal or Path(o.calibration).exists() else None
    net = None
    if local:
        host = Host(os.cpu_count() or 1)
        network = host_network(cal, max(o.workers_list))
        ps = host_server(cal, w.optimizer)
    else:
        host = Host(0)
        net = network = preset_network(o)
        ps = preset_server(network.inter, cal, w.optimizer)

    rate_at = rate_of(o, cal, w, local, gpu_rate(setup, o) if o.gpu else None)
    spec = zero.ZeroSpec(o.zero_stages, zero.unit_bytes(w.model, setup.model, w.batch_size,
                                                        prec.gradient),
                         cost.params_total, setup.run.precision,
                         8 if setup.run.dtype == "float64" else 4,
                         prec.gather / prec.gradient, setup.run.grad_accum,
                         zero.backward_share(setup.model)) \
        if o.zero_stages else None
    extra = None
    if o.method_list:
        grad = methods.gradient_of(w.model, setup.model, prec.gradient)
        cc = (methods.measured_compute(o.method_list, grad) if local else
              methods.preset_compute(o.method_list, grad, o.mem_gbs,
                                     rate_at(1).flops_per_s))

        def extra(n, compute, late):
            return methods.method_columns(o.method_list, grad, n, network, compute, host,
                                          late, cc)
    show_ps = local or o.shards_given
    rows = scale.rows(w, o.workers_list, network, ps, o.shards, rate_at, host,
                      o.bucket_mb * 1e6, spec, extra, kinds=None if show_ps else ("ring",))
    return w, rows, net, prec, spec, (cc if extra else None), show_ps


def do_predict(setup, o) -> int:
    cost = replica_cost(setup)
    w, rows, net, prec, spec, cc, show_ps = dp_prediction(setup, o)
    print(f"# {w.model}: {cost.params_total:,} parameters, {cost.flops_step / 1e9:.4g} GFLOP a "
          f"step of batch {w.batch_size} a rank ({setup.run.grad_accum} micro-batch(es)); "
          f"gradient {w.grad_bytes / 1e6:.4g} MB in {o.bucket_mb:g} MB buckets; "
          f"{prec.describe()}; {where_words(o, net)}; "
          + (f"parameter server: {o.shards} shards; " if show_ps else "")
          + f"compute {rows[0]['compute_source']}; steps to target "
          f"{o.steps_to_target if o.steps_to_target else 'not given'}"
          + (f"; ZeRO stages {','.join(map(str, spec.stages))}, memory at {spec.precision} "
             f"with {w.optimizer}" if spec else "")
          + (f"; methods {o.methods}, compression compute {cc.source}" if cc else ""))
    print(table.predictions(rows, o.steps_to_target))
    write_json(o.json, {"model": w.model, "config": w.config, "params": cost.params_total,
                        "flops_step": w.flops_step, "grad_bytes": w.grad_bytes,
                        "precision": vars(prec), "microbatches": w.microbatches,
                        "link": o.link, "intra_link": o.intra_link or o.link,
                        "gpus_per_node": o.gpus_per_node, "cluster": o.cluster or None,
                        "gpu": o.gpu or None, "shards": o.shards if show_ps else None,
                        "steps_to_target": o.steps_to_target,
                        "zero_stages": list(o.zero_stages),
                        "methods": [m.label for m in o.method_list], "rows": rows})
    return 0


# with no flags and no calibration of this host: a stated nominal cluster, not this host
NOMINAL = {"link": "100gbit", "intra_link": "nvlink", "gpus_per_node": 8, "tflops": 100.0}


def nominal(o) -> bool:
    """--link local asked for by default, with no calibration written yet: predict the
    NOMINAL cluster instead (saying so and how to calibrate); True when it did."""
    defaulted = (o.link == links.LOCAL and not o.intra_link and o.tflops is None
                 and o.calibration == DEFAULT_CALIBRATION and o.gpus_per_node == 1)
    if not defaulted or Path(o.calibration).exists() or o.calibrate or o.validate \
            or o.validate_parallel:
        return False
    for k, v in NOMINAL.items():
        setattr(o, k, v)
    print(f"# no calibration of this host ({DEFAULT_CALIBRATION}): nominal constants, "
          f"{o.gpus_per_node} ranks a node on {o.intra_link}, {o.link} between nodes, "
          f"{o.tflops:g} TFLOP/s a rank. To predict this host, calibrate it from the "
          "benchmarks' JSON (scripts/README.md, 'Predicting scale', step 1): dtlab-simulate "
          "--calibrate --bench runs/ar.json runs/rounds.json runs/ps.json runs/model.json "
          "runs/fanout.json")
    return True


def main(argv: list[str]) -> int:
    setup = parse_args(argv)
    o = setup.extra
    if not o.reproduce:
        nominal(o)
    if o.calibrate:
        return do_calibrate(o)
    if o.validate:
        return do_validate(setup, o)
    if o.validate_parallel:
        return validate_parallel.main(o, new_folder)
    if o.reproduce:
        from dtlab.lab.simulate import reproduce  # it predicts through this module's functions
        return reproduce.main(o.json)
    return do_predict_parallel(setup, o) if o.parallel else do_predict(setup, o)


def cli() -> None:
    sys.exit(run_cli(main, PROG))
