"""The single-process twin of a parallel run: its final parameters, trained by dtlab-train."""

from __future__ import annotations

import numpy as np

from dtlab.models.run import checkpoint
from support.mpirun import mpirun


def single_params(tmp_path, argv: list, steps: int, name: str = "single") -> np.ndarray:
    """`dtlab-train` on `argv` (which runs `steps` steps) in one process; the flat
    parameters it saved at the end, read from its checkpoint under tmp_path/name."""
    ck = str(tmp_path / name)
    r = mpirun(1, "-m", "dtlab.models.run.train", *argv, "--checkpoint-dir", ck,
               "--checkpoint-every", str(steps), timeout=120)
    assert r.rc == 0, r
    return checkpoint.load(checkpoint.latest(ck))[0]["params"]
