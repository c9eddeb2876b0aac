"""Benchmark JSON made from known constants, as dtlab-simulate --calibrate reads it
(bench_allreduce, bench_pserver, bench_model): the calibration must recover the constants
(tests/lab/test_simulate.py), and the validations predict with them (support/emulated_runs.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from dtlab.lab.simulate.formulas import terms


def synthetic_bench(tmp: Path) -> list[str]:
    """bench_allreduce, bench_pserver and bench_model JSON made from known constants on a host
    of this one's cores."""
    alpha, beta = 20e-6, 1 / 5e9
    rows = []
    for n in (2, 3, 4):
        for size in (1 << 20, 4 << 20, 16 << 20):
            for algo, via in (("ring", "ring"), ("naive", None)):
                a, b, c = terms("naive" if algo == "naive" else "ring", n)
                # ranks beyond the host's cores take turns on them (calibration_fit.fit_allreduce)
                t = max(1.0, n / (os.cpu_count() or 1)) * (a * alpha + (b + c) * size * beta)
                rows.append({"algo": algo, "n": n, "bytes": size, "time_us": t * 1e6,
                             "via": via})
    (tmp / "ar.json").write_text(json.dumps({"meta": {"bench": "allreduce", "n": 4},
                                             "rows": rows}))
    ps = [{"mode": "rounds", "path": path, "bytes": b, "pull_ms": 1e3 * (3e-4 + b / 2e9),
           "push_ms": 1e3 * (4e-4 + b / 1e9)} for b in (1 << 16, 1 << 20, 1 << 24)
          for path in ("shm", "session")]
    # paths timed by the whole round only, as bench_pserver writes them: half the round
    # each way
    ps += [{"mode": "rounds", "path": path, "bytes": b, "pull_ms": None, "push_ms": None,
            "round_ms": 1e3 * (6e-4 + b / 5e8)} for b in (1 << 16, 1 << 20)
           for path in ("fused", "bf16")]
    ps += [{"op": "push", "bytes": 1 << 20, "shards": 2, "optimizer": o,
            "apply_ms": 1e3 * (1 << 19) * g} for o, g in (("sgd", 1e-10), ("adam", 3e-10))]
    # bench_fanout's rows: hot ones (gap 0, left out of the fit) and cold ones
    ps += [{"mode": "fanout", "path": "shm", "bytes": b, "shards": s, "gap_ms": gap,
            "round_ms": 1e3 * (5e-4 + (s - 1) * 2e-4 + b / 4e9) * (1 if gap else 0.5),
            "client_cpu_ms": 1e3 * (4e-4 + (s - 1) * 3e-4 + b / 8e9),
            "server_cpu_ms": 1e3 * (2e-4 + (s - 1) * 1e-4 + b / 8e9)}
           for b in (1 << 16, 1 << 20) for s in (1, 2) for gap in (0.0, 5.0)]
    # rows measured beside co-runners are not fitted: these would spoil the fit if they were
    ps += [{**r, "round_ms": 10 * r["round_ms"], "co_runners": 1} for r in ps[-8:]]
    (tmp / "ps.json").write_text(json.dumps({"meta": {"bench": "pserver"}, "rows": ps}))
    model = [{"table": "step", "model": "transformer", "config.d": k, "batch_size": 4,
              "flops_step": f, "step_s_median": 2e-3 + f / 50e9}
             for k, f in enumerate((1e8, 1e9, 1e10))]
    (tmp / "model.json").write_text(json.dumps({"meta": {"bench": "model",
                                                         "threads": {"threads": 1}},
                                                "rows": model}))
    return [str(tmp / f) for f in ("ar.json", "ps.json", "model.json")]
