"""The trainer of every topology: its step, checkpoints and resume (the loop around the
steps is models/run/loop.py's).

One step:  the exchange's begin (a pull, or nothing) -> micro-batches ->
           Replica.compute_grads (the exchange told as gradient ranges become final)
           -> the exchange's wait (the gradient reduced across ranks, or nothing)
           -> the step's scalars (the loss averaged over the global batch; where one
              all-reduce can, the stop agreement with it: `scalars`)
           -> Replica.finish_grads (mixed precision: unscale, skip the step on an
              overflow) -> clip global norm -> optimizer step at the scheduled lr
              (where the exchange says the optimizer runs here)
           -> the exchange's finish (a push bringing the next pull, or nothing)

The `exchange` (models/run/exchange.py) is all that differs between methods and
topologies: none for single-process training (`Single`), a data-parallel one from
collective/reducers/ for dtlab-sync, the push/pull of pserver/worker/exchange.py for
dtlab-worker. Rank 0 (`is_main`) writes metrics and checkpoints.
"""

from __future__ import annotations

import dataclasses
import os
import re
import sys
import time

import numpy as np

from dtlab.models.backend import array_module
from dtlab.models.run import checkpoint, loop, moe_report
from dtlab.models.run.checkpoint import CheckpointError
from dtlab.models.run.exchange import Exchange, Single
from dtlab.models.run.loop import Summary
from dtlab.models.run.metrics import MetricsLog
from dtlab.models.run.progress import Progress
from dtlab.models.run.session import GROUPS, Session
from dtlab.models.run.stop import StopSignals
from dtlab.models.run.straggler import Straggler
from dtlab.models.run.trace import Trace


