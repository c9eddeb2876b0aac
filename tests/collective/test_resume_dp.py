"""A dense data-parallel run resumes into another dp size: the data goes on at the example
where it stopped, and the trainer says what is no longer the uninterrupted run."""

import pytest
from support.mpirun import mpirun

from dtlab.models.run import checkpoint

pytestmark = pytest.mark.usefixtures("mpiexec")

ARGV = ["-m", "dtlab.collective.train", "--model", "mlp", "--d-in", "8", "--n-classes", "4",
        "--d-hidden", "32", "--n-samples", "4096", "--batch-size", "8", "--seed", "2"]


def test_resume_into_another_dp_size_goes_on_at_the_next_example(tmp_path):
    ck = ["--checkpoint-dir", tmp_path / "ck", "--checkpoint-every", "4"]
    r = mpirun(2, *ARGV, *ck, "--steps", "4", wrap=False, timeout=60)
    assert r.rc == 0, r
    r = mpirun(1, *ARGV, *ck, "--steps", "8", "--resume", wrap=False, timeout=60)
    assert r.rc == 0, r
    assert ("resumed with dp 1; the checkpoint was written with dp 2: the global batch is now 8 "
            "(was 16) and the data goes on from example 64 of epoch 0") in r.stderr, r
    _, meta = checkpoint.load(checkpoint.latest(str(tmp_path / "ck")))
    assert meta["dp"] == 1 and meta["loader"]["position"] == 64 + 4 * 8
