"""PipeDream's weight versions on a pipeline stage: PipeDream-Flush, PipeDream-2BW and
weight stashing, as update semantics and as a cross-step schedule.

    dtlab-sync --pp 2 --grad-accum 4 --pipedream 2bw --clip 0  # W_{t+1} = W_t - lr g(W_{t-1})
    dtlab-sync --pp 2 --grad-accum 4 --pipedream 2bw --clip 0 --pipedream-window 8
    dtlab-sync --pp 2 --grad-accum 4 --pipedream flush   # 1F1B, flushed every step
    dtlab-sync --pp 4 --grad-accum 1 --pipedream stash   # PipeDream (2019), weight stashing

Narayanan et al. 2021, "Memory-Efficient Pipeline-Parallel DNN Training" (ICML):

- PipeDream-Flush: 1F1B (models/schedule.py `one_f_one_b`) with a flush at the end of
  every step, so every gradient is computed on the weights it updates. It is dtlab's
  1F1B run; `flush` adds only the records below (staleness 0, no extra version).
- PipeDream-2BW: 1F1B without flushes. A stage makes a new weight version every m
  micro-batches (one step) and keeps two (double-buffered weights): step t's
  micro-batches all run forward and backward on W_{t-1}, and the update applies that
  gradient to the newest version,

      W_{t+1} = W_t - lr grad f(W_{t-1})                (the paper's section 3.1)

  (with Adam or momentum: the optimizer's step t on W_t with the gradient computed on
  W_{t-1}). The first step's gradient is computed on W_0 (W_{-1} := W_0): the
  staleness of update t is min(t, 1).
- Weight stashing (PipeDream, Narayanan et al. 2019, SOSP): an update after every
  micro-batch (--grad-accum 1), no flush, each micro-batch's backward on the weights
  its forward used, no vertical sync: stage s of p (from 0) computes on the version
  d_s = p - 1 - s updates back, grad f(W_1^(t-p+1), ..., W_p^(t)) in the paper's words,
  and holds d_s extra versions.

dtlab-sync runs 2BW's steps K at a time as one list without flushes (`WindowedReplica`,
`WindowExchange`, below), and stash and flush (and 2BW with --pipedream-window 1) step
by step (`WeightVersions`, `VersionedReplica`): before the step's schedule runs, the
stage's buffer is swapped with its oldest kept version, so forward and backward read
W_{t-d}; after it, W_t is put back and the version ring turns, so the trainer's
optimizer steps W_t with the gradient of W_{t-d}. The extra memory is d copies of the
stage's parameters (2BW: one), recorded in the metrics ("staleness" per stage each
update, "weight_version_bytes"). Such a step still ends in a flush: its time is
PipeDream-Flush's plus the swap.

The time side (`steady_state`, `live_versions`, `bubble_2bw`, `TwoBufferedWindow`):
without the flush the next step's forwards need not wait for this step's backwards, so
K steps of 2BW run as one 1F1B list over K m micro-batches, each stage updating after
its backward of micro-batch j m + m - 1 (a local event: no stage waits for another's
update). `TwoBufferedWindow` runs that list on the pipeline's executor with two weight
buffers, ending on the step-by-step run's parameters bit for bit. Under uniform pass
times the K steps idle (p - 1)(t_F + t_B + t_W) once, at start-up, where the flushed
schedule idles that every step:

    bubble over K steps = (p - 1) / (K m + p - 1)  ->  0 as K grows
    PipeDream-Flush     = (p - 1) / (m + p - 1)     every step

Two weight versions suffice when every forward of step t + 1 on stage s comes after
the update that made W_t, i.e. after stage s's last backward of step t - 1: in 1F1B's
order that is m >= p - s - 1 for every s, so m >= p - 1 (`live_versions` checks it on
the list; the paper asks m >= p).

The windows under dtlab-sync's one loop (models/run/loop.py), which steps one step at a
time and writes one record per step:

- Chunks. The run's steps are cut into windows of K = --pipedream-window steps (0, the
  default: from one --eval-every evaluation to the next, at most what one list can tag,
  models/pipeline.py MAX_MESSAGES); a window also ends at every evaluation and at the
  last step, so the held-out loss is taken where the weights are settled (W_t in the
  parameters). `WindowedReplica.compute_grads` keeps each step's micro-batches and
  returns 0.0 until the window's last step, where the window runs; the trainer's own
  optimizer step is off (`WindowExchange.optimizer_here` False: each stage steps its
  optimizer inside the list, at the scheduled lr of the step, after the data-parallel
  reducer's wait has averaged the step's gradient over the stage's replicas: with --dp
  the update waits for those replicas, which run the same list, and for no other stage).
  Chunks rather than one list continued across the trainer's steps: a stage's share of
  step t's list runs forwards of step t + 1, whose micro-batches the loop has not read
  yet, and the trainer's step meets the whole pipeline each time (the gradient norm's
  all-reduce, the loss's broadcast), which is the flush again.
- Settled records. `WindowExchange.settled` holds the window's records (as local SGD
  holds a round's, collective/reducers/local_sgd.py) and hands them to the loop when the
  window has run, each with its step's loss (averaged over the replicas), its
  reduction's fields (comm_s, wait_s, ...), its global gradient norm (each stage's
  squares at its update, summed over the pipeline after the list), `elapsed_s` the time
  this rank made the step's update (rank 0: stage 0, the last stage to finish a step),
  `step_s` the time since the step before, the window's measured bubble and overhead,
  its per-step share of the pipeline's seconds, bytes and messages, `pipedream_window`
  K and `bubble_replay` (the list replayed with unit pass times, models/schedule.py
  simulate: (p - 1)/(K m + p - 1); VersionedReplica records a flushed step's).
- Continuation. A window from step t0 > 0 starts from the two live versions: the
  parameters hold W_{t0}, the second buffer W_{t0-1} (W_{-1} := W_0, copied at the first
  window, after the initial broadcast); version v lives in buffer (v - t0) mod 2, and
  after an odd K the two buffers' contents are swapped so that the parameters hold the
  newest again. So the windows end on the step-by-step run's parameters and losses bit
  for bit, whatever K.
- Refused by name (ConfigError, both flags): --clip > 0 (a stage updates alone, no global
  norm to clip to), with --clip 0 or --pipedream-window 1 as the way out; MoE layers
  (--moe-experts: the router's noise follows the count of backwards, which a window
  interleaves otherwise, and its statistics are recorded per step), with
  --pipedream-window 1; a window longer than one list can tag; --precision other than
  fp32, as for every 2BW run. A signal that stops the run inside a window ends it after
  the last window that ran; the steps kept since are not run.
"""

