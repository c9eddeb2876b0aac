"""Mixture-of-Experts layer benchmark: step time against a dense FFN of the same active
parameters, the four phases' latencies, and load balancing on a skewed input.

    dtlab-bench moe --json bench-moe.json      # ~2 min on 2 cores
    dtlab-bench moe --tiny                     # seconds; run by the test suite
    dtlab-bench moe --only-ep --ep-ranks 2 4 --ep-bytes 1000000 4000000

Timing rows: one layer step (zero grads, forward, backward) of the MoE layer (models/moe.py:
N experts of hidden d_ff, top-k, dropless so that every token uses k experts) and of the
dense FFN of the same kind with hidden k d_ff (the same active expert parameters; the MoE
adds its d x N router), on n token rows in the same run, the two taking turns step by step
(a slowdown from other processes falls on both), median of --reps after --warmup:

    ratio = MoE step / dense step            floor: at most 1.5 for top-2 of 8 experts

with the MoE forward's phases (router, dispatch, expert compute, combine) as p50/p95/p99 over
the timed steps (models/moe_stats.py). Balance rows: top-2 of 8 experts on an input that
favours two experts, the router alone trained by its balancing term for --balance-steps
(none / Switch aux loss with SGD / bias nudging); load imbalance = max/mean of the pairs
per expert, at the first step and the mean of the last tenth of the steps. #wrong counts
non-finite outputs and a balancing method that does not lower the imbalance; it makes the
exit status 1.

Expert-parallel rows (dtlab.lab.bench.moe_ep, one mpiexec launch per --ep-ranks n): our
all-to-all(v) as the MoE layers call it (every pairwise exchange posted at once), our
step-by-step pairwise exchange, and MPI's Alltoallv on the same buffers of B bytes per
rank, taking turns,
the slowest rank's time, median of --reps; bus bandwidth as nccl-tests defines it for
all-to-all, busbw = (B / t) (n - 1) / n:

    ratio = our busbw / MPI's busbw          floor: at least 0.9 at B >= 1 MB, n = 2 and 4

and one expert-parallel MoE layer step over the n ranks with each exchange, without and
with --ep-chunks overlap chunks (models/moe_ep.py): overlap speedup = step with 1 chunk /
step with k. #wrong counts all-to-all results that differ from the blocks sent and layer
outputs that differ between the four variants.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from dtlab.lab.bench import harness
from dtlab.lab.bench.harness import alternate_times, start
from dtlab.lab.bench.model import finish, machine_header
from dtlab.models import backend
from dtlab.models.moe import MoE, expert_ffn
from dtlab.models.moe_stats import PHASES, MoEStats
from dtlab.models.params import FlatParams
from dtlab.models.router import RouterOptions
from dtlab.models.run.launcher_env import mpiexec_path

QUANTILES = ("p50", "p95", "p99")  # of each phase's time (moe_stats.MoEStats.summary)
FLOOR = 1.5  # MoE top-2 of 8 step / dense FFN step of equal active parameters
EP_FLOOR = 0.9  # our all-to-all busbw / MPI Alltoallv busbw, at >= EP_FLOOR_BYTES per rank
EP_FLOOR_BYTES = 1_000_000
# (kind, d, d_ff per expert, experts, top_k, token rows)
SIZES = [("gelu", 128, 256, 8, 2, 4096), ("swiglu", 128, 256, 8, 2, 4096),
         ("gelu", 256, 512, 8, 2, 4096), ("swiglu", 256, 512, 8, 2, 4096)]
TINY = [("gelu", 16, 32, 4, 2, 64), ("swiglu", 16, 32, 8, 2, 64)]
METHODS = {"none": {}, "aux": {"aux_coef": 1.0}, "bias": {"bias_rate": 0.005}}


def layer_step(layer, P, x, dy, outputs):
    def step():
        P.zero_grad()
        y, ctx = layer.forward(P, x)
        layer.backward(P, ctx, dy)
        outputs.append(y)
        del outputs[:-1]
    return step


def bench_layer(kind, d, d_ff, N, k, n, reps, warmup) -> dict:
    xp = backend.xp()
    rng = np.random.default_rng(0)
    x = xp.asarray(rng.standard_normal((n, d)), dtype=np.float32)
    dy = xp.asarray(rng.standard_normal((n, d)), dtype=np.float32)
    moe = MoE("moe", d, d_ff, RouterOptions(N, top_k=k), kind=kind, capacity_factor=None)
    dense = expert_ffn(kind, "dense", d, k * d_ff)
    Pm, Pd = FlatParams(moe.specs(), seed=0), FlatParams(dense.specs(), seed=0)
    outs_m, outs_d = [], []
    moe_step = layer_step(moe, Pm, x, dy, outs_m)
    dense_step = layer_step(dense, Pd, x, dy, outs_d)
    alternate_times([moe_step, dense_step], 0, warmup)
    moe.stats = stats = MoEStats()  # the timed steps only
    moe_t, dense_t = alternate_times([moe_step, dense_step], reps, 0)
    moe_s, dense_s = statistics.median(moe_t), statistics.median(dense_t)
    summary = stats.summary()
    finite = all(bool(xp.isfinite(o).all()) for o in outs_m + outs_d)
    expert_params = sum(s.size for s in moe.specs() if s.name.startswith("moe.e0."))
    return {"table": "layer", "kind": kind, "d": d, "d_ff": d_ff, "experts": N, "top_k": k,
            "rows": n,
            "active_expert_params": k * expert_params, "dense_params": Pd.size,
            "moe_step_s": moe_s, "dense_step_s": dense_s, "ratio": moe_s / dense_s,
            "floor": FLOOR if (N, k) == (8, 2) else None,
            **{f"{p}_{q}_s": summary[f"{p}_s"][q] for p in PHASES for q in QUANTILES},
            "imbalance": summary["imbalance"], "wrong": int(not finite)}


def bench_balance(method: str, d: int, n: int, steps: int) -> dict:
    """Top-2 of 8; the router favours experts 0 and 1; only the balancing term trains it."""
    xp = backend.xp()
    stats = MoEStats()
    moe = MoE("moe", d, 8, RouterOptions(8, top_k=2, **METHODS[method]), capacity_factor=1.25,
              stats=stats)
    P = FlatParams(moe.specs(), seed=0)
    W = np.random.default_rng(0).normal(0, 0.3, (d, 8))
    W[:, :2] += 2.4 / d  # the input's mean is 0.5: experts 0 and 1 get +1.2 logits
    P["moe.router.W"][...] = xp.asarray(W, dtype=np.float32)
    x = xp.asarray(np.random.default_rng(1).standard_normal((n, d)) * 0.5 + 0.5,
                   dtype=np.float32)
    zero = xp.zeros_like(x)
    imbalance, dropped = [], []
    for _ in range(steps):
        P.zero_grad()
        _, ctx = moe.forward(P, x)
        imbalance.append(stats.last["imbalance"])
        dropped.append(stats.last["dropped_pairs"])
        moe.backward(P, ctx, zero)
        P["moe.router.W"][...] -= 0.5 * P.grads["moe.router.W"]
    tail = max(1, steps // 10)  # the bias method ends in a small cycle: average its steps
    last, last_dropped = statistics.mean(imbalance[-tail:]), statistics.mean(dropped[-tail:])
    return {"table": "balance", "method": method, "d": d, "rows": n, "steps": steps,
            "imbalance_first": imbalance[0], "imbalance_last": last,
            "dropped_first": dropped[0], "dropped_last": last_dropped,
            "wrong": int(method != "none" and not last < imbalance[0])}


def floor_word(r: dict) -> str:
    return "-" if r["floor"] is None else ("ok" if r["ratio"] <= r["floor"] else "over")


def phase_ms(phase: str):
    """A row's p50/p95/p99 of `phase` in ms, as one cell."""
    return lambda r: "/".join(f"{r[f'{phase}_{q}_s'] * 1e3:.2f}" for q in QUANTILES)