class Trainer:
    """Runs the steps; `is_main` writes metrics and progress, `saves` this rank's checkpoints
    (default: is_main). A model-parallel model's ranks each hold different bytes, so each
    one's checkpoints go to their own directory, <checkpoint_dir>/<shard>/ with shard
    "pp<r>of<n>-ep<r>of<n>-tp<r>of<n>" (the dimensions of size 1 left out); so do the dp
    ranks of a model sharded over dp ("dp<r>of<n>", ZeRO: collective/zero/checkpoint.py)."""

    def __init__(self, session: Session, log: MetricsLog, exchange: Exchange | None = None,
                 is_main: bool = True, saves: bool | None = None, agree=None, rank: int = 0,
                 role: str = "train", stages=None, trace: Trace | None = None, scalars=None):
        self.s, self.log, self.is_main = session, log, is_main
        self.exchange = exchange or Single()
        # a pipeline's allgather of a small object over its stages, so that the MoE
        # statistics cover every stage's layers (None: this process holds them all)
        self.stages = stages or (lambda x: [x])
        self.trace = trace or Trace(session.setup.run.trace, pid=rank,
                                    process=f"{role} rank {rank}")
        run = session.setup.run
        self.straggler = Straggler(run.straggler, run.delay_ms, run.seed, rank,
                                   on_device=array_module(session.params.data) is not np)
        self.last_compute_s = 0.0  # the factor's base, on the straggler's clock
        self.agree = agree  # sums a small count array over every rank of the job (StopSignals)
        # (loss, stop counts) -> (the loss averaged, the counts summed over every rank of the
        # job) in one all-reduce, where the program has one (collective/reducers/exchange.py
        # step_scalars); else the exchange's average, and `agree` at the step's end
        self.scalars = scalars or self._apart
        self.stop = StopSignals()  # the loop's: the step reads this rank's caught signals
        self.carried = None  # the counts this step's scalars summed (None: not carried)
        self.saves = is_main if saves is None else saves
        run = session.setup.run
        self.groups = model_parallel_groups(session.model)
        self.grid = {name: comm.size for name, comm in self.groups.items()}
        self.shard = "-".join(f"{name}{comm.rank}of{comm.size}"
                              for name, comm in self.groups.items())
        self.root = os.path.join(run.checkpoint_dir, self.shard) if self.shard else \
            run.checkpoint_dir
        self.progress = Progress(run.steps, run.log_every, enabled=is_main)
        self.samples_per_step = run.batch_size * run.grad_accum * session.world
        self.start_step = self._resume() if run.resume else 0

    def step(self, step: int) -> dict:
        """One step of any method: the exchange (models/run/exchange.py) says what moves
        between this rank and the others, and whether the optimizer runs here."""
        s, exchange, extra = self.s, self.exchange, {}
        if self.straggler.active:
            start = time.perf_counter()
            extra["straggle_s"] = self.straggler.wait(step, self.last_compute_s)
            self.trace.span("straggle", start, time.perf_counter(), "wait")
        t0 = time.perf_counter()
        begun = exchange.begin(step)
        t1, c1 = time.perf_counter(), self.straggler.clock()
        loss = s.replica.compute_grads(s.loader.next(), exchange.ready)
        t2 = time.perf_counter()
        self.last_compute_s = self.straggler.clock() - c1
        waited = exchange.wait()
        loss, self.carried = self.scalars(loss, self.stop.counts())
        loop.check_finite(loss, f"step {step}")
        t3 = time.perf_counter()
        lr = s.schedule(step)
        apply, scaling = s.replica.finish_grads()  # every rank sees the same reduced gradient
        grad_norm = None
        if apply:
            grad_norm = s.model.clip_grad_norm(s.params, s.setup.optim.clip)
            if exchange.optimizer_here:
                s.optimizer.step(s.params.data, s.params.grad, lr)
        t4 = time.perf_counter()
        finished = exchange.finish(step, apply)
        t5 = time.perf_counter()
        self.trace.span("compute", t1, t2, step=step + 1)
        if waited:  # the exchange reduces after backward
            self.trace.span("allreduce wait", t2, t3, "wait")
        self.trace.span("optimizer", t3, t4)
        for name, start, end in s.replica.spans:
            self.trace.span(name, start, end, "pipeline")
        return {"step": step + 1, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                "step_s": t5 - t0, "compute_s": (t2 - t1) + (t4 - t3), **begun, **waited,
                **finished, **scaling,
                **s.replica.timing, **extra,
                **moe_report.merge(self.stages(moe_report.step_record(s.model.moe)))}

    def run(self) -> Summary:
        """Train to --steps, or until SIGTERM / SIGINT: then every rank stops after the
        same step and, with --checkpoint-dir, saves it (models/run/stop.py)."""
        summary = loop.train(self, self.iterations(), self.s.dataset.floor,
                             self.samples_per_step, self.agreed_counts, self.stop)
        self.trace.close()
        every = self.stages(moe_report.layer_summaries(self.s.model.moe))
        summary.extra_lines = moe_report.summary_lines([row for rows in every for row in rows])
        if hasattr(self.s.replica, "summary_line"):
            summary.extra_lines.append(self.s.replica.summary_line())
        return summary

    def iterations(self) -> range:
        """The loop's steps: from the resumed one to --steps."""
        return range(self.start_step, self.s.setup.run.steps)

    def _apart(self, loss: float, counts):
        """The loss averaged by the exchange; the counts left to the step's end (None)."""
        return self.exchange.average(loss), None

    def agreed_counts(self, counts):
        """The stop counts summed over every rank of the job at a step's end: those its
        scalars carried (a signal caught since is agreed at the next step), else `agree`'s
        own sum of `counts` (None: this process alone)."""
        if self.carried is not None:
            return self.carried
        return counts if self.agree is None else self.agree(counts)

    def eval_due(self, step: int) -> bool:
        run = self.s.setup.run
        return loop.eval_due(step + 1, run.eval_every, run.steps)

    def evaluate(self) -> float:
        """The held-out loss of the parameters the exchange makes current (a worker's: the
        servers' after this step's push)."""
        t = time.perf_counter()
        self.exchange.refresh()
        loss = self.s.replica.evaluate(self.s.heldout)
        self.trace.span("eval", t, time.perf_counter())
        return loss

    def report(self, step: int, record: dict) -> list[dict]:
        """Writes the records the exchange says are final (local SGD: a round's at its
        end, their losses then averaged) and returns them."""
        settled = self.exchange.settled(record)
        for done in settled if self.is_main else ():
            self.log.write(done)
            speed = f"lr {done['lr']:.2e}  {done['step_s'] * 1e3:6.1f} ms/step"
            self.progress.update(done["step"] - 1, done["loss"], speed)
        return settled

    def checkpoint(self, step: int) -> bool:
        """Saves after `step` when --checkpoint-every says so; whether it was due."""
        every = self.s.setup.run.checkpoint_every
        due = bool(every and (step + 1) % every == 0)
        if self.saves and due:
            self.save(step + 1)
        return due

    def stopped(self, signal_name: str, step: int, saved: bool) -> None:
        self._stopped(signal_name, step + 1, saved)

    def _stopped(self, signal_name: str, steps: int, saved: bool) -> None:
        run = self.s.setup.run
        if not run.checkpoint_dir:
            self._say(f"stopped by {signal_name} after step {steps}; no --checkpoint-dir, so "
                      "nothing was saved")
            return
        if self.saves and not saved:
            self.save(steps)
        self._say(f"stopped by {signal_name} after step {steps}; checkpoint "
                  f"{os.path.join(run.checkpoint_dir, checkpoint.step_dir(steps))} written "
                  f"(go on with --resume)")

    def save(self, next_step: int) -> str:
        s = self.s
        arrays = {"params": s.params.data}
        arrays.update({f"opt.{k}": v for k, v in s.optimizer.state_dict().items() if k != "steps"})
        meta = {"config": s.setup.as_dict(), "n_params": s.params.size, **self.grid,
                "optimizer_steps": s.optimizer.steps, "loader": s.loader.state_dict(),
                "dp": s.world, "global_batch": self.samples_per_step,
                "moe_noise_steps": [m.noise_step for m in s.model.moe]}
        if hasattr(s.replica, "scaler"):
            meta["loss_scaler"] = s.replica.scaler.state_dict()
        return checkpoint.save(self.root, next_step, arrays, meta, keep=s.setup.run.keep or None)

    def _say_steps(self, step: int, saved_steps: int) -> None:
        """What a resume says of --steps against the checkpointed run's."""
        run = self.s.setup.run
        if saved_steps != run.steps:
            self._say(f"--steps is {run.steps}, the checkpointed run had {saved_steps}: the lr "
                      f"schedule now spans {run.steps} steps")
        if step >= run.steps:
            self._say(f"the run already reached step {step} of --steps {run.steps}: nothing to do")

    def _resume(self) -> int:
        s = self.s
        run = s.setup.run
        self._check_grid(run.checkpoint_dir)
        path = self._common_latest()
        if path is None:
            self._say(f"no checkpoint in {run.checkpoint_dir} yet: starting at step 0")
            return 0
        arrays, meta = checkpoint.load(path)
        saved = meta["config"]
        differ = config_differences(saved, s.setup.as_dict())
        for name in ("pp", "ep", "tp"):
            if meta.get(name, 1) != self.grid.get(name, 1):
                differ.append(f"{name}: {meta.get(name, 1)} -> {self.grid.get(name, 1)}")
        if differ or meta.get("n_params") != s.params.size:
            raise CheckpointError(f"{path} was written by a run with another config: "
                                  + "; ".join(differ or ["a different parameter count"]))
        s.params.load(arrays["params"])
        state = {k[len("opt."):]: v for k, v in arrays.items() if k.startswith("opt.")}
        s.optimizer.load_state_dict({**state, "steps": meta["optimizer_steps"]})
        s.loader.load_state_dict(meta["loader"])
        for m, noise_step in zip(s.model.moe, meta.get("moe_noise_steps", []), strict=False):
            m.noise_step = noise_step  # the router noise goes on where it stopped
        if "loss_scaler" in meta and hasattr(s.replica, "scaler"):
            s.replica.scaler.load_state_dict(meta["loss_scaler"])
        step, saved_steps = int(meta["step"]), saved["run"]["steps"]
        self._say(f"resumed from step {step} of {run.checkpoint_dir}")
        self._say_steps(step, saved_steps)
        if meta.get("dp", s.world) != s.world:
            self._say(f"resumed with dp {s.world}; the checkpoint was written with dp "
                      f"{meta['dp']}: the global batch is now {self.samples_per_step} (was "
                      f"{meta['global_batch']}) and the data goes on from example "
                      f"{s.loader.position} of epoch {s.loader.epoch}, so from here the run is "
                      f"not the uninterrupted dp-{meta['dp']} run (same lr schedule, other "
                      f"batches)")
        return step

    def _check_grid(self, root: str) -> None:
        """A checkpoint directory of another model-parallel grid is refused, naming both."""
        if not os.path.isdir(root):
            return
        grids = {shard_grid(d) for d in os.listdir(root) if shard_grid(d)}
        if checkpoint.latest(root) is not None:
            grids.add(grid_words({}))
        mine = grid_words(self.grid)
        if grids and grids != {mine}:
            raise CheckpointError(f"{root} holds checkpoints of a run with "
                                  f"{' and '.join(sorted(grids))}; this run has {mine}")

    def _common_latest(self) -> str | None:
        """The newest checkpoint that verifies on every model-parallel rank (a crash may
        have stopped some ranks one save short, or left one's newest file damaged), or
        None when there is none yet. Each skipped checkpoint is named with its reason;
        checkpoints that exist but of which none verifies are refused, never overwritten."""
        at_most, skipped = None, []
        while True:
            path, passed = checkpoint.latest_valid(self.root, at_most)
            skipped += passed
            step = checkpoint.step_of(path) if path else -1
            if not self.groups:
                break
            steps = np.array([float(step)])
            for comm in self.groups.values():
                steps = comm.allgather(steps)  # every step of this group, then of the next
            low = int(steps.min())
            if low < 0 or int(steps.max()) == low:
                step = low
                break
            at_most = low  # the ranks above it look again at or below it
        for bad, why in skipped:
            if self.saves:
                print(f"skipping checkpoint {bad}: {why}", file=sys.stderr)
        if step < 0:
            if skipped:
                raise CheckpointError(f"no checkpoint in {self.root} verifies: "
                                      + "; ".join(f"{p}: {w}" for p, w in skipped))
            return None
        return os.path.join(self.root, checkpoint.step_dir(step))

    def _say(self, line: str) -> None:
        if self.is_main:
            print(line, file=sys.stderr)