from __future__ import annotations

import copy
import math
import time
from collections import deque
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from dtlab.models.config import ConfigError, build, choice, described
from dtlab.models.model import Model
from dtlab.models.pipeline import MAX_MESSAGES
from dtlab.models.schedule import Schedule, one_f_one_b, simulate, validate

MODES = ("off", "flush", "2bw", "stash")
SWAP_BLOCK = 1 << 18  # elements swapped at a time: no full-size temporary


@dataclass
class PipeDreamConfig:
    """--pipedream, and the run's other choices it must agree with (filled from the
    setup by the program, not flags)."""

    pipedream: str = choice("off", *MODES, help=(
        "asynchronous pipeline updates with --pp (models/pipedream.py): flush (1F1B, "
        "PipeDream-Flush, staleness 0 recorded), 2bw (PipeDream-2BW: each step's gradient "
        "on the previous weight version, applied to the current one; one extra copy of a "
        "stage's parameters), stash (PipeDream's weight stashing: stage s of p computes on "
        "the version p - 1 - s updates back; --grad-accum 1)"))
    pipedream_window: int = described(0, (
        "with --pipedream 2bw: run the steps K at a time as one 1F1B list without flushes "
        "(a window also ends at each --eval-every evaluation); 0: from one evaluation to "
        "the next; 1: step by step, each step flushed"), metavar="K")
    pp: int = 1
    pp_schedule: str = "1f1b"
    grad_accum: int = 1
    zero: int = 0
    precision: str = "fp32"
    checkpoint_every: int = 0
    resume: bool = False
    moe_bias_rate: float = 0.0
    moe_experts: int = 0
    clip: float = 0.0

    @property
    def windowed(self) -> bool:
        """2BW's steps run as windows without flushes (not step by step)."""
        return self.pipedream == "2bw" and self.pipedream_window != 1

    def window_steps(self, eval_every: int, steps: int) -> int:
        """K: --pipedream-window, or (0) the steps from one evaluation to the next, at
        most what one list can tag (models/pipeline.py MAX_MESSAGES)."""
        most = MAX_MESSAGES // (self.grad_accum * self.pp)
        return self.pipedream_window or max(1, min(eval_every or steps, most))

    def validate(self) -> None:
        """ConfigError naming the flag that --pipedream cannot combine with."""
        mode, K = self.pipedream, self.pipedream_window
        if K < 0:
            raise ConfigError(f"--pipedream-window must not be negative (got {K})")
        if K and mode != "2bw":
            raise ConfigError(f"--pipedream-window {K} runs PipeDream-2BW's steps as one "
                              f"list: not with --pipedream {mode}")
        if mode == "off":
            return
        flag = f"--pipedream {mode}"
        if self.pp < 2:
            raise ConfigError(f"{flag} needs a pipeline: give --pp 2 or more")
        if self.pp_schedule != "1f1b":
            raise ConfigError(f"{flag} runs PipeDream's 1F1B: not with --pp-schedule "
                              f"{self.pp_schedule}")
        if self.zero:
            raise ConfigError(f"{flag} with --zero {self.zero}: the weight versions are a "
                              "stage's whole buffer, which ZeRO holds in slices over dp")
        if mode == "flush":
            return  # no past versions: the 1F1B run as it is
        if self.precision != "fp32":
            raise ConfigError(f"{flag} with --precision {self.precision}: the versions of a "
                              "half working copy and its float32 master are not built")
        if self.checkpoint_every or self.resume:
            what = "--resume" if self.resume else f"--checkpoint-every {self.checkpoint_every}"
            raise ConfigError(f"{flag} with {what}: a checkpoint holds the current weights, "
                              "not the past versions, so a resume would not be exact")
        if self.moe_bias_rate:
            raise ConfigError(f"{flag} with --moe-bias-rate {self.moe_bias_rate}: the "
                              "router's bias steps change the weights the step reads (a past "
                              "version), outside the optimizer")
        if mode == "stash" and self.grad_accum != 1:
            raise ConfigError(f"{flag} updates after every micro-batch (PipeDream 2019): "
                              f"--grad-accum 1, not {self.grad_accum}")
        if mode == "2bw":  # two versions hold: the check on the schedule's lists
            try:
                live_versions(steady_state(self.pp, self.grad_accum, 3), self.grad_accum)
            except ValueError as e:
                raise ConfigError(f"{flag} --pp {self.pp} --grad-accum {self.grad_accum}: "
                                  f"{e}") from None
        if self.windowed:
            self._check_window(flag + (f" --pipedream-window {K}" if K else ""))

    def _check_window(self, flags: str) -> None:
        """What a window without flushes cannot run, refused naming both flags."""
        step_by_step = "--pipedream-window 1 (step by step, each step flushed)"
        if self.clip > 0:
            raise ConfigError(f"{flags} with --clip {self.clip:g}: inside a window each stage "
                              f"updates on its own, with no global gradient norm to clip to; "
                              f"give --clip 0, or {step_by_step}")
        if self.moe_experts:
            raise ConfigError(f"{flags} with --moe-experts {self.moe_experts}: a window runs "
                              f"the next step's forwards before this step's last backwards, "
                              f"so the router's noise (drawn by backward count) and its "
                              f"per-step statistics would not be the steps'; give {step_by_step}")
        pairs = self.pipedream_window * self.grad_accum * self.pp
        if pairs > MAX_MESSAGES:
            raise ConfigError(f"{flags} --grad-accum {self.grad_accum} --pp {self.pp}: "
                              f"{pairs} (micro-batch, stage) pairs in one list, at most "
                              f"{MAX_MESSAGES}")

    def delays(self) -> list[int]:
        """Versions back each stage's gradients are computed, stage by stage."""
        return [delay(self.pipedream, self.pp, s) for s in range(self.pp)]


