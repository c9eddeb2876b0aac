"""ZeRO (collective/zero/sharding.py) as the trainer drives it: its replica, model, optimizer and
reducer, each answering the calls models/run/trainer.py makes of a session's parts.

    session, reducer, zero = shard_session(session, grid.dp_comm, stage=3)
    Trainer(session, log, reducer, ...).run()

One step: ZeroReplica.compute_grads (forward and backward; the units' reduce-scatters
on the helper thread), ZeroReducer.wait (the thread done), ZeroReplica.finish_grads
(mixed precision: the shard unscaled, the overflow check agreed by every rank),
ShardedModel.clip_grad_norm (the global norm from the shards), ZeroOptimizer.step (each
unit segment's update, then, stages 1 and 2, its unit all-gathered).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time

import numpy as np

from dtlab.collective.comm import Communicator
from dtlab.collective.reducers.exchange import Exchange
from dtlab.collective.zero.checkpoint import (
    Saved,
    manifest,
    newest_common,
    recut,
    saved_in,
    saved_ranges,
)
from dtlab.collective.zero.sharding import Zero, ZeroParams
from dtlab.models import backend
from dtlab.models.cost import zero_memory
from dtlab.models.model import Replica
from dtlab.models.optim import make_optimizer
from dtlab.models.pipeline import PipelineReplica
from dtlab.models.precision import finite
from dtlab.models.run import checkpoint
from dtlab.models.run.checkpoint import CheckpointError
from dtlab.models.run.trainer import Trainer, config_differences, grid_words


class ZeroOptimizer:
    """The configured optimizer, one instance per unit segment of the shard: every update
    is elementwise, so the segments step exactly as the whole buffer would. After each
    segment's step (stages 1 and 2) its unit is all-gathered, overlapping the next."""

    def __init__(self, cfg, zero: Zero, decay_mask):
        self.zero = zero
        P, mine = zero.params, zero.layout.mine
        xp = backend.array_module(P.data)
        scratch = xp.empty(zero.layout.largest_segment, dtype=P.data.dtype)  # shared by all
        self.parts = [make_optimizer(cfg, P.data[a:b], decay_mask=decay_mask[lo:hi].copy(),
                                     scratch=scratch[: b - a])
                      for (a, b), (lo, hi) in zip(P.data_ranges, mine, strict=True)]

    @property
    def steps(self) -> int:
        return self.parts[0].steps if self.parts else 0

    @property
    def state_names(self) -> tuple[str, ...]:
        return self.parts[0].state_names if self.parts else ()

    def step(self, param, grad, lr: float | None = None) -> None:
        """One step of every segment: param and grad are session.params' data and grad."""
        z = self.zero
        for u, part in enumerate(self.parts):
            a, b = z.params.data_ranges[u]
            c, d = z.params.grad_ranges[u]
            part.step(param[a:b], grad[c:d], lr)
            if z.stage < 3:
                z.publish(u)
        z.stream.drain()
        z.timing["allgather_s"] = z.stream.take_seconds()

    def state_dict(self) -> dict:
        """This shard's state: each buffer's segments back to back (the packed layout)."""
        xp = backend.array_module(self.zero.params.data)
        names = self.parts[0].state_names
        return {"steps": self.steps,
                **{name: xp.concatenate([getattr(p, name) for p in self.parts])
                   for name in names}}

    def load_state_dict(self, state: dict) -> None:
        """state_dict's inverse: each packed buffer cut back into the unit segments."""
        for (at, end), part in zip(self.zero.layout.packed, self.parts, strict=True):
            part.load_state_dict({"steps": state["steps"],
                                  **{name: state[name][at:end] for name in part.state_names}})


class ShardedModel:
    """The model as the trainer asks it under ZeRO: the global gradient norm comes from
    the shards (Zero.clip); the MoE list, model-parallel groups and a pipeline stage's
    module bounds are the model's, and `dp` the ranks it is sharded over (so each dp
    rank checkpoints its own shard)."""

    def __init__(self, model, zero: Zero):
        self.model, self.zero = model, zero
        self.moe, self.pp, self.ep, self.tp = model.moe, model.pp, model.ep, model.tp
        self.bounds = getattr(model, "bounds", None)
        self.dp = zero.comm

    def clip_grad_norm(self, P: ZeroParams, max_norm: float) -> float:
        return self.zero.clip(max_norm)


