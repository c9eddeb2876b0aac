"""Pipeline schedules as data: per-rank instruction lists, made before anything runs.

    ops = one_f_one_b(p=4, m=8)         # ops[r] = rank r's list of Op
    ops[3][:3] == [Op("F", 0), Op("B", 0), Op("W", 0)]
    timeline = simulate(ops)             # unit-time replay: idle slots, bubble

An Op names one pass of one micro-batch on one model chunk of a rank: F its
forward, B its input gradient (the backward pass through the chunk that
produces the gradient the previous stage needs), W its weight gradient (the
GEMMs dL/dW = x^T dy, which nothing downstream waits for), BW both in one pass
(the classic backward: the gradient is sent after the weight gradients).
GPipe and 1F1B run BW; ZB-H1 splits it and moves W's into the gaps. The
executor (models/pipeline.py) runs the lists as given: a stage receives its
input before an F and its output gradient before a B or BW, so the lists
alone fix the communication.

The model is cut into S = v p contiguous stages (virtual stages); each of the p
ranks holds v of them, its model chunks 0..v-1, and `Op.chunk` says which one
a pass runs. Where chunk c of rank r sits in the model is the layout's:

    loop (GPipe, 1F1B, ZB-H1: v = 1; interleaved: v >= 1)   stage = c p + r
    v    (two chunks in a V)   chunk 0: stage r,  chunk 1: stage 2p - 1 - r

- GPipe (Huang et al. 2019): every forward, then every backward. Up to m
  micro-batches in flight (activations held).
- 1F1B, PipeDream-Flush (Narayanan et al. 2021): stage s runs p - s - 1
  forwards, then alternates one forward and one backward, then drains. At
  most p - s in flight; the same bubble as GPipe. PipeDream-2BW runs it across
  steps without the flush (models/pipedream.py `steady_state`).
- Interleaved 1F1B (Narayanan et al. 2021, section 2.2.2): v chunks per rank
  in the loop layout; micro-batches go through in groups of p, each group
  through chunk 0, then chunk 1, ... (backwards: the chunks in reverse); rank r
  warms up with (p - r - 1) + (v - 1) p forwards, then alternates. Needs
  m a multiple of p (as the paper's). v = 1 is 1F1B.
- ZB-V (Qi et al. 2024, section 6): two chunks a rank in a V, B and W split,
  built as PyTorch's ScheduleZBVZeroBubble builds it (`zb_v`). At most 2p
  chunk contexts in flight: p stages' worth, 1F1B's peak.
- DualPipeV (DeepSeek-AI 2024, the V-shaped cut of DualPipe): two chunks a rank
  in a V, a forward of one chunk paired with a backward of the other in the
  steady state (run one after the other here: no overlap on a CPU), B and W
  split at the ends (`dualpipe_v`). Needs m >= 2p; 2p + 1 contexts in flight.
- ZB-H1, zero bubble (Qi et al. 2024): 1F1B's order of F and B, each W run
  when the stage's next F or B cannot start yet (its input has not arrived),
  or first when s + 1 W's are pending on stage s. So at most p - s
  micro-batches wait for their B (1F1B's warm-up) and at most p for their W
  (1F1B's peak memory, that of stage 0).

With times t_F, t_B, t_W per pass of one chunk, the same on every stage, each
rank idles (p - 1)(t_F + t_B + t_W) in GPipe, 1F1B and interleaved 1F1B, so

    bubble = idle / makespan = (p - 1) / (v m + p - 1)

(idle / work = (p - 1) / (v m): the interleaved schedule's bubble is 1/v of
1F1B's), and (p - 1)(t_F + t_B - t_W) in ZB-H1 once m >= p (the paper's section
3.1): with t_F = t_B = t_W a third of 1F1B's idle time. With t_F = t_B = t_W =
t and m >= 2p the V schedules' lists idle, from a common start to the last
rank's end (as the executor measures):

    ZB-V       2(p - 1) t   ZB-H1's idle, in passes of half a stage. Qi et al.'s
                            "zero bubble" counts each stage from its own first to
                            its own last pass, the next step overlapping (their
                            optimizer post-validation): not this measure.
    DualPipeV  (p - 1) t    DeepSeek's (PP/2 - 1)(F&B + B - 3W) with PP = 2p
                            stages, B = 2t (a full backward), W = t, F&B = 2t (the
                            forward hidden under the backward it is paired with)

`simulate` replays a schedule under such times; tests/models/test_schedule.py
holds every generator to these formulas.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple


class Op(NamedTuple):
    kind: str  # "F", "B", "W" or "BW"
    micro: int
    chunk: int = 0  # which of the rank's model chunks (its virtual stages) runs it


PASS_TIMES = {"F": ("F",), "B": ("B",), "W": ("W",), "BW": ("B", "W")}
LAYOUTS = ("loop", "v")


class Schedule(list):
    """Schedule[r]: rank r's ops in execution order; `layout` places its chunks."""

    def __init__(self, ranks=(), layout: str = "loop"):
        super().__init__(ranks)
        self.layout = layout


