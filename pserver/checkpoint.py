"""Shard checkpoints on top of models.checkpoint (atomic, digest-verified directories).

    CHECKPOINT_DIR/shard-<i>-of-<S>/step-<version>/
        params.npy            the shard's parameters
        opt.<name>.npy        each optimizer state buffer (moments, velocity)
        meta.json             version, layout, full config, worker clocks and
                              next steps, optimizer steps, file digests

The step of the directory is the shard's version. Gradients waiting in an
unfinished BSP round are not saved; the workers' steps are rolled back
instead (ShardStore.state), so a restarted server accepts them again.
`load` raises models.checkpoint.CheckpointError naming the file for a
missing or corrupt file, and for a checkpoint of another shard or optimizer.
"""

from __future__ import annotations

import os

from models import checkpoint
from models.checkpoint import CheckpointError
from pserver.store import ShardLayout


def shard_dir(root: str, layout: ShardLayout) -> str:
    return os.path.join(root, f"shard-{layout.shard}-of-{layout.num_shards}")


def _layout(layout: ShardLayout) -> dict:
    return {"model": layout.model, "model_size": layout.model_size, "shard": layout.shard,
            "num_shards": layout.num_shards, "layout_crc32": layout.layout_crc}


def save(root: str, layout: ShardLayout, state: dict, config: dict) -> str:
    """Write `state` (ShardStore.state()) as the checkpoint of its version; returns its path."""
    opt = state["optimizer"]
    arrays = {"params": state["params"],
              **{f"opt.{k}": v for k, v in opt.items() if k != "steps"}}
    meta = {"layout": _layout(layout), "version": state["version"],
            "optimizer_steps": int(opt["steps"]),
            "workers": {str(w): s for w, s in state["workers"].items()}, "config": config}
    return checkpoint.save(shard_dir(root, layout), state["version"], arrays, meta)


def latest(root: str, layout: ShardLayout) -> str | None:
    return checkpoint.latest(shard_dir(root, layout))


def load(path: str, layout: ShardLayout, optimizer: str) -> dict:
    """The state saved at `path`, checked against this shard's layout and optimizer."""
    arrays, meta = checkpoint.load(path)
    where = os.path.join(path, "meta.json")
    try:
        saved, version = meta["layout"], int(meta["version"])
        saved_optimizer = meta["config"]["optim"]["optimizer"]
        steps, workers = int(meta["optimizer_steps"]), meta["workers"]
        params = arrays["params"]
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
            "workers": {int(w): s for w, s in workers.items()}}
