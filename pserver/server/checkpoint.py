"""Shard checkpoints on top of models.checkpoint (atomic, digest-verified directories).

    CHECKPOINT_DIR/shard-<i>-of-<S>/step-<version>/     (or, for the partitions of
                  model-parallel worker groups, .../partition-<k>-of-<K>/step-<version>/,
                  meta.json naming the partition and its specs)
        params.npy            the shard's parameters
        opt.<name>.npy        each optimizer state buffer (moments, velocity)
        round.npy             the gradient sum of an unfinished BSP round, if any
        meta.json             version, layout, full config, worker clocks and
                              next steps, optimizer steps, staleness histograms,
                              the BSP round's (worker: [step, version read])
                              and, for ranged pushes, the union of their
                              ranges (round_covered), file digests

The step of the directory is the shard's version. A restarted server goes on
from exactly this state: the staleness histograms keep counting, and a BSP
round completes when the workers not yet in it push. `--resume` starts from
`newest`, the one rule for a shard's directory and each partition's, as the
trainers' (models.run.checkpoint.latest_valid): what a killed save left is
recovered first (a checkpoint it had moved aside put back, its temporary
directory removed, each logged), then the newest checkpoint that verifies is
taken and every newer one passed over is logged with why; a directory with
checkpoints of which none verifies is refused, never started over.
`load` raises models.checkpoint.CheckpointError naming the file for a
missing or corrupt file, and for a checkpoint of another shard or optimizer.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable

from dtlab.models.run import checkpoint
from dtlab.models.run.checkpoint import CheckpointError
from dtlab.pserver.server.staleness import StalenessLog
from dtlab.pserver.server.store import ShardLayout

log = logging.getLogger(__name__)


def shard_dir(root: str, layout: ShardLayout, partition: tuple[int, int] | None = None) -> str:
    """root/shard-<i>-of-<S>, or for partition (k, K) of model-parallel worker groups
    (pserver.server.partitions) root/shard-<i>-of-<S>/partition-<k>-of-<K>."""
    shard = os.path.join(root, f"shard-{layout.shard}-of-{layout.num_shards}")
    if partition is None:
        return shard
    return os.path.join(shard, f"partition-{partition[0]}-of-{partition[1]}")


def saved_partitions(root: str, layout: ShardLayout) -> list[tuple[int, int, str]]:
    """(k, K, directory) of every partition this shard saved, by k."""
    shard = shard_dir(root, layout)
    found = []
    for name in sorted(os.listdir(shard)) if os.path.isdir(shard) else []:
        m = re.fullmatch(r"partition-(\d+)-of-(\d+)", name)
        if m:
            found.append((int(m[1]), int(m[2]), os.path.join(shard, name)))
    return sorted(found)


def _layout(layout: ShardLayout) -> dict:
    return {"model": layout.model, "model_size": layout.model_size, "shard": layout.shard,
            "num_shards": layout.num_shards, "layout_crc32": layout.layout_crc}


def save(root: str, layout: ShardLayout, state: dict, config: dict,
         keep: int | None = None, partition: dict | None = None) -> str:
    """Write `state` (ShardStore.state()) as the checkpoint of its version; returns its path.
    `keep`: then keep only the `keep` newest that verify (None: all). `partition`
    ({"id", "count", "specs"}: a worker group's partition, its specs as JSON) goes into
    the meta and the partition's own directory."""
    opt, pending = state["optimizer"], state["round"]
    arrays = {"params": state["params"],
              **{f"opt.{k}": v for k, v in opt.items() if k != "steps"}}
    meta = {"layout": _layout(layout), "version": state["version"],
            "optimizer_steps": int(opt["steps"]),
            "workers": {str(w): s for w, s in state["workers"].items()},
            "staleness": state["staleness"], "config": config}
    if pending:
        arrays["round"] = pending["total"]
        meta["round"] = {str(w): list(c) for w, c in pending["contributors"].items()}
        if pending.get("covered") is not None:  # the union of its ranged pushes
            meta["round_covered"] = [list(r) for r in pending["covered"]]
    where = None
    if partition is not None:
        meta["partition"] = partition
        where = (partition["id"], partition["count"])
    return checkpoint.save(shard_dir(root, layout, where), state["version"], arrays, meta,
                           keep=keep)


def latest(root: str, layout: ShardLayout) -> str | None:
    """The checkpoint this shard resumes from (`newest` of its directory), or None."""
    return newest(shard_dir(root, layout))


def newest(directory: str) -> str | None:
    """The newest checkpoint in `directory` (a shard's or a partition's) that verifies,
    after recovering what a killed save left; each newer one it passes over is logged
    with why. None: the directory holds no checkpoint. CheckpointError naming every
    one: it holds some, and none verifies."""
    path, skipped = checkpoint.latest_valid(directory)
    for bad, why in skipped:
        log.warning("--resume: skipped %s (%s)", bad, why)
    if path is None and skipped:
        raise CheckpointError(f"no checkpoint in {directory} verifies: "
                              + "; ".join(f"{bad}: {why}" for bad, why in skipped))
    return path


def load_partition(path: str, optimizer: str,
                   layout_of: Callable[[dict], ShardLayout]) -> tuple[dict, dict]:
    """(partition, state) of the partition checkpoint at `path`: the {"id", "count",
    "specs"} it was saved with, and its state checked against layout_of(partition)
    (the layout those specs give this shard) and the optimizer."""
    arrays, meta = checkpoint.load(path)
    try:
        p = meta["partition"]
        partition = {"id": int(p["id"]), "count": int(p["count"]), "specs": str(p["specs"])}
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{os.path.join(path, 'meta.json')}: not a partition "
                              f"checkpoint ({e!r})") from None
    return partition, _state(path, arrays, meta, layout_of(partition), optimizer)


