"""Randomized faults on two replicated shards (tests/support/faults.py), bounded: one seed,
five faults (kill -9, SIGSTOP/SIGCONT of a primary or a backup, the backup paused twice, a
cut of the backup's link to its primary, a cut of both replicas' links to each other)
while three workers push; after the run every acknowledged push is applied exactly once,
nothing that was not sent is, no moment had two primaries, and no daemon but a killed one
had to be restarted (a dropped or replaced replica rejoins by itself). The long version:
`python tests/support/faults.py --runs N`."""

from __future__ import annotations

import pytest
from support import faults


# seed 6 draws kill-primary, cut-both, pause-backup-twice | kill-backup, cut;
# more seeds: python tests/support/faults.py --runs N
@pytest.mark.parametrize("seed", [6])
def test_random_faults_lose_nothing_and_never_make_two_primaries(tmp_path, seed):
    out = faults.run(tmp_path, seed, faults=5, workers=3)
    print(f"seed {seed}: {out.line()}", flush=True)
    assert not out.errors, out.errors
    assert sum(out.faults.values()) == 5 and out.acked > 100
    assert {"cut", "cut-both", "kill-primary", "kill-backup"} <= set(out.faults), out.faults
    assert (out.lost, out.duplicated, out.stray, out.split_brain) == (0, 0, 0, 0)
    assert out.restarted == 0  # dropped and replaced replicas rejoined by themselves
