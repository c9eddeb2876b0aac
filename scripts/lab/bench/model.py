"""Training-step benchmark of the dense models against a matmul of the same run.

    dtlab-bench model --json bench-model.json     # 3 sizes x 2 models, ~2 min
    dtlab-bench model --reps 15 --json m.json     # the comparison with PyTorch, medians of 15
    dtlab-bench model --tiny                      # seconds; run by the test suite
    DTLAB_DEVICE=gpu dtlab-bench model            # the same on CuPy (no PyTorch comparison)

For each model and size it times one training step (zero grads, forward,
backward, AdamW update), best of --reps after --warmup, and reads it against
a float32 matmul timed just before in the same process, at a shape the
model itself multiplies: (tokens, d_model) @ (d_model, d_ff) for the
transformer, (batch, d_hidden) @ (d_hidden, d_hidden) for the MLP.

    GFLOP/s = models/cost.py FLOPs per step (matmuls as executed) / step time
    ratio   = GFLOP/s / matmul GFLOP/s

The medium transformer runs three ways: activations kept (medium), selective
recomputation (medium-sel: attention scores and softmax rebuilt in backward,
Korthikanti et al. 2022) and whole-block recomputation (medium-full); their
act MB and step time columns are the memory / time trade.

Where PyTorch is installed (it is not a dependency), every size is also run
by its PyTorch eager twin (scripts/lab/bench/model_torch.py: the same function
and parameter values, torch's own kernels: SDPA, fused AdamW, ...), its step
timed alternately with dtlab's in the same process on the same threads, each
timed call after at least 30 ms of untimed ones of its own (harness.SETTLE_S: a call
right after the other library's meets its thread pool still spinning, PyTorch's for about
11 ms, or asleep, and is slower by a large factor on a busy host; figures:
scripts/RESULTS.md):

    torch/dtlab = median torch step / median dtlab step     (> 1: dtlab is faster)

and a per-layer table follows: each layer kind at the shape the step meets it,
forward and backward (the loss and the optimizer step alone), dtlab's and
torch's medians, alternately timed. Without PyTorch the run says so and
measures its own baseline, the matmul, as always. The header records the BLAS
NumPy runs (threadpoolctl: library, kernel architecture, threads) and any
OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE that would change it.

Best-of-N beside the medians because the machine is shared: other processes only ever
add time; the JSON keeps every timed step of both (step_s_each, torch_step_s_each), so a
median moved by a few slow steps (a woken thread that waits for its core) shows as such.
Activation bytes are measured on the forward context
(models/memory.py) and compared with models/cost.py; a mismatch counts in #wrong,
as does a non-finite loss or a PyTorch twin whose first loss differs from
dtlab's by more than 1e-4 (relative), and makes the exit status 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import sys

import numpy as np

from dtlab.lab.bench import harness, model_torch
from dtlab.lab.bench.harness import SETTLE_S, alternate_times, describe_blas, start
from dtlab.models import backend
from dtlab.models.cost import estimate
from dtlab.models.memory import context_bytes
from dtlab.models.mlp import MLPConfig
from dtlab.models.model import Replica
from dtlab.models.optim import OptimConfig, make_optimizer
from dtlab.models.transformer import TransformerConfig
from dtlab.models.zoo import build_model

MEDIUM = TransformerConfig(vocab=4096, seq_len=128, d_model=512, n_heads=8, n_layers=4,
                           d_ff=2048)
# (model, size, config, batch size)
SIZES = [
    ("mlp", "small", MLPConfig(d_in=32, d_hidden=256, n_layers=2, n_classes=8), 256),
    ("mlp", "medium", MLPConfig(d_in=256, d_hidden=1024, n_layers=3, n_classes=16), 512),
    ("mlp", "large", MLPConfig(d_in=1024, d_hidden=2048, n_layers=4, n_classes=100), 1024),
    ("transformer", "small", TransformerConfig(vocab=256, seq_len=64, d_model=128, n_heads=4,
                                               n_layers=2, d_ff=512), 8),
    ("transformer", "medium", MEDIUM, 8),
    # activation recomputation at the same size: none (above), selective, full
    ("transformer", "medium-sel", dataclasses.replace(MEDIUM, selective_recompute=True), 8),
    ("transformer", "medium-full", dataclasses.replace(MEDIUM, recompute=True), 8),
    ("transformer", "d1024", TransformerConfig(vocab=8192, seq_len=256, d_model=1024,
                                               n_heads=16, n_layers=2, d_ff=4096), 4),
]
TINY = [
    ("mlp", "tiny1", MLPConfig(d_in=8, d_hidden=16, n_layers=1, n_classes=4), 4),
    ("mlp", "tiny2", MLPConfig(d_in=8, d_hidden=16, n_layers=2, n_classes=4,
                               activation="relu"), 4),
    ("mlp", "tiny3", MLPConfig(d_in=8, d_hidden=32, n_layers=2, n_classes=4), 8),
    ("transformer", "tiny1", TransformerConfig(vocab=16, seq_len=8, d_model=16, n_heads=2,
                                               n_layers=1, d_ff=32), 2),
    ("transformer", "tiny2", TransformerConfig(vocab=16, seq_len=8, d_model=16, n_heads=2,
                                               n_layers=2, d_ff=32, ffn="swiglu",
                                               norm="rmsnorm"), 2),
    ("transformer", "tiny3", TransformerConfig(vocab=16, seq_len=8, d_model=16, n_heads=2,
                                               n_layers=2, d_ff=32, recompute=True), 2),
    ("transformer", "tiny4", TransformerConfig(vocab=16, seq_len=8, d_model=16, n_heads=2,
                                               n_layers=2, d_ff=32, selective_recompute=True), 2),
]


TWIN_RTOL = 1e-4  # the PyTorch twin's first loss against dtlab's


def best_time(fn, reps: int, warmup: int) -> tuple[float, float]:
    """(best, median) seconds of `fn()` over `reps` runs after `warmup`."""
    times = alternate_times([fn], reps, warmup)[0]
    return min(times), statistics.median(times)


def matmul_shape(name: str, cfg, batch: int) -> tuple[int, int, int]:
    if name == "transformer":
        return batch * cfg.seq_len, cfg.d_model, cfg.d_ff
    return batch, cfg.d_hidden, cfg.d_hidden


def matmul_rate(m: int, k: int, n: int, reps: int, warmup: int) -> float:
    """GFLOP/s of a float32 (m, k) @ (k, n) on the process's array module."""
    xp = backend.xp()
    a = xp.asarray(np.random.default_rng(0).standard_normal((m, k)), dtype=np.float32)
    b = xp.asarray(np.random.default_rng(1).standard_normal((k, n)), dtype=np.float32)
    out = xp.empty((m, n), dtype=np.float32)
    best, _ = best_time(lambda: xp.matmul(a, b, out=out), reps, warmup)
    return 2 * m * k * n / best / 1e9


