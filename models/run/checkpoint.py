"""Checkpoints: one directory per step, written whole or not at all.

    <root>/step-00000120/
        meta.json        the manifest: format, step, config, data position,
                         every file's size and SHA-256
        params.npy       the flat parameter buffer
        opt.<name>.npy   each optimizer state buffer

The directory is written under a temporary name (.step-NNNNNNNN.*), synced,
and renamed into place, so a crash while saving never leaves a half
checkpoint under a real name, and the previous checkpoints are untouched.
A save of a step that already has a checkpoint (the same version saved
again) moves the old directory aside (.replaced-step-NNNNNNNN.*/old), renames
the new one in, then removes the old one: a process killed between the two
renames leaves no step-NNNNNNNN but a whole copy aside. `recover` puts that
copy back and removes what killed saves left (their temporary directories,
the replaced or pruned copies they had not removed yet), saying so in the
log; `latest_valid` and `save` run it first, so every process starting in a
directory (a trainer's or a daemon's resume, or its first save) finds a
whole checkpoint for every step it had, and no leftovers. It assumes no other
process is saving in the directory at the time (one writer per directory).
Every file's size and SHA-256 are recorded in the manifest and verified on
load; `problem()` says what is wrong with a directory, naming the file:

    meta.json: missing (not a dtlab checkpoint, or its manifest was lost)
    meta.json: not a dtlab checkpoint manifest (no "files" and "step")
    params.npy: truncated (4096 of 8320 bytes)
    params.npy: checksum mismatch, the file is corrupt

`latest_valid` verifies the step directories newest first and returns the
first sound one together with every one it skipped and why (a truncated or
corrupt file, a foreign directory, an unfinished save it could not remove),
so a resume never starts from a damaged state and never silently drops the
newest good one.
`save(..., keep=K)` keeps the K newest checkpoints that verify (the one just
written among them) and removes older ones; a directory that is not a dtlab
checkpoint is never removed or replaced.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile

import numpy as np

from dtlab.models import backend

FORMAT = "dtlab-checkpoint/1"
MANIFEST = "meta.json"
_STEP_DIR = re.compile(r"^step-(\d{8})$")
_UNFINISHED = re.compile(r"^\.step-(\d{8})\.")  # save()'s temporary directory
_REPLACED = re.compile(r"^\.replaced-step-(\d{8})\.")  # _replace's copy moved aside
_PRUNED = re.compile(r"^\.pruned-step-(\d{8})\.")  # _prune's copy on its way out

log = logging.getLogger(__name__)


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, corrupt or not a dtlab checkpoint."""


