"""Pipeline schedules as data: per-stage instruction lists, made before anything runs.

    ops = one_f_one_b(p=4, m=8)         # ops[s] = stage s's list of Op
    ops[3][:3] == [Op("F", 0), Op("B", 0), Op("W", 0)]
    timeline = simulate(ops)             # unit-time replay: idle slots, bubble

An Op names one pass of one micro-batch on one stage: F its forward, B its
input gradient (the backward pass through the stage that produces the
gradient the previous stage needs), W its weight gradient (the GEMMs
dL/dW = x^T dy, which nothing downstream waits for), BW both in one pass
(the classic backward: the gradient is sent after the weight gradients).
GPipe and 1F1B run BW; ZB-H1 splits it and moves W's into the gaps. The
executor (models/pipeline.py) runs the lists as given: a stage receives its
input before an F and its output gradient before a B or BW, so the lists
alone fix the communication.

- GPipe (Huang et al. 2019): every forward, then every backward. Up to m
  micro-batches in flight (activations held).
- 1F1B, PipeDream-Flush (Narayanan et al. 2021): stage s runs p - s - 1
  forwards, then alternates one forward and one backward, then drains. At
  most p - s in flight; the same bubble as GPipe.
- ZB-H1, zero bubble (Qi et al. 2024): 1F1B's order of F and B, each W run
  when the stage's next F or B cannot start yet (its input has not arrived),
  or first when s + 1 W's are pending on stage s. So at most p - s
  micro-batches wait for their B (1F1B's warm-up) and at most p for their W
  (1F1B's peak memory, that of stage 0).

With times t_F, t_B, t_W per pass, the same on every stage, each stage
idles (p - 1)(t_F + t_B + t_W) in GPipe and 1F1B, so

    bubble = idle / makespan = (p - 1) / (m + p - 1)

and (p - 1)(t_F + t_B - t_W) in ZB-H1 once m >= p (the paper's section
3.1): with t_F = t_B = t_W a third of 1F1B's idle time. `simulate` replays a
schedule under such times; tests/test_schedule.py holds every generator to
these formulas.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple


class Op(NamedTuple):
    kind: str  # "F", "B", "W" or "BW"
    micro: int


Schedule = list[list[Op]]  # Schedule[s]: stage s's ops in execution order
PASS_TIMES = {"F": ("F",), "B": ("B",), "W": ("W",), "BW": ("B", "W")}


def gpipe(p: int, m: int) -> Schedule:
    """All m forwards, then the backwards in reverse order (the last one's
    activations are the freshest)."""
    check_sizes(p, m)
    return [[Op("F", i) for i in range(m)] + [Op("BW", i) for i in reversed(range(m))]
            for _ in range(p)]


def one_f_one_b(p: int, m: int) -> Schedule:
    """PipeDream-Flush: warm up with p - s - 1 forwards, then one forward and
    one backward in turn, then the remaining backwards."""
    check_sizes(p, m)
    out = []
    for s in range(p):
        warmup = min(p - s - 1, m)
        ops = [Op("F", i) for i in range(warmup)]
        for i in range(m - warmup):
            ops += [Op("F", warmup + i), Op("BW", i)]
        ops += [Op("BW", i) for i in range(m - warmup, m)]
        out.append(ops)
    return out


def zb_h1(p: int, m: int) -> Schedule:
    """ZB-H1 by list scheduling with unit pass times: each stage runs 1F1B's F
    and B order; when its next F or B cannot start (input not yet arrived) it
    runs its oldest pending W instead, and it runs that W first once s + 1 are
    pending. The remaining W's close the list."""
    check_sizes(p, m)
    order = [[Op("B" if op.kind == "BW" else "F", op.micro) for op in stage]
             for stage in one_f_one_b(p, m)]
    ops: Schedule = [[] for _ in range(p)]
    end: dict[tuple[int, str, int], int] = {}  # (stage, "F" or "B", micro) -> unit time
    pos, n_b, n_w = [0] * p, [0] * p, [0] * p
    t = 0
    while any(n_w[s] < m for s in range(p)):
        for s in range(p):
            if ops[s] and end.get((s, *ops[s][-1]), t) > t:
                continue  # busy until its last op ends
            op = None
            if n_b[s] - n_w[s] <= s and pos[s] < m * 2 and \
                    _ready(order[s][pos[s]], s, p, t, end):
                op = order[s][pos[s]]
                pos[s] += 1
            elif n_w[s] < n_b[s]:
                op = Op("W", n_w[s])
            if op is None:
                continue
            ops[s].append(op)
            end[(s, *op)] = t + 1
            n_b[s] += op.kind == "B"
            n_w[s] += op.kind == "W"
        t += 1
    return ops


def _ready(op: Op, s: int, p: int, t: int, end: dict) -> bool:
    """Whether `op`'s input (F: the previous stage's F; B: the next stage's B, or
    on the last stage its own F) has arrived by unit time t."""
    if op.kind == "F":
        return s == 0 or end.get((s - 1, "F", op.micro), t + 1) <= t
    source = (s + 1, "B") if s < p - 1 else (s, "F")
    return end.get((*source, op.micro), t + 1) <= t