TABLE = harness.Table(
    "step = zero grads + forward + backward of one layer on `rows` tokens; MoE dropless; "
    "phases = the MoE forward's router / dispatch / expert compute / combine, p50/p95/p99 "
    "over the timed steps; #wrong = non-finite outputs",
    [harness.Column("kind", 6, lambda r: r["kind"]), harness.Column("d", 4, lambda r: r["d"]),
     harness.Column("d_ff", 5, lambda r: r["d_ff"]),
     harness.Column("N", 3, lambda r: r["experts"]), harness.Column("k", 2, lambda r: r["top_k"]),
     harness.Column("rows", 6, lambda r: r["rows"]),
     harness.Column("MoE ms", 8, lambda r: r["moe_step_s"] * 1e3, ".2f"),
     harness.Column("dense ms", 9, lambda r: r["dense_step_s"] * 1e3, ".2f"),
     harness.Column("ratio", 6, lambda r: r["ratio"], ".2f"),
     harness.Column("floor", 6, floor_word),
     *(harness.Column(f"{p} p50/95/99 ms", 25, phase_ms(p)) for p in PHASES),
     harness.Column("#wrong", 6, lambda r: r["wrong"])])


def run_ep(ranks: int, nbytes: list[int], layer: tuple[int, int, int], chunks: int, reps: int,
           warmup: int) -> list[dict]:
    """dtlab.lab.bench.moe_ep on `ranks` ranks: its rows."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ep.json"
        cmd = [mpiexec_path(), "-n", str(ranks), sys.executable,
               "-m", "dtlab.lab.bench.moe_ep", "--json", str(out),
               "--bytes", *map(str, nbytes), "--reps", str(reps), "--warmup", str(warmup),
               "--layer", *map(str, layer), "--chunks", str(chunks)]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stderr[-3000:]}")
        return harness.read(out)[1]


def ep_floor_word(r: dict) -> str:
    return "-" if r["bytes"] < EP_FLOOR_BYTES else ("ok" if r["ratio"] >= EP_FLOOR else "under")


EP_TABLE = harness.Table(
    "us = median time of one all-to-all; busbw = all-to-all bytes per rank / time x (n-1)/n; "
    "ours/MPI = the busbw ratio; floor: - below its size",
    [harness.Column("ranks", 5, lambda r: r["ranks"]),
     harness.Column("bytes", 10, lambda r: r["bytes"]),
     harness.Column("ours us", 9, lambda r: r["ours_s"] * 1e6, ".1f"),
     harness.Column("busbw GB/s", 11, lambda r: r["ours_busbw"], ".3f"),
     harness.Column("pairwise us", 12, lambda r: r["pairwise_s"] * 1e6, ".1f"),
     harness.Column("busbw GB/s", 11, lambda r: r["pairwise_busbw"], ".3f"),
     harness.Column("MPI us", 9, lambda r: r["mpi_s"] * 1e6, ".1f"),
     harness.Column("busbw GB/s", 11, lambda r: r["mpi_busbw"], ".3f"),
     harness.Column("ours/MPI", 9, lambda r: r["ratio"], ".2f"),
     harness.Column("floor", 6, ep_floor_word),
     harness.Column("#wrong", 6, lambda r: r["wrong"])])
LAYER_TABLE = harness.Table(
    "N experts, k chunks; 1 / k ms = one step with 1 chunk / k chunks, speedup = their "
    "ratio, by ours / MPI's all-to-all",
    [harness.Column("ranks", 5, lambda r: r["ranks"]), harness.Column("d", 4, lambda r: r["d"]),
     harness.Column("d_ff", 5, lambda r: r["d_ff"]),
     harness.Column("N", 3, lambda r: r["experts"]),
     harness.Column("rows", 6, lambda r: r["rows"]),
     harness.Column("k", 2, lambda r: r["chunks"]),
     harness.Column("ours 1 ms", 10, lambda r: r["ours_chunks1_s"] * 1e3, ".2f"),
     harness.Column("ours k ms", 10, lambda r: r["ours_chunksk_s"] * 1e3, ".2f"),
     harness.Column("speedup", 8, lambda r: r["overlap_speedup_ours"], ".2f"),
     harness.Column("MPI 1 ms", 9, lambda r: r["mpi_chunks1_s"] * 1e3, ".2f"),
     harness.Column("MPI k ms", 9, lambda r: r["mpi_chunksk_s"] * 1e3, ".2f"),
     harness.Column("speedup", 8, lambda r: r["overlap_speedup_mpi"], ".2f"),
     harness.Column("#wrong", 6, lambda r: r["wrong"])])
BALANCE_TABLE = harness.Table(
    "imbalance = max/mean pairs per expert, dropped = pairs over capacity, first step and "
    "last (mean of the last tenth); #wrong = a method that does not lower the imbalance",
    [harness.Column("method", 7, lambda r: r["method"]),
     harness.Column("imbalance first", 16, lambda r: r["imbalance_first"], ".2f"),
     harness.Column("last", 6, lambda r: r["imbalance_last"], ".2f"),
     harness.Column("dropped first", 14, lambda r: r["dropped_first"], ".0f"),
     harness.Column("last", 6, lambda r: r["dropped_last"], ".0f"),
     harness.Column("#wrong", 6, lambda r: r["wrong"])])


def bench_ep(args, reps: int, warmup: int) -> tuple[list, list]:
    ranks = args.ep_ranks or [2, 4]
    nbytes = args.ep_bytes or ([65536] if args.tiny else [1_000_000, 4_000_000, 16_000_000])
    layer = (16, 32, 64) if args.tiny else (128, 256, 2048)
    print(f"\n# expert parallelism: all-to-all(v) of B bytes per rank (B/n to each rank), ours "
          f"(as the MoE layers call it: every pairwise exchange posted at once, one wait), our "
          f"step-by-step pairwise exchange and MPI's Alltoallv taking turns, slowest rank, "
          f"median of "
          f"{reps} after {warmup}; busbw = B/t (n-1)/n (nccl-tests); floor: ours/MPI >= "
          f"{EP_FLOOR} at B >= {EP_FLOOR_BYTES:,} bytes; #wrong = results that differ from the "
          "blocks sent")
    print(EP_TABLE.head())
    a2a, layers = [], []
    for n in ranks:
        got = run_ep(n, nbytes, layer, args.ep_chunks, reps, warmup)
        for r in harness.tables(got, "alltoall"):
            a2a.append(r)
            print(EP_TABLE.line(r), flush=True)
        layers += harness.tables(got, "ep_layer")
    print("\n# expert-parallel MoE layer step (zero grads, forward, backward) over n ranks: "
          "dropless top-2 of 2n experts, `rows` tokens per rank; ours / MPI's all-to-all, 1 "
          "chunk and k chunks (one chunk's all-to-all overlapping another's experts); speedup "
          "= 1 chunk / k chunks; #wrong = outputs that differ between the four")
    print(LAYER_TABLE.head())
    for r in layers:
        print(LAYER_TABLE.line(r), flush=True)
    return a2a, layers


def single_process_rows(args, reps: int, warmup: int, steps: int) -> tuple[list, list]:
    """The timing rows and the balance rows (one process)."""
    print(TABLE.head())
    rows = []
    for kind, d, d_ff, N, k, n in TINY if args.tiny else SIZES:
        rows.append(bench_layer(kind, d, d_ff, N, k, n, reps, warmup))
        print(TABLE.line(rows[-1]), flush=True)
    d, n = (16, 256) if args.tiny else (128, 4096)
    print(f"\n# balance: top-2 of 8 experts, capacity factor 1.25, {n} rows of width {d} "
          f"favouring experts 0 and 1; the router trained {steps} steps by the balancing "
          "term alone; imbalance = max/mean pairs per expert, last = mean of the last tenth of "
          "the steps; dropped = pairs over capacity; "
          "#wrong = a method that does not lower the imbalance")
    print(BALANCE_TABLE.head())
    balance = []
    for method in METHODS:
        b = bench_balance(method, d, n, steps)
        balance.append(b)
        print(BALANCE_TABLE.line(b), flush=True)
    return rows, balance


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    harness.common_flags(p, "tiny sizes, few reps: a smoke run")
    p.add_argument("--reps", type=int, default=None, help="timed steps per size (default 10)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3)")
    p.add_argument("--balance-steps", type=int, default=None,
                   help="router steps of the balance rows (default 100)")
    p.add_argument("--ep-ranks", type=int, nargs="+", default=None,
                   help="rank counts of the expert-parallel rows (default 2 4)")
    p.add_argument("--ep-bytes", type=int, nargs="+", default=None,
                   help="all-to-all bytes per rank (default 1e6 4e6 16e6; --tiny 65536)")
    p.add_argument("--ep-chunks", type=int, default=4, help="overlap chunks of the layer rows")
    p.add_argument("--only-ep", action="store_true", help="the expert-parallel rows only")
    args = p.parse_args(argv)
    reps = args.reps if args.reps is not None else (3 if args.tiny else 10)
    warmup = args.warmup if args.warmup is not None else (1 if args.tiny else 3)
    steps = args.balance_steps if args.balance_steps is not None else (30 if args.tiny else 100)
    if reps < 1 or warmup < 0 or steps < 2:
        p.error("--reps must be at least 1, --warmup not negative, --balance-steps at least 2")
    if args.ep_chunks < 2 or any(n < 2 for n in args.ep_ranks or []) or \
            any(b < 4 for b in args.ep_bytes or []):
        p.error("--ep-chunks and --ep-ranks must be at least 2, --ep-bytes at least 4")

    started = start(p.prog)
    if started is None:
        return 2
    threads, device = started
    header = machine_header("moe", device, threads, reps=reps, warmup=warmup,
                            timing="median of reps", floor=FLOOR, ep_floor=EP_FLOOR,
                            ep_floor_bytes=EP_FLOOR_BYTES, mpi=harness.mpi_library())
    print(f"# dtlab MoE layer benchmark on {device}: median of {reps} after {warmup} warm-up, "
          f"{threads.describe()}; ratio = MoE step / dense FFN step (hidden k d_ff: the "
          f"same active expert parameters); floor: ratio <= {FLOOR} for top-2 of 8")
    rows, balance = ([], []) if args.only_ep else single_process_rows(args, reps, warmup, steps)
    a2a, layers = bench_ep(args, reps, warmup)
    under = [r for r in a2a if r["bytes"] >= EP_FLOOR_BYTES and r["ratio"] < EP_FLOOR]
    if under and not args.tiny:
        print(f"# {len(under)} all-to-all row(s) under the floor in this launch (the floor "
              "holds on the median of several launches)")
    over = [r for r in rows if r["floor"] is not None and r["ratio"] > r["floor"]]
    if over and not args.tiny:
        print(f"# {len(over)} row(s) over the floor in this launch (the floor holds on the "
              "median of several launches)")
    return finish(rows + balance + a2a + layers, header, args.json)


if __name__ == "__main__":
    sys.exit(main())
