"""Layers into pipeline stages: contiguous runs of a model body's modules.

    costs = module_costs("transformer", config, batch=8)   # FLOPs per body module
    bounds = balance(costs, p=2)          # [0, b, n]: stage s runs modules [b_s, b_{s+1})
    bounds = explicit("3,2", n=5, p=2)    # --stages: modules per stage, as given
    bounds = balance(costs, p=4, name="--pp 2 x --virtual-stages 2")   # interleaved

A module's cost is the forward + backward FLOPs models/cost.py counts for it
(models/parts.py), so the estimate and the balance agree. `balance` picks the
contiguous split with the smallest largest stage (the bottleneck that sets a
pipeline's step time), by dynamic programming over (modules, stages):

    best[k][j] = min over i < j of max(best[k-1][i], cost[i:j])

The body of a transformer is [embedding, block_0 .. block_{L-1}, ln_f, head];
the loss runs on the last stage and is charged to it. A schedule with v model
chunks per rank (interleaved 1F1B, the V schedules: models/schedule.py) cuts the
body into v p stages, so `p` here counts stages, not ranks.
"""

from __future__ import annotations

from dtlab.models.config import ConfigError
from dtlab.models.parts import Part
from dtlab.models.schedule import chunks, make
from dtlab.models.zoo import MODELS


def module_parts(model_name: str, config, batch: int, n_modules: int) -> list[list[Part]]:
    """The Parts of each of the body's `n_modules` modules, in body order (the model's
    cost recipe lists them: models/parts.py)."""
    groups = MODELS[model_name].cost.modules(config, batch)
    if len(groups) != n_modules:
        raise ValueError(f"{model_name}: the cost recipe has {len(groups)} module groups, "
                         f"the body {n_modules} modules")
    return groups


def module_costs(model_name: str, config, batch: int, n_modules: int) -> list[int]:
    """Forward + backward (+ recompute) FLOPs of each body module for `batch` samples."""
    return [sum(p.count * (p.flops_forward + p.flops_backward + p.flops_recompute) for p in g)
            for g in module_parts(model_name, config, batch, n_modules)]


def balance(costs: list[float], p: int, name: str = "") -> list[int]:
    """Stage bounds [0, ..., len(costs)] minimising the costliest stage; every stage
    gets at least one module. `name`: the flags that asked for p stages (default
    "--pp p")."""
    n = len(costs)
    if p > n:
        raise ConfigError(f"{name or f'--pp {p}'} is more stages than the model's {n} layers")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(p + 1)]  # best[k][j]: modules [0, j) on k stages
    cut = [[0] * (n + 1) for _ in range(p + 1)]
    best[0][0] = 0.0
    for k in range(1, p + 1):
        for j in range(k, n + 1):
            for i in range(k - 1, j):
                worst = max(best[k - 1][i], prefix[j] - prefix[i])
                if worst < best[k][j]:
                    best[k][j], cut[k][j] = worst, i
    bounds = [n]
    for k in range(p, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    return bounds[::-1]


def explicit(spec: str, n: int, p: int, per: str = "--pp stage") -> list[int]:
    """Bounds from --stages "a,b,...": a modules on stage 0, b on stage 1, ... (`per`:
    what one count is for, in the message)."""
    try:
        counts = [int(x) for x in spec.split(",")]
    except ValueError:
        raise ConfigError(f"--stages {spec!r}: expected comma-separated module counts") from None
    if len(counts) != p or min(counts) < 1 or sum(counts) != n:
        raise ConfigError(f"--stages {spec!r}: needs {p} positive counts (one per {per}) "
                          f"summing to the model's {n} modules")
    bounds = [0]
    for c in counts:
        bounds.append(bounds[-1] + c)
    return bounds


def pipeline_bounds(model_name: str, config, batch: int, n_modules: int, p: int,
                    schedule: str, v: int | None = None, stages: str = "") -> list[int]:
    """The bounds of every stage of schedule `schedule` on p ranks (v p stages with v
    chunks per rank: models/schedule.py's `chunks`): --stages as given, else balanced
    by the cost model's FLOPs per module."""
    try:
        n_stages = p * chunks(schedule, v)
    except ValueError as e:
        raise ConfigError(f"--pp-schedule {schedule} --virtual-stages {v}: {e}") from None
    per = "--pp stage" if n_stages == p else f"virtual stage: --pp {p} x {n_stages // p}"
    if stages:
        return explicit(stages, n_modules, n_stages, per)
    name = "" if n_stages == p else f"--pp {p} x {n_stages // p} chunks = {n_stages}"
    return balance(module_costs(model_name, config, batch, n_modules), n_stages, name)


def check_pipeline(p: int, m: int, schedule: str, v: int | None,
                   m_flag: str = "--grad-accum") -> None:
    """ConfigError naming the flag a pipeline of p ranks, m micro-batches (`m_flag`)
    and `schedule` with v chunks per rank (--virtual-stages) cannot honour."""
    if v is not None and p == 1:
        raise ConfigError(f"--virtual-stages {v} has no effect without --pp")
    try:
        n = chunks(schedule, v)
    except ValueError as e:
        raise ConfigError(f"--virtual-stages {v}: {e}") from None
    if schedule == "interleaved" and n > 1 and m % p:
        raise ConfigError(f"--pp-schedule interleaved runs micro-batches in groups of --pp "
                          f"{p}: {m_flag} {m} is not a multiple of {p}")
    if p > 1:
        try:
            make(schedule, p, m, v)
        except ValueError as e:
            raise ConfigError(f"--pp-schedule {schedule} --pp {p} {m_flag} {m}: "
                              f"{e}") from None