class ZeroReplica:
    """What the trainer drives: compute_grads on the (hooked) model, or on a pipeline
    stage by its `schedule` (models/pipeline.py), the reduced shard in finish_grads, under
    --precision with the loss scale and overflow check of models/precision.py (each rank
    checks its shard; all agree)."""

    def __init__(self, zero: Zero, schedule: str | None = None):
        self.zero, self.model = zero, zero.model
        self.inner = Replica(zero.model, zero.P) if schedule is None else \
            PipelineReplica(zero.model, zero.P, schedule)
        self.compute_params = zero.P
        self._scale = 1.0

    @property
    def timing(self) -> dict:
        """The last step's sent_bytes, allgather_s, working_bytes (and a pipeline's)."""
        return {**self.inner.timing, **self.zero.timing}

    @property
    def spans(self) -> list:
        return self.inner.spans

    def compute_grads(self, micro_batches, grad_ready=None) -> float:
        z = self.zero
        z.begin_step()
        self._scale = z.scaler.scale if z.scaler is not None else 1.0
        with np.errstate(over="ignore", invalid="ignore"):  # finish_grads sees overflows
            return self.inner.compute_grads(micro_batches, grad_ready, scale=self._scale)

    def finish_grads(self) -> tuple[bool, dict]:
        z = self.zero
        if z.hooks is not None:
            z.timing.update(working_bytes=z.hooks.nbytes, gather_wait_s=z.hooks.waited)
        if z.scaler is None:
            return True, {}
        g = z.params.grad
        if z.runs_as == 1:  # the half gradient's segments, in float32
            for (lo, hi), (at, end) in zip(z.layout.mine, z.params.grad_ranges, strict=True):
                g[at:end] = z.work.grad[lo:hi]
        g *= 1.0 / self._scale
        ok = z.agreed(finite(g))
        z.scaler.update(ok)
        return ok, {"loss_scale": self._scale, "skipped": not ok,
                    "skipped_steps": z.scaler.skipped}

    def evaluate(self, batches) -> float:
        loss = self.inner.evaluate(batches)
        if self.zero.hooks is not None:
            self.zero.hooks.release_all()
        return loss


class ZeroMixedReplica(ZeroReplica):
    """ZeroReplica under --precision fp16/bf16: the trainer checkpoints the scaler and
    prints its summary line."""

    @property
    def scaler(self):
        return self.zero.scaler

    def summary_line(self) -> str:
        s, precision = self.zero.scaler, self.zero.precision
        if not s.dynamic:
            return f"{precision}: {s.skipped} step(s) skipped (non-finite gradients)"
        return f"{precision}: {s.skipped} step(s) skipped on overflow, loss scale now {s.scale:g}"


class ZeroReducer(Exchange):
    """The trainer's reducer: stage 1 reduce-scatters each unit as backward reports it
    final (`ready`); every stage's wait() lets the helper thread finish."""

    def __init__(self, zero: Zero):
        super().__init__(zero.comm)
        self.zero = zero
        self._next = len(zero.layout.units) - 1  # stage 1: units not yet launched this step
        self.overlap = zero.stream.overlap

    def ready(self, offset: int) -> None:
        """Every gradient element at index >= offset is final (stage 1)."""
        z = self.zero
        while z.runs_as == 1 and self._next >= 0 and z.layout.units[self._next].lo >= offset:
            z.reduce_unit(self._next)
            self._next -= 1

    def wait(self) -> dict:
        start = time.perf_counter()
        self.ready(0)
        self._next = len(self.zero.layout.units) - 1
        self.zero.stream.drain()
        return {"comm_s": self.zero.stream.take_seconds(),
                "wait_s": time.perf_counter() - start}

    def plan(self) -> list[dict]:
        """Each unit: its name, elements and this rank's segment."""
        z = self.zero
        return [{"unit": u.name, "elements": u.size, "mine": hi - lo}
                for u, (lo, hi) in zip(z.layout.units, z.layout.mine, strict=True)]

    def close(self) -> None:
        self.zero.close()


