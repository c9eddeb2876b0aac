"""Predictions from 1 to 1024 ranks or workers: one row per N, every topology (the
parameter server in lock-step, BSP: its pulls wait for the slowest push) and, with
--zero, the ZeRO stages asked for (simulate/zero.py), with --methods local SGD, DiLoCo and
compression (simulate/methods.py), or one dp x pp x ep x tp layout
(simulate/parallel.py)."""

from __future__ import annotations

import math
from dataclasses import replace

from dtlab.lab.simulate.formulas import Network, ServerLink
from dtlab.lab.simulate.parallel import Layout, Work, parallel_step
from dtlab.lab.simulate.step import ComputeRate, Host, Workload, ps_step, sync_step
from dtlab.lab.simulate.zero import ZeroSpec, zero_columns

DEFAULT_WORKERS = tuple(2 ** k for k in range(11))  # 1 .. 1024


def rows(w: Workload, workers: list[int], net: Network, ps: ServerLink, shards: int,
         rate_at, host: Host, bucket_bytes: float, zero: ZeroSpec | None = None,
         extra=None, kinds: tuple[str, ...] | None = None) -> list[dict]:
    """rate_at(threads) -> ComputeRate; one dict per N (steps as dicts); with `zero`, its
    stages' steps and every stage's memory per rank (zero.zero_columns); with `extra`,
    extra(N, compute_s, straggler_s) -> more entries (methods.method_columns); `kinds`:
    which of ring, naive and ps to predict (default all three)."""
    kinds = kinds or ("ring", "naive", "ps")
    out = []
    for n in workers:
        rate: ComputeRate = rate_at(host.threads(n))
        compute = rate.seconds(w.flops_step) * host.share(n)
        late = rate.straggler_s(n) * host.share(n)
        steps = {"ring": sync_step("ring", w, n, net, compute, bucket_bytes, host, late)}
        if "naive" in kinds:
            steps["naive"] = sync_step("naive", w, n, net, compute, bucket_bytes, host, late)
        if "ps" in kinds:
            steps["ps"] = ps_step(w, n, shards, ps, rate.seconds(w.flops_step), host,
                                  rate.straggler_s(n))
        row = {"n": n, "nodes": math.ceil(n / net.gpus_per_node), "compute_s": compute,
               "compute_source": rate.source}
        for name, s in steps.items():
            row[name] = {"comm_s": s.comm_s, "step_s": s.step_s, "algo": s.algo, **s.parts}
        # compute / step: weak-scaling efficiency, the step at N = 1 being compute alone
        row["efficiency"] = compute / steps["ring"].step_s
        if zero is not None:
            row.update(zero_columns(zero, w.optimizer, n, net, compute, host, late))
        if extra is not None:
            row.update(extra(n, compute, late))
        out.append(row)
    return out


def parallel_rows(work: Work, layout: Layout, workers: list[int], fabric_at, rate_at,
                  host: Host, bucket_bytes: float) -> list[dict]:
    """One row per N of `workers` that is a multiple of the layout's pp ep tp (dp = N /
    (pp ep tp)); fabric_at(N) -> Fabric, rate_at(threads) -> ComputeRate."""
    out = []
    for n in workers:
        if n % layout.model_parallel:
            continue
        at = replace(layout, dp=n // layout.model_parallel)
        rate: ComputeRate = rate_at(host.threads(n))
        # a fit: F / R a micro-batch, t0 once a step; a measured step: all of it per FLOP
        s_per_flop = (rate.seconds(work.flops_microbatch) - rate.overhead_s) \
            / work.flops_microbatch
        fabric = fabric_at(n)
        row = parallel_step(work, at, fabric, s_per_flop, host, bucket_bytes,
                            rate.straggler_s(n) * host.share(n), rate.overhead_s)
        row.update(n=n, nodes=math.ceil(n / fabric.net.gpus_per_node),
                   compute_source=rate.source, efficiency=row["compute_s"] / row["step_s"])
        out.append(row)
    return out