def model_parallel_groups(model) -> dict:
    """{"dp": comm, "pp": comm, "ep": comm, "tp": comm} for the dimensions a model is split
    over (dp: its parameters and optimizer state sharded over the dp ranks, ZeRO's
    collective/zero/trainer.py ShardedModel; ep: its experts, models/moe_ep.py)."""
    groups = {"dp": getattr(model, "dp", None), "pp": model.pp,
              "ep": getattr(model, "ep", None), "tp": model.tp}
    return {name: comm for name, comm in groups.items() if comm is not None and comm.size > 1}


def grid_words(grid: dict) -> str:
    """'--pp 2 --tp 2', '--tp 2', 'ZeRO --dp 2' (shards over dp); an unsplit grid is
    '--pp 1 --tp 1'."""
    return " ".join(("ZeRO " if name == "dp" else "") + f"--{name} {size}"
                    for name, size in grid.items()) or "--pp 1 --tp 1"


def shard_grid(dirname: str) -> str:
    """The grid words of a shard directory's name ('pp1of2-tp0of2' -> '--pp 2 --tp 2',
    'ep1of2' -> '--ep 2', 'dp0of3' -> 'ZeRO --dp 3'), '' for any other name."""
    match = re.fullmatch(r"(dp\d+of(\d+))?-?(pp\d+of(\d+))?-?(ep\d+of(\d+))?-?"
                         r"(tp\d+of(\d+))?", dirname)
    if not match or not dirname:
        return ""
    return grid_words({name: int(size) for name, size in
                       (("dp", match[2]), ("pp", match[4]), ("ep", match[6]),
                        ("tp", match[8])) if size})


# Run fields a resumed run may change: they steer this launch, not the computation.
RESUMABLE = {"steps", "metrics", "log_every", "checkpoint_every", "checkpoint_dir", "resume",
             "eval_every", "eval_samples", "trace", "straggler", "delay_ms",
             "keep"}


def config_differences(saved: dict, now: dict) -> list[str]:
    """'section.field: saved -> now' for every field that differs, RESUMABLE ones aside."""
    out = []
    if saved.get("model_name") != now["model_name"]:
        out.append(f"model: {saved.get('model_name')} -> {now['model_name']}")
    for section in ("model", "data", "optim", "run"):
        old, new = saved.get(section, {}), now[section]
        for key in sorted(set(old) | set(new)):
            if section == "run" and key in RESUMABLE:
                continue
            was = old[key] if key in old else added_default(section, key)
            if was != new.get(key):
                out.append(f"{section}.{key}: {was!r} -> {new.get(key)!r}")
    return out


def added_default(section: str, key: str):
    """The default of a data, optim or run field that a saved config predates (a
    checkpoint written before the field existed ran as its default did); None else."""
    field = {f.name: f for f in dataclasses.fields(GROUPS[section])}.get(key) \
        if section in GROUPS else None
    return None if field is None else field.default