def load(path: str, layout: ShardLayout, optimizer: str) -> dict:
    """The state saved at `path`, checked against this shard's layout and optimizer."""
    arrays, meta = checkpoint.load(path)
    return _state(path, arrays, meta, layout, optimizer)


def _state(path: str, arrays: dict, meta: dict, layout: ShardLayout, optimizer: str) -> dict:
    where = os.path.join(path, "meta.json")
    try:
        saved, version = meta["layout"], int(meta["version"])
        saved_optimizer = meta["config"]["optim"]["optimizer"]
        steps, workers = int(meta["optimizer_steps"]), meta["workers"]
        params = arrays["params"]
        pending = None
        if "round" in meta:
            pending = {"total": arrays["round"], "contributors": {
                int(w): (int(step), int(read)) for w, (step, read) in meta["round"].items()}}
            if "round_covered" in meta:
                pending["covered"] = [(int(lo), int(hi)) for lo, hi in meta["round_covered"]]
        staleness = StalenessLog.from_dict(meta.get("staleness", {"shard": {}, "workers": {}}))
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{where}: not a parameter-server checkpoint ({e!r})") from None
    if saved != _layout(layout):
        raise CheckpointError(f"{where}: checkpoint is of {saved}, this server is "
                              f"{_layout(layout)}")
    if saved_optimizer != optimizer:
        raise CheckpointError(f"{where}: written with --optimizer {saved_optimizer}, this "
                              f"server runs {optimizer}")
    if params.shape != (layout.length,):
        raise CheckpointError(f"{os.path.join(path, 'params.npy')}: shape {params.shape}, the "
                              f"shard holds ({layout.length},)")
    opt = {k[len("opt."):]: v for k, v in arrays.items() if k.startswith("opt.")}
    return {"version": version, "params": params, "optimizer": {"steps": steps, **opt},
            "workers": {int(w): s for w, s in workers.items()},
            "staleness": staleness.to_dict(), "round": pending}