def layout_of(ops) -> str:
    """The layout `ops` carries (a Schedule), else "loop" (plain lists)."""
    return getattr(ops, "layout", "loop")


def virtual_stage(layout: str, p: int, rank: int, chunk: int) -> int:
    """The model stage that chunk `chunk` of rank `rank` holds (module docstring)."""
    if layout == "v":
        return rank if chunk == 0 else 2 * p - 1 - rank
    return chunk * p + rank


def gpipe(p: int, m: int) -> Schedule:
    """All m forwards, then the backwards in reverse order (the last one's
    activations are the freshest)."""
    check_sizes(p, m)
    return Schedule([[Op("F", i) for i in range(m)] + [Op("BW", i) for i in reversed(range(m))]
                     for _ in range(p)])


def one_f_one_b(p: int, m: int) -> Schedule:
    """PipeDream-Flush: warm up with p - s - 1 forwards, then one forward and
    one backward in turn, then the remaining backwards."""
    return interleaved(p, m, 1)


def interleaved(p: int, m: int, v: int = 2) -> Schedule:
    """Interleaved 1F1B over v chunks per rank (loop layout): the forwards in
    groups of p micro-batches, each group through chunks 0..v-1 in turn, the
    backwards in the same groups through chunks v-1..0; rank r warms up with
    (p - r - 1) + (v - 1) p forwards, then alternates F and BW, then drains."""
    check_sizes(p, m)
    if v < 1:
        raise ValueError(f"interleaved 1F1B needs v >= 1 chunks per rank (got v={v})")
    if v > 1 and m % p:
        raise ValueError(f"interleaved 1F1B runs micro-batches in groups of p: m={m} is "
                         f"not a multiple of p={p}")
    group = p if v > 1 else m  # v = 1: one group, 1F1B

    def order(kind: str, reverse: bool) -> list[Op]:
        chunks = range(v - 1, -1, -1) if reverse else range(v)
        return [Op(kind, g + k, c) for g in range(0, m, group) for c in chunks
                for k in range(group)]

    forwards, backwards = order("F", False), order("BW", True)
    out = Schedule()
    for r in range(p):
        warmup = min(p - r - 1 + (v - 1) * p, m * v)
        ops = forwards[:warmup]
        for f, b in zip(forwards[warmup:], backwards, strict=False):
            ops += [f, b]
        out.append(ops + backwards[m * v - warmup:])
    return out


def zb_h1(p: int, m: int) -> Schedule:
    """ZB-H1 by list scheduling with unit pass times: each stage runs 1F1B's F
    and B order; when its next F or B cannot start (input not yet arrived) it
    runs its oldest pending W instead, and it runs that W first once s + 1 are
    pending. The remaining W's close the list."""
    check_sizes(p, m)
    order = [[Op("B" if op.kind == "BW" else "F", op.micro) for op in stage]
             for stage in one_f_one_b(p, m)]
    ops = Schedule([[] for _ in range(p)])
    end: dict[tuple[int, str, int], int] = {}  # (stage, "F" or "B", micro) -> unit time
    pos, n_b, n_w = [0] * p, [0] * p, [0] * p
    t = 0
    while any(n_w[s] < m for s in range(p)):
        for s in range(p):
            if ops[s] and end.get((s, *ops[s][-1][:2]), t) > t:
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
            end[(s, op.kind, op.micro)] = t + 1
            n_b[s] += op.kind == "B"
            n_w[s] += op.kind == "W"
        t += 1
    return ops