SCHEDULES: dict[str, Callable[[int, int], Schedule]] = {
    "gpipe": gpipe, "1f1b": one_f_one_b, "zb-h1": zb_h1}


def make(name: str, p: int, m: int) -> Schedule:
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; choose from {sorted(SCHEDULES)}")
    return SCHEDULES[name](p, m)


def check_sizes(p: int, m: int) -> None:
    if p < 1 or m < 1:
        raise ValueError(f"a pipeline needs p >= 1 stages and m >= 1 micro-batches "
                         f"(got p={p}, m={m})")


def bubble_formula(name: str, p: int, m: int, t_f: float = 1.0, t_b: float = 1.0,
                   t_w: float = 1.0) -> float:
    """The idle fraction of each stage's makespan under uniform pass times (ZB-H1's
    for m >= p)."""
    work = m * (t_f + t_b + t_w)
    idle = (p - 1) * ((t_f + t_b - t_w) if name == "zb-h1" else (t_f + t_b + t_w))
    return idle / (work + idle)


def in_flight(ops: list[Op], until: str = "B") -> int:
    """Most micro-batches between their F and their `until` pass ("B": input
    gradient, "W": weight gradient; a BW is both) in one stage's list."""
    open_, most = set(), 0
    for op in ops:
        if op.kind == "F":
            open_.add(op.micro)
            most = max(most, len(open_))
        elif until in PASS_TIMES[op.kind]:
            open_.discard(op.micro)
    return most


def validate(ops: Schedule, m: int) -> None:
    """ValueError naming the first broken rule: each stage runs the forward, the
    input gradient and the weight gradient of every micro-batch exactly once (BW
    counting as both), B after its F, W after its B, and every stage runs
    forwards and backwards in the same micro-batch order (what it sends is what
    its neighbour expects)."""
    orders = None
    for s, stage in enumerate(ops):
        seen: dict[str, list[int]] = {"F": [], "B": [], "W": []}
        for op in stage:
            if op.kind not in PASS_TIMES:
                raise ValueError(f"stage {s}: unknown op kind {op.kind!r}")
            for part in PASS_TIMES[op.kind]:
                before = {"F": None, "B": "F", "W": "B"}[part]
                if before and op.micro not in seen[before]:
                    raise ValueError(f"stage {s}: {op.kind}{op.micro} before "
                                     f"{before}{op.micro}")
                seen[part].append(op.micro)
        for kind, micros in seen.items():
            if sorted(micros) != list(range(m)):
                raise ValueError(f"stage {s}: {kind} passes {micros}, expected each of "
                                 f"0..{m - 1} once")
        if orders is None:
            orders = seen["F"], seen["B"]
        elif (seen["F"], seen["B"]) != orders:
            raise ValueError(f"stage {s}: micro-batch order differs from stage 0's")


@dataclass
class Timeline:
    """A replay of a schedule: when each stage ran what."""

    start: list[list[float]]  # start[s][k]: start of stage s's k-th op
    busy: list[float]
    makespan: float

    @property
    def idle(self) -> list[float]:
        return [self.makespan - b for b in self.busy]

    @property
    def bubble(self) -> float:
        """Mean over stages of idle / makespan."""
        return sum(self.idle) / (len(self.busy) * self.makespan)


def simulate(ops: Schedule, t_f: float = 1.0, t_b: float = 1.0, t_w: float = 1.0,
             stage_times: list[dict[str, float]] | None = None) -> Timeline:
    """Run the lists with fixed pass times and free communication: an op starts
    when its stage is free and its input has arrived (F: the previous stage's F
    of the micro-batch; B or BW: the input gradient from the next stage's B or BW,
    or on the last stage its own F; W: its own B). `stage_times[s]` ({"F", "B",
    "W"}: seconds) gives stage s its own times (measured ones), else all stages
    take t_f, t_b, t_w."""
    p = len(ops)
    times = stage_times or [{"F": t_f, "B": t_b, "W": t_w}] * p
    cost = [{kind: sum(times[s][x] for x in parts) for kind, parts in PASS_TIMES.items()}
            for s in range(p)]
    done: dict[tuple[int, str, int], float] = {}  # (stage, "F" / "B", micro) -> end
    start = [[0.0] * len(stage) for stage in ops]
    pos, free = [0] * p, [0.0] * p
    while any(pos[s] < len(ops[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            if pos[s] == len(ops[s]):
                continue
            kind, i = ops[s][pos[s]]
            if kind == "F":
                need = (s - 1, "F", i) if s > 0 else None
            elif kind == "W":
                need = (s, "B", i)
            else:
                need = (s + 1, "B", i) if s < p - 1 else (s, "F", i)
            if need is not None and need not in done:
                continue
            t0 = max(free[s], done[need] if need else 0.0)
            start[s][pos[s]], free[s] = t0, t0 + cost[s][kind]
            done[(s, "F" if kind == "F" else "B", i)] = free[s]
            pos[s] += 1
            progressed = True
        if not progressed:
            waiting = [f"stage {s}: {ops[s][pos[s]]}" for s in range(p) if pos[s] < len(ops[s])]
            raise ValueError("schedule deadlocks: " + "; ".join(waiting))
    busy = [sum(cost[s][op.kind] for op in stage) for s, stage in enumerate(ops)]
    return Timeline(start, busy, max(free))
