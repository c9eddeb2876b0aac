"""Predictions from 1 to 1024 ranks or workers: one row per N, every topology (the
parameter server in lock-step, BSP: its pulls wait for the slowest push)."""

from __future__ import annotations

import math

from simulate_lib.formulas import Network, ServerLink
from simulate_lib.step import ComputeRate, Host, Workload, ps_step, sync_step

DEFAULT_WORKERS = tuple(2 ** k for k in range(11))  # 1 .. 1024


def rows(w: Workload, workers: list[int], net: Network, ps: ServerLink, shards: int,
         rate_at, host: Host, bucket_bytes: float) -> list[dict]:
    """rate_at(threads) -> ComputeRate; one dict per N (steps as dicts)."""
    out = []
    for n in workers:
        rate: ComputeRate = rate_at(host.threads(n))
        compute = rate.seconds(w.flops_step) * host.share(n)
        late = rate.straggler_s(n) * host.share(n)
        steps = {"ring": sync_step("ring", w, n, net, compute, bucket_bytes, host, late),
                 "naive": sync_step("naive", w, n, net, compute, bucket_bytes, host, late),
                 "ps": ps_step(w, n, shards, ps, rate.seconds(w.flops_step), host,
                               rate.straggler_s(n))}
        row = {"n": n, "nodes": math.ceil(n / net.gpus_per_node), "compute_s": compute,
               "compute_source": rate.source}
        for name, s in steps.items():
            row[name] = {"comm_s": s.comm_s, "step_s": s.step_s, "algo": s.algo, **s.parts}
        # compute / step: weak-scaling efficiency, the step at N = 1 being compute alone
        row["efficiency"] = compute / steps["ring"].step_s
        out.append(row)
    return out