class _RankOps:
    """One rank's list as it is written: the next micro-batch of each pass on each
    chunk, and the W's that wait behind split B's (oldest first)."""

    def __init__(self):
        self.ops: list[Op] = []
        self.next: dict[tuple[str, int], int] = {}  # ("F" / "B", chunk) -> micro-batch
        self.waiting: list[tuple[int, int]] = []  # (micro, chunk) of B's without their W

    def add(self, kind: str, c: int) -> None:
        """The next F, B or BW of chunk c (a B queues its W)."""
        key = ("F" if kind == "F" else "B", c)
        i = self.next.get(key, 0)
        self.next[key] = i + 1
        self.ops.append(Op(kind, i, c))
        if kind == "B":
            self.waiting.append((i, c))

    def weight(self, c: int | None = None) -> None:
        """The oldest waiting W (of chunk c, if given), if any."""
        for k, (i, chunk) in enumerate(self.waiting):
            if c is None or chunk == c:
                del self.waiting[k]
                self.ops.append(Op("W", i, chunk))
                return

    def count(self, kind: str, c: int) -> int:
        return self.next.get((kind, c), 0)


def zb_v(p: int, m: int) -> Schedule:
    """ZB-V (Qi et al. 2024, section 6) in a V of 2 chunks a rank, the construction of
    PyTorch's ScheduleZBVZeroBubble: with n = max(m, 2p - 1) micro-batches (those past
    m dropped at the end), rank r runs 2(p - r) - 1 forwards of chunk 0; r pairs of
    forwards (chunk 1, chunk 0); p - r triples F B W on chunk 1; then, while chunk 1
    lags, [F on chunk 0 while any is left] B W on chunk 0, F B W on chunk 1; then r
    pairs of B (chunk 0, chunk 1), p - r pairs (B, W) on chunk 0, and the W's left,
    chunk 1's first."""
    check_sizes(p, m)
    n = max(m, 2 * p - 1)
    out = Schedule(layout="v")
    for r in range(p):
        rank = _RankOps()
        for _ in range(2 * (p - r) - 1):
            rank.add("F", 0)
        for _ in range(r):
            rank.add("F", 1), rank.add("F", 0)
        for _ in range(p - r):
            rank.add("F", 1), rank.add("B", 1), rank.weight(1)
        while rank.count("F", 1) < rank.count("F", 0) or rank.count("F", 0) < n:
            if rank.count("F", 0) < n:
                rank.add("F", 0)
            rank.add("B", 0), rank.weight(0)
            rank.add("F", 1), rank.add("B", 1), rank.weight(1)
        for _ in range(r):
            rank.add("B", 0), rank.add("B", 1)
        for _ in range(p - r):
            rank.add("B", 0), rank.weight(0)
        while rank.waiting:
            rank.weight(1 if any(c == 1 for _, c in rank.waiting) else 0)
        out.append([op for op in rank.ops if op.micro < m])
    return out