def delay(mode: str, p: int, stage: int) -> int:
    """d: stage `stage` of p computes step t's gradients on W_{t-d}."""
    if mode not in MODES:
        raise ValueError(f"unknown PipeDream mode {mode!r}; choose from {MODES}")
    return {"off": 0, "flush": 0, "2bw": 1, "stash": p - 1 - stage}[mode]


def swap(a, b) -> None:
    """Exchange the contents of two equal flat arrays in blocks."""
    for lo in range(0, a.size, SWAP_BLOCK):
        hi = lo + SWAP_BLOCK
        held = a[lo:hi].copy()
        a[lo:hi] = b[lo:hi]
        b[lo:hi] = held


class WeightVersions:
    """The d past versions of a flat parameter buffer (or a range of one: a view),
    oldest first: before step t they are W_{t-d}, ..., W_{t-1}, those before the first
    step W_0 (copied at the first step, after any broadcast of the initial values)."""

    def __init__(self, data, d: int):
        if d < 0:
            raise ValueError(f"a weight version delay is at least 0 (got {d})")
        self.data, self.d = data, d
        self.past: deque | None = None
        self.steps = 0  # t: updates the current version holds

    @property
    def nbytes(self) -> int:
        """Bytes of the kept versions: what the stage holds beyond its parameters."""
        return self.d * self.data.nbytes

    def read_past(self) -> None:
        """data <- W_{t-d}; the oldest slot keeps W_t."""
        if self.past is None:
            self.past = deque(self.data.copy() for _ in range(self.d))
        if self.past:
            swap(self.data, self.past[0])

    def put_back(self) -> None:
        """data <- W_t, which becomes the newest kept version; the next step reads the
        one after W_{t-d}."""
        self.steps += 1
        if self.past:
            self.data[...] = self.past[0]
            self.past.rotate(-1)


