"""A save killed with -9 at any point leaves a whole checkpoint of every step it had.

A real `checkpoint.save` runs in a child process that replaces an existing
checkpoint of the same step (the same version saved again, --keep 1). An
audit hook of the child (sys.addaudithook: the interpreter's own events for
os.rename, shutil.rmtree and open, raised before the call runs) stops it with
SIGSTOP (to the calling thread) right before one step of the save; the test looks at what is on disk
at that moment, kills the child with SIGKILL and reads the directory as a
resuming trainer or daemon does (`latest_valid`, which recovers it first).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from support.pserver_util import ROOT

from dtlab.models.run import checkpoint

STEP = 5
CHILD = r"""
import re, signal, sys, threading
import numpy as np
from dtlab.models.run import checkpoint

root, event, pattern = sys.argv[1], sys.argv[2], re.compile(sys.argv[3])

def freeze(name, args):
    if name == event and args and pattern.search(str(args[0])):
        signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)  # killed here

sys.addaudithook(freeze)
checkpoint.save(root, int(sys.argv[4]), {"params": np.full(1000, 2.0)}, {"note": "new"}, keep=1)
"""
NEW_TMP = rf"/\.step-{STEP:08d}\.[^/]+"
# (event, its first argument, what is on disk when the save stops right there, the
# values the recovered checkpoint holds: 1.0 the old save's, 2.0 the new one's)
POINTS = {
    "while writing": ("open", NEW_TMP + r"/meta\.json$", {"step", ".step"}, 1.0),
    "before moving the old one aside": ("os.rename", rf"/step-{STEP:08d}$",
                                        {"step", ".step", ".replaced"}, 1.0),
    "between the two renames": ("os.rename", NEW_TMP + "$", {".step", ".replaced"}, 1.0),
    "before removing the old one": ("shutil.rmtree", r"/\.replaced-", {"step", ".replaced"},
                                    2.0),
}


def kinds(root) -> set[str]:
    return {name.split("-")[0] for name in os.listdir(root)}


def stopped(proc: subprocess.Popen, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pid, status = os.waitpid(proc.pid, os.WNOHANG | os.WUNTRACED)
        if pid and os.WIFSTOPPED(status):
            return
        if pid:
            raise AssertionError(f"the saving process ended ({status:#x}) before the point")
        time.sleep(0.01)
    raise TimeoutError("the saving process never reached the point")


@pytest.mark.parametrize("point", list(POINTS))
def test_a_save_killed_at_each_step_leaves_the_step_whole(tmp_path, caplog, point):
    event, where, on_disk, want = POINTS[point]
    root = tmp_path / "ckpt"
    checkpoint.save(str(root), STEP, {"params": np.full(1000, 1.0)}, {"note": "old"})
    proc = subprocess.Popen([sys.executable, "-c", CHILD, str(root), event, where, str(STEP)],
                            cwd=ROOT)
    try:
        stopped(proc)
        assert kinds(root) == on_disk  # "between the two renames": no step-* at all
        proc.kill()
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL

    with caplog.at_level(logging.WARNING, logger="dtlab.models.run.checkpoint"):
        path, skipped = checkpoint.latest_valid(str(root))
    assert (path, skipped) == (str(root / checkpoint.step_dir(STEP)), [])
    arrays, meta = checkpoint.load(path)
    np.testing.assert_array_equal(arrays["params"], np.full(1000, want))
    assert meta["note"] == ("new" if want == 2.0 else "old")
    assert os.listdir(root) == [checkpoint.step_dir(STEP)]  # nothing else left behind
    said = caplog.text
    assert ("put back from" in said) == (".replaced" in on_disk and "step" not in on_disk)
    assert ("an unfinished save" in said) == (".step" in on_disk)


def test_a_trainer_resuming_where_a_save_was_killed_says_what_it_recovered(tmp_path):
    """dtlab-train --resume in a directory as the kills above leave it: the checkpoint moved
    aside between the renames is put back and resumed from, the unfinished save removed."""
    root = tmp_path / "ckpt"
    flags = [sys.executable, "-m", "dtlab.models.run.train", "--model", "mlp", "--d-in", "4",
             "--d-hidden", "8", "--n-layers", "1", "--n-classes", "3", "--batch-size", "8",
             "--checkpoint-dir", str(root), "--checkpoint-every", "2"]
    subprocess.run([*flags, "--steps", "4"], cwd=ROOT, check=True, capture_output=True,
                   timeout=120)
    aside = root / ".replaced-step-00000004.k1"
    aside.mkdir()
    (root / "step-00000004").rename(aside / "old")
    (root / ".step-00000005.k2").mkdir()
    run = subprocess.run([*flags, "--steps", "6", "--resume"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert f"{root}/step-00000004: put back from {aside}" in run.stderr
    assert f"{root}/.step-00000005.k2: removed (an unfinished save" in run.stderr
    assert "resumed from step 4" in run.stderr
    assert sorted(os.listdir(root)) == ["step-00000002", "step-00000004", "step-00000006"]