def shard_session(session, comm: Communicator, stage: int, reshard: bool = True,
                  overlap: bool = True, wire: str = "fp32", quant=None):
    """(session, reducer, zero): `session` with its params, replica, optimizer and model
    replaced by ZeRO `stage`'s over `comm` (the dp ranks of this (pp, tp) shard); the old
    whole buffers freed. A pipeline stage runs the schedule its session's replica ran;
    `wire` (--wire) is the dtype the gradient reduce-scatters move; `quant` (a
    ZeroQuantConfig, collective/zero/quantized.py) quantizes the gathers and reduce-scatters."""
    zero = Zero(session, comm, stage, reshard, overlap, wire, quant)
    optimizer = ZeroOptimizer(session.setup.optim, zero, session.params.decay_mask())
    runs = getattr(session.replica, "inner", session.replica)  # MixedReplica's own runner
    replica = (ZeroMixedReplica if zero.half is not None else ZeroReplica)(
        zero, getattr(runs, "schedule", None))
    sharded = dataclasses.replace(session, model=ShardedModel(session.model, zero),
                                  params=zero.params, replica=replica,
                                  optimizer=optimizer)
    return sharded, ZeroReducer(zero), zero


def zero_bytes(zero: Zero, optimizer: ZeroOptimizer, kind: str, dense: int) -> dict:
    """This rank's persistent bytes by kind (the metrics header's zero_bytes), beside the
    paper's formula (models/cost.py zero_memory) for `dense` parameters and the optimizer
    `kind` (sgd, sgd-momentum, adam, adamw)."""
    half = zero.half is not None
    # stage 3 keeps no whole copy: in full precision its master shard is the weights
    weights = zero.full.nbytes if zero.stage < 3 else (0 if half else zero.master.nbytes)
    grads = zero.params.grad.nbytes
    if zero.runs_as == 1 and half:
        grads += zero.work.grad.nbytes
    states = sum(v.nbytes for k, v in optimizer.state_dict().items() if k != "steps")
    master = zero.master.nbytes if half else 0
    return {"stage": zero.stage, "dp": zero.comm.size, "weight_bytes": weights,
            "grad_bytes": grads, "master_bytes": master, "state_bytes": states,
            "optimizer_bytes": master + states, "total_bytes": weights + grads + master
            + states, "formula": zero_memory(dense, zero.runs_as, zero.comm.size,
                                             zero.precision, kind, zero.master.itemsize)}