class VersionedReplica:
    """A Replica whose step computes its gradients on past weight versions (each of
    `versions` on its range) and leaves W_t in the parameters for the optimizer;
    everything else is the wrapped replica's.

    `delays`: every pipeline stage's d, for the records: "staleness" (each stage's, this
    update), "weight_version_bytes" (what this process keeps)."""

    def __init__(self, replica, delays: list[int], versions: list[WeightVersions]):
        self.replica, self.delays, self.versions = replica, list(delays), versions
        self.staleness = [0] * len(self.delays)
        self.micro_batches = 1  # m of the last step

    @classmethod
    def for_stage(cls, replica, cfg: PipeDreamConfig, stage: int) -> VersionedReplica:
        """Pipeline stage `stage`'s replica: its whole buffer d_stage versions back."""
        delays = cfg.delays()
        return cls(replica, delays, [WeightVersions(replica.params.data, delays[stage])])

    def compute_grads(self, micro_batches, grad_ready=None, **kwargs) -> float:
        step = self.versions[0].steps
        for v in self.versions:
            v.read_past()
        try:
            loss = self.replica.compute_grads(micro_batches, grad_ready, **kwargs)
        finally:
            for v in self.versions:
                v.put_back()
        self.staleness = [min(step, d) for d in self.delays]
        self.micro_batches = len(micro_batches)
        return loss

    @property
    def timing(self) -> dict:
        return {**self.replica.timing, "staleness": self.staleness,
                "weight_version_bytes": self.nbytes,
                "bubble_replay": replay_bubble(len(self.delays), self.micro_batches, 1)}

    @property
    def nbytes(self) -> int:
        return sum(v.nbytes for v in self.versions)

    def __getattr__(self, name: str):
        return getattr(self.replica, name)