def _digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _sync_dir(path: str) -> None:
    """Make renames within `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(root: str, step: int, arrays: dict, meta: dict, keep: int | None = None) -> str:
    """Write arrays (name -> array) and meta (JSON-able) as <root>/step-NNNNNNNN.

    An older dtlab checkpoint of the same step is replaced; a directory of that
    name that is not one is refused (CheckpointError) before anything is
    written. keep: after the save, keep the `keep` newest checkpoints that
    verify and remove the older ones (None: keep all).
    """
    if keep is not None and keep < 1:
        raise ValueError(f"checkpoint keep must be at least 1 (got {keep}): the checkpoint "
                         f"just written is always kept")
    os.makedirs(root, exist_ok=True)
    recover(root)
    final = os.path.join(root, step_dir(step))
    if os.path.lexists(final):
        _, why = _manifest(final)
        if why is not None:
            raise CheckpointError(f"{final} exists and is not a dtlab checkpoint ({why}); "
                                  f"not replacing it, nothing was written")
    tmp = tempfile.mkdtemp(prefix=f".{step_dir(step)}.", dir=root)
    try:
        digests, sizes = {}, {}
        for name, array in arrays.items():
            path = os.path.join(tmp, f"{name}.npy")
            np.save(path, backend.to_host(array), allow_pickle=False)
            digests[f"{name}.npy"] = _digest(path)
            sizes[f"{name}.npy"] = os.path.getsize(path)
        with open(os.path.join(tmp, MANIFEST), "w") as f:
            json.dump({**meta, "format": FORMAT, "step": step, "files": digests,
                       "sizes": sizes}, f, indent=1)
        for path in os.listdir(tmp):
            with open(os.path.join(tmp, path), "rb") as f:
                os.fsync(f.fileno())
        _replace(root, tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if keep is not None:
        _prune(root, step, keep)
    return final


def _replace(root: str, tmp: str, final: str) -> None:
    """Rename `tmp` to `final`; an existing `final` is moved aside first (into
    .replaced-<name>.*/old) and removed after, so that the name holds a whole checkpoint
    or none, and where it holds none (killed between the renames) `recover` finds the
    whole copy aside."""
    aside = None
    if os.path.lexists(final):
        aside = tempfile.mkdtemp(prefix=f".replaced-{os.path.basename(final)}.", dir=root)
        os.rename(final, os.path.join(aside, "old"))
    os.rename(tmp, final)
    _sync_dir(root)
    if aside is not None:
        shutil.rmtree(aside)


def _prune(root: str, step: int, keep: int) -> None:
    """Keep the checkpoint of `step` and the keep - 1 newest older ones that verify;
    remove every dtlab checkpoint older than the oldest kept (a corrupt one between
    kept ones stays, for latest_valid to name). Foreign directories stay."""
    kept = 1
    for older in reversed([s for s in _steps(root) if s < step]):
        path = os.path.join(root, step_dir(older))
        if kept < keep:
            kept += int(problem(path) is None)
        elif _manifest(path)[1] is None:
            gone = tempfile.mkdtemp(prefix=f".pruned-{step_dir(older)}.", dir=root)
            os.rename(path, os.path.join(gone, "old"))  # the name goes at once
            shutil.rmtree(gone)


def recover(root: str) -> list[str]:
    """Undo or finish what saves killed in `root` left, and say so (logged, and returned
    one line each): a checkpoint moved aside by a save of the same step killed before
    renaming the new one in is put back under its name; the copy a finished replace or
    prune had not removed yet, and the temporary directory of an unfinished save, are
    removed. For a process starting in `root`: a save in progress there would lose its
    temporary directory. Safe to run from several processes at once (the ranks of one
    trainer): each step is done by one of them."""
    if not os.path.isdir(root):
        return []
    done = []
    names = sorted(os.listdir(root))
    for name in filter(_REPLACED.match, names):
        aside, final = os.path.join(root, name), os.path.join(root, step_dir(
            int(_REPLACED.match(name).group(1))))
        if not os.path.lexists(final):
            if _moved_back(os.path.join(aside, "old"), final):
                _sync_dir(root)
                _removed(aside)
                done.append(f"{final}: put back from {aside} (a save of the same step was "
                            f"killed between moving it aside and renaming the new one in)")
            continue  # else another process put it back, and removes `aside`
        if _removed(aside):
            done.append(f"{aside}: removed (what a save of the same step, killed before it "
                        f"finished, had moved aside)")
    for name in names:
        path = os.path.join(root, name)
        if _UNFINISHED.match(name) and _removed(path):
            done.append(f"{path}: removed (an unfinished save: the writer stopped before "
                        f"renaming it into place)")
        elif _PRUNED.match(name) and _removed(path):
            done.append(f"{path}: removed (an older checkpoint --keep was removing)")
    for line in done:
        log.warning("checkpoint recovery: %s", line)
    return done


def _moved_back(old: str, final: str) -> bool:
    """Rename `old` to `final`; False if another process got there first."""
    try:
        os.rename(old, final)
    except OSError as e:
        if e.errno in (errno.ENOENT, errno.ENOTEMPTY, errno.EEXIST):
            return False
        raise
    return True


def _removed(path: str) -> bool:
    """Remove the directory `path`; whether this call removed it (False: gone already,
    removed by another process, or it could not be removed)."""
    if not os.path.lexists(path):
        return False
    shutil.rmtree(path, ignore_errors=True)
    return not os.path.lexists(path)


def step_dir(step: int) -> str:
    return f"step-{step:08d}"


def step_of(path: str) -> int:
    """The step of a checkpoint directory's path."""
    return int(_STEP_DIR.match(os.path.basename(path)).group(1))


