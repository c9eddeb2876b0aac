"""A fair comparison: every method at its own best hyperparameters, over several seeds.

    dtlab-compare --tune lr=0.005,0.01,0.02 --seeds 3      # what the default does
    dtlab-compare --tune lr=0.01,0.03 --tune momentum=0.5,0.9 --optimizer sgd --seeds 2
    dtlab-compare --tune none --seeds 1                    # one run per method, as given
    dtlab-compare --runs sync-ring,async-diloco10 --tune lr=0.01,0.02 --tune outer_lr=0.35,0.7

A comparison of training methods is only as good as the tuning each got
(Shallue et al. 2019, "Measuring the effects of data parallelism on neural
network training"; Choi et al. 2019, "On empirical comparisons of
optimizers for deep learning"): ASP with W workers makes W times as many
updates as sync, each on 1/W of the batch, so one learning rate cannot
suit both. The protocol:

1. Tune. Every method runs at every point of the grid (the Cartesian
   product of the --tune values; default: the config's lr times 0.5, 1
   and 2) with the tuning seed (the config's --seed). The axes are numeric
   OptimConfig fields, and outer_lr / outer_momentum: the lr and momentum of
   the outer optimizer of every method that has one (local SGD's outer SGD,
   lr 1 momentum 0 = model averaging, as much as DiLoCo's Nesterov and the
   async servers' Delayed Nesterov), in place of its constant (registry.py).
   A method without an outer optimizer does not take those axes: it runs
   once per point of the other axes (OUT/tune/ITS-POINT/), not once per
   outer value, and its point names only those axes. Each run's record
   (summary.json what_ran, the report's "what ran") states the outer
   optimizer, lr and momentum its header says it ran; the protocol line
   names each tuned method's chosen outer lr (study_report.py).
2. Select. Each method's best point is chosen on the statistical measure:
   the fewest samples (steps of its global batch) to the target on the
   held-out loss, then the lowest final held-out loss; points that never
   reach it rank after those that do, by that loss. Time to the target
   breaks only exact ties, so two methods whose losses are identical (the
   same arithmetic over other collectives) choose the same point, not one
   decided by timing noise.
3. Evaluate. Each method runs at its best point with K fresh seeds (the
   tuning seed + 1 ... + K: initial weights and data order), so the figures
   reported are not the ones the choice was made on (no winner's curse).
   The report gives each figure's mean and its spread, min-max over the
   seeds, and how many seeds reached the target.

Held-out loss is on by default (every run evaluates the same held-out
examples every steps/20 steps); targets and "best" are judged on it.
With one grid point and one seed (--tune none --seeds 1) there is no
study: each method runs once, as configured, into OUT itself.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
from dataclasses import dataclass, field

from dtlab.lab.compare import registry
from dtlab.lab.compare.runner import RunSpec
from dtlab.models.config import ConfigError
from dtlab.models.optim import OptimConfig

DEFAULT_FACTORS = (0.5, 1.0, 2.0)  # of the config's lr: the default grid
OUTER_AXES = ("outer_lr", "outer_momentum")  # the outer optimizer's (RunSpec.outer_optimizer)


@dataclass(frozen=True)
class Grid:
    """Hyperparameter values to try: name -> values (OptimConfig fields and OUTER_AXES)."""

    axes: dict[str, tuple]

    def points(self) -> list[dict]:
        names = list(self.axes)
        return [dict(zip(names, values, strict=True))
                for values in itertools.product(*(self.axes[n] for n in names))]

    def describe(self) -> str:
        return "; ".join(f"{n} in {{{', '.join(f'{v:g}' for v in vs)}}}"
                         for n, vs in self.axes.items())


def parse_grid(given: list[str], optim: OptimConfig) -> Grid:
    """--tune NAME=V1,V2,... (repeatable); ["none"]: the config alone; []: the default,
    the config's lr times DEFAULT_FACTORS."""
    if not given:
        return Grid({"lr": tuple(round(optim.lr * f, 12) for f in DEFAULT_FACTORS)})
    if given == ["none"]:
        return Grid({})
    fields = {f.name: f for f in dataclasses.fields(OptimConfig)}
    axes: dict[str, tuple] = {}
    for item in given:
        name, sep, values = item.partition("=")
        name = name.strip().replace("-", "_")
        if not sep or not values.strip():
            raise ConfigError(f"--tune {item!r}: expected NAME=V1,V2,... (e.g. lr=0.005,0.01)")
        if name not in OUTER_AXES and (name not in fields
                                       or fields[name].type not in ("float", float)):
            numeric = sorted(n for n, f in fields.items() if f.type in ("float", float))
            raise ConfigError(f"--tune {item!r}: {name!r} is not a numeric optimizer setting "
                              f"(one of {', '.join(numeric + list(OUTER_AXES))})")
        if name in axes:
            raise ConfigError(f"--tune names {name} twice")
        try:
            vals = tuple(float(v) for v in values.split(","))
        except ValueError:
            raise ConfigError(f"--tune {item!r}: values must be numbers") from None
        if len(set(vals)) != len(vals):
            raise ConfigError(f"--tune {item!r}: a value is given twice")
        for v in vals:  # each point must be a valid config
            if name in OUTER_AXES:
                check_outer(item, name, v)
                continue
            try:
                dataclasses.replace(optim, **{name: v}).validate()
            except ConfigError as e:
                raise ConfigError(f"--tune {item!r}: {e}") from None
        axes[name] = vals
    return Grid(axes)