class TwoBufferedWindow:
    """K steps of PipeDream-2BW from step t0 run on a pipeline stage as one list
    (`steady_state`: 1F1B over K m micro-batches, no flush), with the two weight buffers
    of the paper: the parameters hold W_{t0} and the second buffer W_{t0-1} (W_{-1} :=
    W_0, copied at the first run), version W_v lives in buffer (v - t0) mod 2, step t's
    micro-batches run forward and backward on W_{t-1}, and after its backward of step
    t's last micro-batch the stage makes W_{t+1} = W_t - lr_t grad f(W_{t-1}) in the
    buffer W_{t-1} held (no longer read: step t + 1 reads W_t). A stage's update waits
    for no other stage of its pipeline, so no global clip norm (--clip 0); with data
    parallelism `reduce` (the trainer's exchange's wait: its fields returned) averages
    the step's gradient over the replicas of this stage first, as the trainer's step
    does, which waits for those replicas only (they run the same list).

    After a run the parameters hold W_{t0+K} and the second buffer W_{t0+K-1} (an odd K
    swaps their contents), so the next run goes on from step t0 + K; the parameters are
    the per-step semantics' (VersionedReplica under the trainer) bit for bit. Its
    measured bubble (`replica.timing`) is the window's, against `bubble_2bw`; a run
    leaves each step's global gradient norm (`norms`), the fields `reduce` returned
    (`reduced`) and the time this rank made its update (`done_at`, perf_counter
    seconds)."""

    def __init__(self, replica, optimizer, lr_of, reduce=None):
        if not hasattr(replica, "stage"):
            raise ValueError(f"a 2BW window runs on a float32 pipeline stage's replica (a "
                             f"PipelineReplica), not a {type(replica).__name__}")
        self.replica, self.optimizer, self.lr_of = replica, optimizer, lr_of
        self.reduce = reduce or dict
        self.buffers: list | None = None  # [the parameters, the second buffer]
        self.norms: list[float] = []
        self.reduced: list[dict] = []
        self.done_at: list[float] = []
        self._squares: list[float] = []

    @property
    def nbytes(self) -> int:
        """Bytes of the second buffer: what the stage holds beyond its parameters."""
        return self.replica.params.data.nbytes

    def run(self, steps: list, first: int = 0) -> list[float]:
        """Run the K steps first .. first + K - 1 (`steps[j]`: step first + j's m
        micro-batches); each one's mean loss. The stage's parameters end holding
        W_{first+K}."""
        st, P = self.replica.stage, self.replica.params
        K, m = len(steps), len(steps[0])
        if any(len(batches) != m for batches in steps):
            raise ValueError("every step of a window runs the same number of micro-batches")
        if self.buffers is None:  # W_{-1} := W_0
            other = copy.copy(P)  # the second buffer; gradients shared
            other.data = P.data.copy()
            other.params = other._views(other.data)
            self.buffers = [P, other]
        every = cross_step_list(st.pp.size, m, K)
        losses = [0.0] * K  # the last stage's sums, in each step's micro-batch order
        last = [None]  # the op run before this one
        self._squares, self.done_at, self.reduced = [], [], []

        def before(passes, op) -> None:
            done = last[0]
            if done is not None:
                losses[done.micro // m] += passes.loss_sum  # an F's loss on the last stage
                passes.loss_sum = 0.0
                if done.kind == "BW" and done.micro % m == m - 1:  # step's last backward
                    self._update(done.micro // m, first)
            last[0] = op
            passes.P = self.buffers[(op.micro // m - 1) % 2]  # W_{t-1}

        self.replica.compute_grads([b for batches in steps for b in batches], scale=K,
                                   ops=every[st.pp.rank], before=before)
        self._update(K - 1, first)  # the list ends with that backward: every loss is counted
        if K % 2:  # W_{first+K} into the parameters, W_{first+K-1} into the second buffer
            swap(P.data, self.buffers[1].data)
        squares = st.pp.allreduce(np.array(self._squares))  # (K,) over the stages
        self.norms = [float(np.sqrt(x)) for x in squares]
        total = st.pp.broadcast(np.array(losses), root=st.owner[st.n_stages - 1])  # (K,)
        return [float(x) / m for x in total]

    def _update(self, j: int, first: int) -> None:
        """W_{t+1} = W_t - lr_t g_t (t = first + j) into buffer (j + 1) mod 2, g_t
        reduced over data parallelism first; this stage's squared gradient norm kept;
        the gradients zeroed."""
        new, now = self.buffers[(j + 1) % 2], self.buffers[j % 2]
        self.reduced.append(self.reduce())
        norm = Model.clip_grad_norm(self.replica.stage, new, 0.0)  # this stage's part
        self._squares.append(norm * norm)
        new.data[...] = now.data
        self.optimizer.step(new.data, new.grad, self.lr_of(first + j))
        new.zero_grad()
        self.done_at.append(time.perf_counter())


class WindowedReplica:
    """dtlab-sync --pipedream 2bw's replica: the trainer hands it one step's micro-batches
    at a time; it keeps them until its window ends (K steps, an evaluation, or the last
    step) and then runs them as one list (TwoBufferedWindow), returning 0.0 for the
    steps before (their records are held by WindowExchange until then). Everything else
    is the wrapped pipeline replica's."""

    def __init__(self, replica, optimizer, schedule, delays: list[int], K: int,
                 eval_every: int, steps: int, reduce=None):
        self.replica, self.delays = replica, list(delays)
        self.window = TwoBufferedWindow(replica, optimizer, schedule, reduce)
        self.K, self.eval_every, self.steps = K, eval_every, steps
        self.kept: list = []  # the micro-batches of the window's steps so far
        self.t = 0  # steps handed in
        self.ran: dict | None = None  # the window just run, until WindowExchange takes it
        self.spans: list = []

    @classmethod
    def for_stage(cls, replica, optimizer, schedule, cfg: PipeDreamConfig, eval_every: int,
                  steps: int, reduce=None) -> WindowedReplica:
        return cls(replica, optimizer, schedule, cfg.delays(),
                   cfg.window_steps(eval_every, steps), eval_every, steps, reduce)

    def ends_window(self, t: int) -> bool:
        """Whether the window ends after t steps (K kept, an evaluation due, the last)."""
        every = self.eval_every
        return len(self.kept) == self.K or t == self.steps or bool(every and t % every == 0)

    def compute_grads(self, micro_batches, grad_ready=None) -> float:
        """Keep the step's micro-batches; at the window's end run it and return the last
        step's loss (its records: `ran`); 0.0 before (that step's loss is not known yet)."""
        self.kept.append(micro_batches)
        self.t += 1
        self.spans = []
        if not self.ends_window(self.t):
            return 0.0
        first, steps = self.t - len(self.kept), self.kept
        self.kept = []
        losses = self.window.run(steps, first)
        for j, loss in enumerate(losses):
            if not math.isfinite(loss):
                raise FloatingPointError(f"loss is {loss} at step {first + j}; lower --lr")
        self.spans = self.replica.spans
        p, m, K = len(self.delays), len(steps[0]), len(steps)
        self.ran = {"losses": losses, "norms": self.window.norms,
                    "reduced": self.window.reduced, "done_at": self.window.done_at,
                    "fields": {**window_shares(self.replica.timing, K),
                               "pipedream_window": K,
                               "bubble_replay": replay_bubble(p, m, K)}}
        return losses[-1]

    @property
    def timing(self) -> dict:
        """The step's own fields; the window's come with the settled records."""
        return {"staleness": [min(self.t - 1, d) for d in self.delays],
                "weight_version_bytes": self.nbytes}

    @property
    def nbytes(self) -> int:
        return self.window.nbytes

    def take(self) -> dict | None:
        """The window that just ran (once), or None."""
        ran, self.ran = self.ran, None
        return ran

    def __getattr__(self, name: str):
        return getattr(self.replica, name)


def window_shares(timing: dict, K: int) -> dict:
    """A window's pipeline fields for each of its K steps' records: the fractions (bubble,
    overhead) and the peak as measured over the window, the seconds, bytes and messages
    as a K-th of the window's."""
    whole = ("bubble", "pipe_overhead", "pipe_peak_activation_bytes")
    return {k: v if k in whole else v / K for k, v in timing.items()}


class WindowExchange:
    """The exchange of a windowed 2BW run: the trainer's optimizer step off (the window
    steps each stage's, after `inner`'s reduction: the data-parallel reducer's wait,
    inside the list), the records of a window held until it has run and then settled
    with its measured figures (see the module's docstring), their losses averaged over
    the replicas by `inner` as the trainer's step does."""

    overlap = False
    optimizer_here = False

    def __init__(self, windowed: WindowedReplica, inner):
        self.windowed, self.inner = windowed, inner
        self.held: list[dict] = []

    def begin(self, step: int) -> dict:
        return {}

    def refresh(self) -> None:
        """Nothing: an evaluation comes at a window's end, the parameters settled."""

    def ready(self, offset: int) -> None:
        """Nothing to start: the window reduces each step's gradient at its update."""

    def wait(self) -> dict:
        """Nothing: the window's reductions come with the settled records."""
        return {}

    def finish(self, step: int, applied: bool) -> dict:
        return {}

    def average(self, value: float) -> float:
        return value  # a step's loss is known, and averaged, when its window has run

    def settled(self, record: dict) -> list[dict]:
        """The window's records once it has run, each with its step's figures; none
        before."""
        self.held.append(record)
        ran = self.windowed.take()
        if ran is None:
            return []
        now = time.perf_counter()
        done, self.held = self.held, []
        last = done[-1]
        # when this rank made each step's update, on the loop's clock (eval_s: after them)
        ends = [last["elapsed_s"] - (now - t) for t in ran["done_at"][:-1]]
        ends.append(last["elapsed_s"] - last.get("eval_s", 0.0))
        first = done[0]  # when the window's first step began (an evaluation: after it)
        begin = first["elapsed_s"] - first.get("eval_s", 0.0) - first["step_s"]
        compute = sum(r["compute_s"] for r in done)
        span = max(ends[-1] - begin, 1e-12)
        for k, r in enumerate(done):
            step_s = ends[k] - (ends[k - 1] if k else begin)
            r.update(ran["fields"], **ran["reduced"][k], grad_norm=ran["norms"][k],
                     loss=self.inner.average(ran["losses"][k]), step_s=step_s,
                     compute_s=compute * step_s / span)
            if r is not last:
                r["elapsed_s"] = ends[k]
        return done

    def plan(self) -> list[dict]:
        return self.inner.plan()

    def close(self) -> None:
        self.inner.close()


def windowed(session, cfg: PipeDreamConfig, reducer) -> tuple[WindowedReplica, WindowExchange]:
    """dtlab-sync's replica and exchange for --pipedream 2bw run in windows (`reducer`:
    the data-parallel one, its wait run at each update)."""
    run = session.setup.run
    replica = WindowedReplica.for_stage(session.replica, session.optimizer, session.schedule,
                                        cfg, run.eval_every, run.steps, reducer.wait)
    return replica, WindowExchange(replica, reducer)


def from_setup(setup) -> PipeDreamConfig:
    """--pipedream of a dtlab-sync setup, checked against its other flags (ConfigError)."""
    opts, run = setup.extra, setup.run
    return build(PipeDreamConfig, {
        "pipedream": opts.pipedream or "off", "pp": opts.pp, "pp_schedule": opts.pp_schedule,
        "grad_accum": run.grad_accum, "zero": opts.zero, "precision": run.precision,
        "checkpoint_every": run.checkpoint_every, "resume": run.resume,
        "moe_bias_rate": float(getattr(setup.model, "moe_bias_rate", 0.0)),
        "moe_experts": int(getattr(setup.model, "moe_experts", 0)),
        "pipedream_window": opts.pipedream_window or 0,
        "clip": setup.optim.clip})


def header_fields(replica, cfg: PipeDreamConfig, allgather) -> dict:
    """The metrics header's PipeDream fields ({} when off): the mode, every stage's
    delay and the bytes of the versions each stage keeps (`allgather` over the pipeline's
    ranks, in stage order)."""
    if cfg.pipedream == "off":
        return {}
    return {"pipedream": cfg.pipedream, "pipedream_delays": cfg.delays(),
            "weight_version_bytes": replica.nbytes,
            "stage_weight_version_bytes": allgather(replica.nbytes)}


def steady_state(p: int, m: int, steps: int) -> Schedule:
    """`steps` steps of PipeDream-2BW, each of m micro-batches, as one list per rank: 1F1B
    over steps x m micro-batches (step j's are j m .. j m + m - 1), no flush between
    steps; each stage updates after its backward of micro-batch j m + m - 1."""
    if steps < 1:
        raise ValueError(f"a steady state of at least 1 step (got {steps})")
    return one_f_one_b(p, steps * m)


def live_versions(ops: Schedule, m: int) -> list[int]:
    """Most weight versions each rank holds at once when it runs `ops` (steady_state's)
    under 2BW: version W_v is made by the update after step v - 1 (W_0 at the start),
    read by step v + 1's micro-batches (steps 0 and 1 both read W_0) and dropped after
    the last of them. ValueError naming the first forward whose version is not made yet
    (too few micro-batches a step for the pipeline's depth)."""
    most = []
    for s, rank in enumerate(ops):
        made, last_use = 0, {}  # made: versions made so far; version -> its last op index
        for k, op in enumerate(rank):
            last_use[max(op.micro // m - 1, 0)] = k
        live, peak = {0}, 1
        for k, op in enumerate(rank):
            step = op.micro // m
            need = max(step - 1, 0)
            if need > made:
                raise ValueError(f"stage {s}: the forward of micro-batch {op.micro} (step "
                                 f"{step}) needs W_{need}, made only after stage {s}'s last "
                                 f"backward of step {need - 1}: 2BW needs more micro-batches "
                                 f"a step")
            if op.kind == "BW" and op.micro % m == m - 1:  # the update: into a freed buffer
                made += 1
                live = {v for v in live | {made} if v == made or last_use.get(v, -1) > k}
                peak = max(peak, len(live))
        most.append(peak)
    return most


@lru_cache(maxsize=64)
def cross_step_list(p: int, m: int, steps: int) -> Schedule:
    """`steady_state`'s lists, validated and checked for two versions (once per size)."""
    every = steady_state(p, m, steps)
    validate(every, steps * m)
    live_versions(every, m)
    return every


@lru_cache(maxsize=64)
def replay_bubble(p: int, m: int, steps: int) -> float:
    """The idle fraction of `steps` steps of 2BW's list (1: a flushed 1F1B step) replayed
    with unit pass times (models/schedule.py simulate): what the metrics record beside
    the measured bubble."""
    return simulate(steady_state(p, m, steps)).bubble


def bubble_2bw(p: int, m: int, steps: int) -> float:
    """Idle fraction of `steps` steps of 2BW under uniform pass times: the start-up's
    (p - 1) passes once, over steps x m micro-batches."""
    return (p - 1) / (steps * m + p - 1)