def _steps(root: str) -> list[int]:
    """The steps of the step-NNNNNNNN entries under root, ascending."""
    if not os.path.isdir(root):
        return []
    return sorted(int(m.group(1)) for m in map(_STEP_DIR.match, os.listdir(root)) if m)


def latest(root: str) -> str | None:
    """The newest step directory under root by name (unverified), or None."""
    steps = _steps(root)
    return os.path.join(root, step_dir(steps[-1])) if steps else None


def latest_valid(root: str, at_most: int | None = None) -> tuple[str | None, list]:
    """(path, skipped): the newest checkpoint under root (of a step <= at_most) that
    verifies, or None; skipped: (path, reason) for each newer entry passed over,
    newest first: damaged or foreign step directories, unfinished saves that could not
    be removed. Recovers root first (`recover`): call it where a process starts."""
    if not os.path.isdir(root):
        return None, []
    recover(root)
    entries = []  # (step, is a step directory, path)
    for name in os.listdir(root):
        done, unfinished = _STEP_DIR.match(name), _UNFINISHED.match(name)
        if done or unfinished:
            entries.append((int((done or unfinished).group(1)), bool(done),
                            os.path.join(root, name)))
    skipped = []
    for step, done, path in sorted(entries, reverse=True):
        if at_most is not None and step > at_most:
            continue
        if not done:
            skipped.append((path, "an unfinished save (the writer stopped before renaming it "
                                  "into place)"))
            continue
        why = problem(path)
        if why is None:
            return path, skipped
        skipped.append((path, why))
    return None, skipped


def _manifest(path: str) -> tuple[dict | None, str | None]:
    """(manifest, None) of a dtlab checkpoint directory, or (None, why it is not one)."""
    if not os.path.isdir(path):
        return None, "not a directory, so not a dtlab checkpoint"
    meta_path = os.path.join(path, MANIFEST)
    if not os.path.exists(meta_path):
        return None, f"{MANIFEST}: missing (not a dtlab checkpoint, or its manifest was lost)"
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except (OSError, ValueError) as e:
        return None, f"{MANIFEST}: unreadable ({e})"
    if not isinstance(meta, dict) or not isinstance(meta.get("files"), dict) \
            or not isinstance(meta.get("step"), int):
        return None, f'{MANIFEST}: not a dtlab checkpoint manifest (no "files" and "step")'
    if meta.get("format", FORMAT) != FORMAT:
        return None, f"{MANIFEST}: format {meta['format']!r}, this dtlab reads {FORMAT!r}"
    for fname in meta["files"]:
        if os.path.basename(fname) != fname or fname.startswith("."):
            return None, f"{MANIFEST}: names {fname!r}, which is not a file of the checkpoint"
    named = _STEP_DIR.match(os.path.basename(path))
    if named and int(named.group(1)) != meta["step"]:
        return None, f"{MANIFEST}: says step {meta['step']}, the directory is step {named[1]}"
    return meta, None


def problem(path: str) -> str | None:
    """What is wrong with the checkpoint at `path`, naming the file, or None if it
    verifies (every file present, of its recorded size and SHA-256)."""
    meta, why = _manifest(path)
    if why is not None:
        return why
    sizes = meta.get("sizes", {})  # absent in checkpoints written before sizes were kept
    for fname, digest in meta["files"].items():
        fpath = os.path.join(path, fname)
        if not os.path.isfile(fpath):
            return f"{fname}: missing from checkpoint"
        have, want = os.path.getsize(fpath), sizes.get(fname)
        if want is not None and have < want:
            return f"{fname}: truncated ({have} of {want} bytes)"
        if want is not None and have != want:
            return f"{fname}: {have} bytes, {want} were written"
        if _digest(fpath) != digest:
            return f"{fname}: checksum mismatch, the file is corrupt"
    return None


def load(path: str) -> tuple[dict, dict]:
    """(arrays, meta) of the checkpoint at `path`, every file verified; CheckpointError
    naming the file otherwise."""
    why = problem(path)
    if why is not None:
        raise CheckpointError(f"{path}: {why}")
    meta = _manifest(path)[0]
    arrays = {fname[: -len(".npy")]: np.load(os.path.join(path, fname), allow_pickle=False)
              for fname in meta["files"]}
    return arrays, meta
