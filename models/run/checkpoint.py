"""Checkpoints: one directory per step, written whole or not at all.

    <root>/step-00000120/
        meta.json        step, config, data position, file digests
        params.npy       the flat parameter buffer
        opt.<name>.npy   each optimizer state buffer

The directory is written under a temporary name and renamed into place, so
a crash while saving never leaves a half checkpoint under a real name, and
the previous checkpoint is untouched. Every array file's SHA-256 is recorded
in meta.json and verified on load; a mismatch or a missing file raises
CheckpointError naming the file.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile

import numpy as np

from dtlab.models import backend

_STEP_DIR = re.compile(r"^step-(\d{8})$")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or corrupt."""


def _digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def save(root: str, step: int, arrays: dict, meta: dict) -> str:
    """Write arrays (name -> array) and meta (JSON-able) as <root>/step-NNNNNNNN."""
    os.makedirs(root, exist_ok=True)
    final = os.path.join(root, step_dir(step))
    tmp = tempfile.mkdtemp(prefix=f".step-{step:08d}.", dir=root)
    try:
        digests = {}
        for name, array in arrays.items():
            path = os.path.join(tmp, f"{name}.npy")
            np.save(path, backend.to_host(array), allow_pickle=False)
            digests[f"{name}.npy"] = _digest(path)
        with open(os.path.join(tmp, "meta.json"), "w") as f:
            json.dump({**meta, "step": step, "files": digests}, f, indent=1)
        for path in os.listdir(tmp):
            with open(os.path.join(tmp, path), "rb") as f:
                os.fsync(f.fileno())
        if os.path.exists(final):
            shutil.rmtree(final)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def step_dir(step: int) -> str:
    return f"step-{step:08d}"


def step_of(path: str) -> int:
    """The step of a checkpoint directory's path."""
    return int(_STEP_DIR.match(os.path.basename(path)).group(1))


def latest(root: str) -> str | None:
    """The newest complete checkpoint directory under root, or None."""
    if not os.path.isdir(root):
        return None
    steps = sorted(d for d in os.listdir(root) if _STEP_DIR.match(d))
    return os.path.join(root, steps[-1]) if steps else None


def load(path: str) -> tuple[dict, dict]:
    """(arrays, meta) of the checkpoint at `path`, every file verified."""
    meta_path = os.path.join(path, "meta.json")
    try:
        with open(meta_path) as f:
            meta = json.load(f)
        files = meta["files"]
    except (OSError, ValueError, KeyError) as e:
        raise CheckpointError(f"{meta_path}: unreadable checkpoint metadata ({e})") from e
    arrays = {}
    for fname, digest in files.items():
        fpath = os.path.join(path, fname)
        if not os.path.exists(fpath):
            raise CheckpointError(f"{fpath}: missing from checkpoint")
        if _digest(fpath) != digest:
            raise CheckpointError(f"{fpath}: checksum mismatch, the file is corrupt")
        arrays[fname[: -len(".npy")]] = np.load(fpath, allow_pickle=False)
    return arrays, meta