def make_batch(name: str, cfg, batch: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    if name == "transformer":
        return (rng.integers(0, cfg.vocab, size=(batch, cfg.seq_len)),
                rng.integers(0, cfg.vocab, size=(batch, cfg.seq_len)))
    return (rng.standard_normal((batch, cfg.d_in)).astype(np.float32),
            rng.integers(0, cfg.n_classes, size=batch))


def bench_one(name: str, size: str, cfg, batch: int, reps: int, warmup: int,
              torch_threads: int | None = None) -> tuple[dict, list[dict]]:
    """One size's row of the table "step" and, with `torch_threads`, against its PyTorch
    twin on that many threads, its rows of the table "layer"."""
    model = build_model(name, cfg)
    P = model.init_params(0)
    replica = Replica(model, P)
    optim = OptimConfig()
    opt = make_optimizer(optim, P.data, P.decay_mask())
    host_batch = make_batch(name, cfg, batch)
    data = model.prepare(host_batch, P)  # on the device once
    cost = estimate(name, cfg, batch, optimizer="adamw")

    first_loss, ctx = model.forward(P, data)
    measured = context_bytes(ctx)
    del ctx
    twin = None if torch_threads is None else model_torch.Twin(model, P, optim, torch_threads)
    twin_loss = twin.loss(*map(twin.torch.from_numpy, host_batch)).item() if twin else None
    losses = []

    def step():
        losses.append(replica.compute_grads([data]))
        opt.step(P.data, P.grad)

    m, k, n = matmul_shape(name, cfg, batch)
    mm_before = matmul_rate(m, k, n, reps, warmup)
    if twin is None:
        times = alternate_times([step], reps, warmup)
    else:
        inputs, targets = map(twin.torch.from_numpy, host_batch)
        times = alternate_times([step, lambda: twin.step(inputs, targets)], reps, warmup,
                                settle=True)
    best, median = min(times[0]), statistics.median(times[0])
    # the matmul's best before or after the step: a transient slowdown of the
    # baseline would otherwise flatter the ratio
    mm = max(mm_before, matmul_rate(m, k, n, reps, warmup))
    gflops = cost.flops_step / best / 1e9
    twin_off = twin is not None and not math.isclose(twin_loss, first_loss, rel_tol=TWIN_RTOL)
    wrong = (int(measured != cost.activation_bytes) + int(not all(map(math.isfinite, losses)))
             + int(twin_off))
    row = {
        "table": "step", "model": name, "size": size, **harness.flatten("config", cost.config),
        "batch_size": batch,
        "params": cost.params_total, "tokens_per_step": cost.tokens_per_step,
        "flops_step": cost.flops_step, "step_s_best": best, "step_s_median": median,
        "step_s_each": times[0],
        "gflops": gflops, "matmul_shape": [m, k, n], "matmul_gflops": mm,
        "ratio": gflops / mm, "act_bytes_measured": measured,
        "act_bytes_estimated": cost.activation_bytes, "loss": losses[-1], "wrong": wrong,
    }
    if twin is None:
        return row, []
    torch_median = statistics.median(times[1])
    row.update(torch_step_s_median=torch_median, torch_step_s_best=min(times[1]),
               torch_step_s_each=times[1],
               torch_over_dtlab=torch_median / median, first_loss=first_loss,
               torch_first_loss=twin_loss)
    return row, layer_rows(twin, P, host_batch, opt, reps, warmup, name, size)


def layer_rows(twin, P, host_batch, opt, reps: int, warmup: int, name: str,
               size: str) -> list[dict]:
    """Each layer of the model against its PyTorch kernels, alternately timed (medians)."""
    rows = []
    for label, count, shape, dtlab_fn, torch_fn in twin.layers(P, *host_batch, opt):
        dtlab_s, torch_s = map(statistics.median,
                               alternate_times([dtlab_fn, torch_fn], reps, warmup, settle=True))
        rows.append({"table": "layer", "model": name, "size": size, "layer": label,
                     "count": count, "input_shape": list(shape),
                     "dtlab_s": dtlab_s, "torch_s": torch_s, "torch_over_dtlab": torch_s / dtlab_s})
    return rows


TABLE = harness.Table(
    "tokens = per step; GFLOP = matmul GFLOP per step; mm = the same-run matmul's shape and "
    "rate; act MB = measured activation bytes kept for backward; est MB = models/cost.py's "
    "figure; #wrong = mismatched bytes, a non-finite loss or a PyTorch twin that computes "
    "another loss; torch: - where PyTorch does not run",
    [harness.Column("model", 11, lambda r: r["model"]),
     harness.Column("size", 11, lambda r: r["size"]),
     harness.Column("params", 10, lambda r: f"{r['params'] / 1e6:.2f}M"),
     harness.Column("tokens", 7, lambda r: r["tokens_per_step"]),
     harness.Column("step(ms)", 9, lambda r: r["step_s_median"] * 1e3, ".2f"),
     harness.Column("GFLOP", 8, lambda r: r["flops_step"] / 1e9, ".2f"),
     harness.Column("GFLOP/s", 8, lambda r: r["gflops"], ".1f"),
     harness.Column("mm shape", 16, lambda r: "x".join(map(str, r["matmul_shape"]))),
     harness.Column("mm GFLOP/s", 10, lambda r: r["matmul_gflops"], ".1f"),
     harness.Column("ratio", 6, lambda r: r["ratio"], ".2f"),
     harness.Column("act MB", 8, lambda r: r["act_bytes_measured"] / 1e6, ".2f"),
     harness.Column("est MB", 8, lambda r: r["act_bytes_estimated"] / 1e6, ".2f"),
     harness.Column("#wrong", 6, lambda r: r["wrong"]),
     harness.Column("torch(ms)", 9, lambda r: r["torch_step_s_median"] * 1e3
                    if "torch_step_s_median" in r else None, ".2f"),
     harness.Column("torch/dtlab", 11, lambda r: r.get("torch_over_dtlab"), ".2f")])
LAYER_TABLE = harness.Table(
    "x = times a step runs the layer; ms = median forward and backward at the step's shapes; "
    "the last line of a size: the layers' sum, each times its x",
    [harness.Column("model", 11, lambda r: r["model"]),
     harness.Column("size", 11, lambda r: r["size"]),
     harness.Column("layer", 24, lambda r: r["layer"], align="<"),
     harness.Column("x", 3, lambda r: r["count"]),
     harness.Column("input shape", 15, lambda r: r["input_shape"]),
     harness.Column("dtlab ms", 9, lambda r: r["dtlab_s"] * 1e3, ".3f"),
     harness.Column("torch ms", 9, lambda r: r["torch_s"] * 1e3, ".3f"),
     harness.Column("torch/dtlab", 11, lambda r: r["torch_s"] / r["dtlab_s"], ".2f")])


def layer_lines(r: dict, layers: list[dict]) -> list[str]:
    """The per-layer table of one step row, with the layers' sum (times their counts) last."""
    shown = [{"layer": x["layer"], "count": x["count"], "dtlab_s": x["dtlab_s"],
              "torch_s": x["torch_s"], "input_shape": "x".join(map(str, x["input_shape"]))}
             for x in layers]
    shown.append({"layer": "sum of layers x count", "count": None, "input_shape": None,
                  "dtlab_s": sum(x["count"] * x["dtlab_s"] for x in layers),
                  "torch_s": sum(x["count"] * x["torch_s"] for x in layers)})
    return [LAYER_TABLE.line({"model": r["model"], "size": r["size"], **x}) for x in shown]


def machine_header(bench: str, device: str, threads, **fields) -> dict:
    """The meta of a single-process model benchmark: the environment record, the device,
    the threads, then `fields`."""
    return {**harness.environment(bench), "device": device, "threads": threads.as_dict(),
            **fields}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    harness.common_flags(p, "tiny sizes, one rep: a smoke run")
    p.add_argument("--reps", type=int, default=None, help="timed steps per size (default 5)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 2)")
    p.add_argument("--no-torch", action="store_true",
                   help="leave out the PyTorch comparison even where PyTorch is installed")
    args = p.parse_args(argv)
    reps = args.reps if args.reps is not None else (1 if args.tiny else 5)
    warmup = args.warmup if args.warmup is not None else (0 if args.tiny else 2)
    if reps < 1 or warmup < 0:
        p.error("--reps must be at least 1 and --warmup not negative")

    started = start(p.prog)
    if started is None:
        return 2
    threads, device = started
    torch_version, why_not = torch_comparison(device, args.no_torch)
    header = machine_header("model", device, threads, reps=reps, warmup=warmup,
                            timing="median of reps (best kept too), steps alternating with "
                                   "PyTorch's where it runs", torch=torch_version)
    print(f"# dtlab model step benchmark on {header['device']} ({header['cpu']}): median of "
          f"{reps} after {warmup} warm-up, {threads.describe()}; {describe_blas(header['blas'])}")
    print("# GFLOP = dtlab.models.cost matmul FLOPs per step; ratio = GFLOP/s (from the best "
          "step) / same-run float32 matmul GFLOP/s")
    if torch_version:
        print(f"# PyTorch {torch_version} eager on {threads.threads} thread(s) placed as torch "
              "places them (its OpenMP threads unbound), steps taken in "
              f"turn with dtlab's, each timed after {SETTLE_S * 1e3:g} ms or more of untimed "
              "ones of its own: torch(ms) = its "
              "median step; torch/dtlab > 1: dtlab faster; a recomputed block runs its whole "
              "forward again in both (torch's checkpoint early stop off)")
    else:
        print(f"# {why_not}: no comparison with PyTorch, the matmul baseline only")
    print(TABLE.head())
    steps, layers = [], []
    for name, size, cfg, batch in TINY if args.tiny else SIZES:
        step, its_layers = bench_one(name, size, cfg, batch, reps, warmup,
                                     threads.threads if torch_version else None)
        steps.append(step)
        layers.append(its_layers)
        print(TABLE.line(step), flush=True)
    if torch_version:
        print(f"# per layer, forward and backward at the step's shapes (the loss and the "
              f"optimizer step alone), medians of {reps} taken in turn; x = times a step runs it")
        print(LAYER_TABLE.head())
        for r, its_layers in zip(steps, layers, strict=True):
            print("\n".join(layer_lines(r, its_layers)), flush=True)
    return finish(steps + [x for its_layers in layers for x in its_layers], header, args.json)


def torch_comparison(device: str, off: bool) -> tuple[str | None, str]:
    """(PyTorch's version, "") where the comparison runs, else (None, why not)."""
    if off:
        return None, "--no-torch"
    if device != "cpu":
        return None, f"on {device}"
    if not model_torch.available():
        return None, "PyTorch not installed"
    import torch

    return torch.__version__, ""


def finish(rows: list[dict], meta: dict, path: str) -> int:
    """The closing line (rows' #wrong summed), the JSON {meta, rows} at `path` if given;
    the exit status."""
    status = harness.closing(rows)
    if path:
        harness.save(path, meta, rows)
    return status


if __name__ == "__main__":
    sys.exit(main())
