"""Checkpoints are atomic, verified, and a corrupt one names its file."""

import os

import numpy as np
import pytest

from dtlab.models.run import checkpoint
from dtlab.models.run.checkpoint import CheckpointError


def test_round_trip_and_latest(tmp_path):
    root = str(tmp_path)
    assert checkpoint.latest(root) is None
    checkpoint.save(root, 10, {"params": np.arange(5.0)}, {"note": "a"})
    path = checkpoint.save(root, 20, {"params": np.arange(6.0), "opt.m": np.ones(6)}, {"note": "b"})
    assert checkpoint.latest(root) == path
    arrays, meta = checkpoint.load(path)
    np.testing.assert_array_equal(arrays["params"], np.arange(6.0))
    np.testing.assert_array_equal(arrays["opt.m"], np.ones(6))
    assert meta["step"] == 20 and meta["note"] == "b"
    assert not [d for d in os.listdir(root) if d.startswith(".")]  # no temporaries left


def test_corrupt_file_is_named_and_older_checkpoint_survives(tmp_path):
    root = str(tmp_path)
    first = checkpoint.save(root, 1, {"params": np.arange(4.0)}, {})
    second = checkpoint.save(root, 2, {"params": np.arange(4.0) + 1}, {})
    with open(os.path.join(second, "params.npy"), "r+b") as f:
        f.seek(-3, os.SEEK_END)
        f.write(b"\x00\x01\x02")
    with pytest.raises(CheckpointError, match="params.npy: checksum mismatch"):
        checkpoint.load(second)
    arrays, _ = checkpoint.load(first)
    np.testing.assert_array_equal(arrays["params"], np.arange(4.0))
    os.remove(os.path.join(first, "meta.json"))
    with pytest.raises(CheckpointError, match="meta.json"):
        checkpoint.load(first)


def test_failed_save_leaves_nothing_behind(tmp_path):
    with pytest.raises(TypeError, match="not JSON serializable"):
        checkpoint.save(str(tmp_path), 5, {"params": np.zeros(3)}, {"bad": object()})
    assert os.listdir(tmp_path) == []