def dualpipe_v(p: int, m: int) -> Schedule:
    """DualPipeV (DeepSeek-AI 2024, DualPipe cut in half: one V of 2 chunks a rank),
    its eight steps as DeepSeek's DualPipe repository (its dualpipev module) and PyTorch's
    ScheduleDualPipeV take them, with each overlapped forward-and-backward pair run as its
    F, then its BW:

        1  2(p - r - 1) x F0             5  (p - r - 1) x BW1, F1 BW0
        2  (r + 1) x F0 F1               6  (r + 1) x B1 B0 (BW before the middle)
        3  (p - r - 1) x B1 W F1         7  (p - r - 1) x W B0
        4  (m - 2p + r + 1) x F0 BW1, F1 BW0     8  (r + 1) x W

    (Fc: forward on chunk c; B: input gradient, its W queued and run, oldest first,
    where a W is named). Needs m >= 2p."""
    check_sizes(p, m)
    if m < 2 * p:
        raise ValueError(f"DualPipeV needs at least 2p = {2 * p} micro-batches (got m={m})")
    out = Schedule(layout="v")
    for r in range(p):
        rank = _RankOps()
        for _ in range(2 * (p - r - 1)):
            rank.add("F", 0)
        for _ in range(r + 1):
            rank.add("F", 0), rank.add("F", 1)
        for _ in range(p - r - 1):
            rank.add("B", 1), rank.weight(), rank.add("F", 1)
        for _ in range(m - 2 * p + r + 1):
            rank.add("F", 0), rank.add("BW", 1), rank.add("F", 1), rank.add("BW", 0)
        for _ in range(p - r - 1):
            rank.add("BW", 1), rank.add("F", 1), rank.add("BW", 0)
        split = False
        for i in range(r + 1):
            split = split or (i == (r + 1) // 2 and r % 2 == 1)
            rank.add("B" if split else "BW", 1)
            split = split or (i == (r + 1) // 2 and r % 2 == 0)
            rank.add("B" if split else "BW", 0)
        for _ in range(p - r - 1):
            rank.weight(), rank.add("B" if split else "BW", 0)
        for _ in range(r + 1):
            rank.weight()
        out.append(rank.ops)
    return out


def _ready(op: Op, s: int, p: int, t: int, end: dict) -> bool:
    """Whether `op`'s input (F: the previous stage's F; B: the next stage's B, or
    on the last stage its own F) has arrived by unit time t."""
    if op.kind == "F":
        return s == 0 or end.get((s - 1, "F", op.micro), t + 1) <= t
    source = (s + 1, "B") if s < p - 1 else (s, "F")
    return end.get((*source, op.micro), t + 1) <= t


SCHEDULES: dict[str, Callable[..., Schedule]] = {
    "gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved, "zb-h1": zb_h1,
    "zb-v": zb_v, "dualpipev": dualpipe_v}
CHUNKED = {"interleaved"}  # the schedules that take v (--virtual-stages)
LAYOUT = {"zb-v": "v", "dualpipev": "v"}  # schedule -> layout where not "loop"


def layout(name: str) -> str:
    return LAYOUT.get(name, "loop")


def chunks(name: str, v: int | None = None) -> int:
    """Model chunks per rank of schedule `name`: v for the interleaved one (default 2),
    2 for a V, else 1; ValueError for a v the schedule cannot take."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown pipeline schedule {name!r}; choose from {sorted(SCHEDULES)}")
    if name in CHUNKED:
        if v is not None and v < 1:
            raise ValueError(f"{name}: needs at least 1 virtual stage per rank (got {v})")
        return 2 if v is None else v
    fixed = 2 if layout(name) == "v" else 1
    if v is not None and v != fixed:
        raise ValueError(f"{name} runs {fixed} model chunk(s) per rank, not {v} virtual stages")
    return fixed


def make(name: str, p: int, m: int, v: int | None = None) -> Schedule:
    """Schedule `name` for p ranks and m micro-batches (v: chunks per rank, where the
    schedule takes it)."""
    n = chunks(name, v)
    return SCHEDULES[name](p, m, n) if name in CHUNKED else SCHEDULES[name](p, m)


def check_sizes(p: int, m: int) -> None:
    if p < 1 or m < 1:
        raise ValueError(f"a pipeline needs p >= 1 stages and m >= 1 micro-batches "
                         f"(got p={p}, m={m})")


def bubble_formula(name: str, p: int, m: int, t_f: float = 1.0, t_b: float = 1.0,
                   t_w: float = 1.0, v: int | None = None) -> float:
    """The idle fraction of each rank's makespan under uniform pass times of one chunk
    (ZB-H1's for m >= p; the V schedules' for t_F = t_B = t_W only, m >= 2p: module
    docstring)."""
    work = chunks(name, v) * m * (t_f + t_b + t_w)
    if name in LAYOUT:
        if not t_f == t_b == t_w:
            raise ValueError(f"{name}: the bubble formula is given for t_F = t_B = t_W")
        idle = (p - 1) * t_f * (2 if name == "zb-v" else 1)
    else:
        idle = (p - 1) * ((t_f + t_b - t_w) if name == "zb-h1" else (t_f + t_b + t_w))
    return idle / (work + idle)


def in_flight(ops: list[Op], until: str = "B") -> int:
    """Most micro-batch chunks between their F and their `until` pass ("B": input
    gradient, "W": weight gradient; a BW is both) in one rank's list."""
    open_, most = set(), 0
    for op in ops:
        if op.kind == "F":
            open_.add((op.micro, op.chunk))
            most = max(most, len(open_))
        elif until in PASS_TIMES[op.kind]:
            open_.discard((op.micro, op.chunk))
    return most


def validate(ops: Schedule, m: int, layout: str | None = None) -> None:
    """ValueError naming the first broken rule: every rank holds the same number of
    chunks; each chunk runs the forward, the input gradient and the weight gradient
    of every micro-batch exactly once (BW counting as both), B after its F, W after
    its B, and every stage runs forwards and backwards in the same micro-batch
    order (what it sends is what its neighbour expects). `layout`: the one `ops`
    carries unless given."""
    layout = layout or layout_of(ops)
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; choose from {LAYOUTS}")
    v = 1 + max((op.chunk for stage in ops for op in stage), default=0)
    if layout == "v" and v != 2:
        raise ValueError(f"a V layout holds 2 chunks per rank, these ops name {v}")
    orders = None
    for s, stage in enumerate(ops):
        seen = {c: {"F": [], "B": [], "W": []} for c in range(v)}
        for op in stage:
            if op.kind not in PASS_TIMES:
                raise ValueError(f"stage {s}: unknown op kind {op.kind!r}")
            if not 0 <= op.chunk < v:
                raise ValueError(f"stage {s}: {op} names chunk {op.chunk}")
            where = f"stage {s}" + (f" chunk {op.chunk}" if v > 1 else "")
            for part in PASS_TIMES[op.kind]:
                before = {"F": None, "B": "F", "W": "B"}[part]
                if before and op.micro not in seen[op.chunk][before]:
                    raise ValueError(f"{where}: {op.kind}{op.micro} before "
                                     f"{before}{op.micro}")
                seen[op.chunk][part].append(op.micro)
        for c in range(v):
            where = f"stage {s}" + (f" chunk {c}" if v > 1 else "")
            for kind, micros in seen[c].items():
                if sorted(micros) != list(range(m)):
                    raise ValueError(f"{where}: {kind} passes {micros}, expected each of "
                                     f"0..{m - 1} once")
            if orders is None:
                orders = seen[c]["F"], seen[c]["B"]
            elif (seen[c]["F"], seen[c]["B"]) != orders:
                raise ValueError(f"{where}: micro-batch order differs from stage 0's")


@dataclass
class Timeline:
    """A replay of a schedule: when each rank ran what."""

    start: list[list[float]]  # start[r][k]: start of rank r's k-th op
    busy: list[float]
    makespan: float

    @property
    def idle(self) -> list[float]:
        return [self.makespan - b for b in self.busy]

    @property
    def bubble(self) -> float:
        """Mean over ranks of idle / makespan."""
        return sum(self.idle) / (len(self.busy) * self.makespan)


def simulate(ops: Schedule, t_f: float = 1.0, t_b: float = 1.0, t_w: float = 1.0,
             stage_times: list[dict[str, float]] | None = None,
             layout: str | None = None) -> Timeline:
    """Run the lists with fixed pass times and free communication: an op starts
    when its rank is free and its input has arrived (F: the previous stage's F
    of the micro-batch; B or BW: the input gradient from the next stage's B or BW,
    or on the last stage its own F; W: its own B). Stages are the model's
    virtual stages (`layout`, by default the one `ops` carries; `virtual_stage`);
    `stage_times[g]` ({"F", "B", "W"}: seconds) gives stage g its own times (measured
    ones), else all stages take t_f, t_b, t_w."""
    layout = layout or layout_of(ops)
    p = len(ops)
    v = 1 + max((op.chunk for stage in ops for op in stage), default=0)
    S = v * p
    times = stage_times or [{"F": t_f, "B": t_b, "W": t_w}] * S
    if len(times) != S:
        raise ValueError(f"{len(times)} stage times for a schedule of {S} stages")
    cost = [{kind: sum(times[g][x] for x in parts) for kind, parts in PASS_TIMES.items()}
            for g in range(S)]
    where = [[virtual_stage(layout, p, r, c) for c in range(v)] for r in range(p)]
    done: dict[tuple[int, str, int], float] = {}  # (stage, "F" / "B", micro) -> end
    start = [[0.0] * len(stage) for stage in ops]
    pos, free = [0] * p, [0.0] * p
    while any(pos[r] < len(ops[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            if pos[r] == len(ops[r]):
                continue
            kind, i, c = ops[r][pos[r]]
            g = where[r][c]
            if kind == "F":
                need = (g - 1, "F", i) if g > 0 else None
            elif kind == "W":
                need = (g, "B", i)
            else:
                need = (g + 1, "B", i) if g < S - 1 else (g, "F", i)
            if need is not None and need not in done:
                continue
            t0 = max(free[r], done[need] if need else 0.0)
            start[r][pos[r]], free[r] = t0, t0 + cost[g][kind]
            done[(g, "F" if kind == "F" else "B", i)] = free[r]
            pos[r] += 1
            progressed = True
        if not progressed:
            waiting = [f"stage {r}: {ops[r][pos[r]]}" for r in range(p) if pos[r] < len(ops[r])]
            raise ValueError("schedule deadlocks: " + "; ".join(waiting))
    busy = [sum(cost[where[r][op.chunk]][op.kind] for op in stage)
            for r, stage in enumerate(ops)]
    return Timeline(start, busy, max(free))