def check_outer(item: str, name: str, value: float) -> None:
    """An outer lr must be positive and finite, an outer momentum in [0, 1)."""
    if name == "outer_lr" and not (math.isfinite(value) and value > 0):
        raise ConfigError(f"--tune {item!r}: the outer lr must be positive (got {value:g})")
    if name == "outer_momentum" and not 0 <= value < 1:
        raise ConfigError(f"--tune {item!r}: the outer momentum must be in [0, 1) "
                          f"(got {value:g})")


def check_methods(grid: Grid, specs: list[RunSpec]) -> None:
    """Outer axes need a method with an outer optimizer, and a Nesterov one momentum > 0."""
    outer = [a for a in OUTER_AXES if a in grid.axes]
    if outer and not any(s.has_outer for s in specs):
        raise ConfigError(f"--tune {outer[0]}: none of --runs has an outer optimizer "
                          "(local SGD, DiLoCo, Streaming DiLoCo)")
    nesterov = [s.name for s in specs if s.has_outer and "nesterov" in s.outer_optimizer()[0]]
    if nesterov and 0 in grid.axes.get("outer_momentum", ()):
        raise ConfigError(f"--tune outer_momentum=0: the Nesterov outer optimizer of "
                          f"{', '.join(nesterov)} needs a momentum above 0")


def applicable(spec: RunSpec, point: dict) -> dict:
    """The part of a grid point `spec` takes: all of it, or without the outer axes for a
    method with no outer optimizer."""
    return point if spec.has_outer else {k: v for k, v in point.items()
                                         if k not in OUTER_AXES}


def inner(point: dict) -> dict:
    """A point's OptimConfig settings: what goes into the run's config."""
    return {k: v for k, v in point.items() if k not in OUTER_AXES}


def at_point(spec: RunSpec, point: dict) -> RunSpec:
    """`spec` with the point's outer lr / momentum, if it has an outer optimizer."""
    if not spec.has_outer:
        return spec
    return registry.with_outer(spec, point.get("outer_lr"), point.get("outer_momentum"))


def tuning_plan(specs: list[RunSpec], grid: Grid) -> list[tuple[dict, list[RunSpec]]]:
    """The tuning runs: per distinct applicable point (grid order), the methods that run
    there; a method without an outer optimizer runs each of its points once, however many
    outer values the grid has."""
    plan: dict[str, tuple[dict, list[RunSpec]]] = {}
    for point in grid.points():
        for spec in specs:
            mine = applicable(spec, point)
            group = plan.setdefault(label(mine), (mine, []))[1]
            if spec not in group:
                group.append(spec)
    return list(plan.values())


def label(point: dict) -> str:
    """A grid point as a folder name and a table cell: "lr=0.005,momentum=0.9"."""
    return ",".join(f"{k}={v:g}" for k, v in point.items()) or "as-configured"


@dataclass
class Trial:
    """One run of one method at one grid point with one seed."""

    spec: RunSpec
    point: dict
    seed: int
    stats: dict | None = None  # analysis.measure's, None when the run failed
    folder: str = ""  # relative to OUT
    what_ran: dict = field(default_factory=dict)

    def key(self) -> tuple[float, float, float]:
        """Selection order: steps (of the method's one global batch: samples) to the
        held-out target, then the final held-out loss, then time to the target (inf:
        not reached, not finite, or the run failed)."""
        s = self.stats
        if s is None:
            return math.inf, math.inf, math.inf
        steps, t = s.get("eval_steps_to_target"), held_time_to_target(s)
        final = s.get("final_eval_loss")
        return (math.inf if steps is None else steps,
                math.inf if final is None or not math.isfinite(final) else final,
                math.inf if t is None else t)


def held_time_to_target(stats: dict) -> float | None:
    """Seconds to the first held-out evaluation at or below the target: HE x steps, or
    that evaluation's own time where the workers do not move in step (compare/analysis.py,
    `eval_time_to_target_s`)."""
    k = stats.get("eval_steps_to_target")
    if k is None:
        return None
    own = stats.get("eval_time_to_target_s")
    return stats["s_per_step"] * k if own is None else own


def best_point(trials: list[Trial]) -> dict:
    """The grid point of the trial that ranks first (see Trial.key); ties: the grid order."""
    return min(trials, key=Trial.key).point


def spread(values: list[float]) -> dict | None:
    """Mean, min and max of the values (None when there are none)."""
    if not values:
        return None
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values),
            "n": len(values)}


def aggregate(trials: list[Trial], global_batch: int) -> dict:
    """One method's seeds at its best point: each figure's spread over the seeds that
    finished (time and samples to target: over the seeds that reached it)."""
    done = [t for t in trials if t.stats is not None]
    times = [held_time_to_target(t.stats) for t in done]
    reached = [x for x in times if x is not None]
    steps = [t.stats["eval_steps_to_target"] for t in done
             if t.stats["eval_steps_to_target"] is not None]
    return {
        "seeds": [t.seed for t in trials],
        "finished": len(done),
        "reached": len(reached),
        "time_to_target_s": spread(reached),
        "samples_to_target": spread([k * global_batch for k in steps]),
        "final_eval_loss": spread([t.stats["final_eval_loss"] for t in done
                                   if t.stats.get("final_eval_loss") is not None]),
        "final_loss": spread([t.stats["final_loss"] for t in done]),
        "s_per_step": spread([t.stats["s_per_step"] for t in done]),
    }