class ZeroTrainer(Trainer):
    """The trainer under --zero: every dp rank saves its shard (module docstring) and
    `--resume` cuts the newest saved one for this run's dp size."""

    def save(self, next_step: int) -> str:
        s, zero = self.s, self.s.model.zero
        arrays = {"params": zero.shard()}
        arrays.update({f"opt.{k}": v for k, v in s.optimizer.state_dict().items() if k != "steps"})
        meta = {"config": s.setup.as_dict(), "n_params": s.params.size, "dp": s.world,
                "optimizer_steps": s.optimizer.steps, "loader": s.loader.state_dict(),
                "global_batch": self.samples_per_step, "zero": manifest(zero),
                "moe_noise_steps": [m.noise_step for m in s.model.moe]}
        if zero.scaler is not None:
            meta["loss_scaler"] = zero.scaler.state_dict()
        return checkpoint.save(self.root, next_step, arrays, meta, keep=s.setup.run.keep or None)

    def _resume(self) -> int:
        s, zero = self.s, self.s.model.zero
        directory, n = s.setup.run.checkpoint_dir, zero.comm.size
        saved = self._newest(directory, n)
        if saved is None:
            self._say(f"no checkpoint in {directory} yet: starting at step 0")
            return 0
        first = saved.path(0)
        with open(os.path.join(first, checkpoint.MANIFEST)) as f:
            meta = json.load(f)
        differ = config_differences(meta["config"], s.setup.as_dict())
        if differ or meta.get("n_params") != s.params.size:
            raise CheckpointError(f"{first} was written by a run with another config: "
                                  + "; ".join(differ or ["a different parameter count"]))
        ranges = saved_ranges(meta, zero.layout, first)
        names = ["params", *(f"opt.{k}" for k in s.optimizer.state_names)]
        dtype = zero.master.dtype
        arrays = recut(ranges, zero.layout.mine, names,
                       lambda q: self._shard(saved, q, ranges[q], names, dtype), dtype)
        zero.load(arrays.pop("params"))
        s.optimizer.load_state_dict({**{k[len("opt."):]: v for k, v in arrays.items()},
                                     "steps": meta["optimizer_steps"]})
        s.loader.load_state_dict(meta["loader"])
        for m, noise_step in zip(s.model.moe, meta.get("moe_noise_steps", []), strict=False):
            m.noise_step = noise_step  # the router noise goes on where it stopped
        if zero.scaler is not None and "loss_scaler" in meta:
            zero.scaler.load_state_dict(meta["loss_scaler"])
        self._resumed(int(meta["step"]), meta, saved, n)
        return int(meta["step"])

    def _newest(self, directory: str, n: int) -> Saved | None:
        """The saved dp size with the newest step that verifies on all its shards and on
        every (pp, tp) shard's (this run's dp size on a tie), or None when nothing is
        saved yet (collective)."""
        best, skipped = None, []
        others = {name: comm for name, comm in self.groups.items() if name != "dp"}
        part = "-".join(f"{name}{comm.rank}of{comm.size}" for name, comm in others.items())
        found = saved_in(directory, grid_words({"dp": n, **self.grid}), part)
        for saved in sorted(found, key=lambda x: x.shards != n):
            saved.step, passed = newest_common(self.s.model.zero.comm, saved.roots,
                                               list(others.values()))
            skipped += passed
            if saved.step >= 0 and (best is None or saved.step > best.step):
                best = saved
        for bad, why in skipped:
            print(f"skipping checkpoint {bad}: {why}", file=sys.stderr)
        if best is None and skipped:
            raise CheckpointError(f"no checkpoint in {directory} verifies: "
                                  + "; ".join(f"{p}: {w}" for p, w in skipped))
        return best

    @staticmethod
    def _shard(saved: Saved, q: int, ranges, names: list[str], dtype) -> dict:
        """Saved shard q's arrays, checked against the manifest's ranges for it, the
        buffers this run needs and the master dtype."""
        path = saved.path(q)
        arrays, meta = checkpoint.load(path)
        own = meta.get("zero")
        if own is not None and (own["rank"] != q or [tuple(r) for r in own["ranges"]] != ranges):
            raise CheckpointError(f"{path}: its ranges {own['ranges']} (rank {own['rank']}) "
                                  "disagree with the manifest's for this shard")
        lacking = [f"{name}.npy" for name in names if name not in arrays]
        if lacking:
            raise CheckpointError(f"{path} lacks {', '.join(lacking)}, which this run's "
                                  "optimizer needs: it cannot be re-sliced into it")
        size = sum(hi - lo for lo, hi in ranges)
        for name in names:
            if arrays[name].shape != (size,) or arrays[name].dtype != dtype:
                raise CheckpointError(f"{path}: {name}.npy holds {arrays[name].shape} "
                                      f"{arrays[name].dtype}, the manifest's ranges {size} "
                                      f"elements of this run's {np.dtype(dtype)}")
        return arrays

    def _resumed(self, step: int, meta: dict, saved: Saved, n: int) -> None:
        """What the resume did, on rank 0's stderr."""
        s, run = self.s, self.s.setup.run
        how = ""
        if "zero" not in meta:
            how = f" (a plain data-parallel checkpoint, cut into {n} shard(s))"
        elif saved.shards != n:
            how = f" (its ZeRO shards over dp {saved.shards} cut again for dp {n})"
        self._say(f"resumed from step {step} of {run.checkpoint_dir}{how}")
        self._say_steps(step, meta["config"]["run"]["steps"])
        if meta.get("dp", s.world) != s.world:
            self._say(f"resumed with dp {s.world}; the checkpoint was written with dp "
                      f"{meta['dp']}: the global batch is now {self.samples_per_step} (was "
                      f"{meta['global_batch']}), the data goes on from example "
                      f"{s.loader.position} of epoch {s.loader.epoch}")
