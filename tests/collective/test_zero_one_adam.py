"""0/1 Adam on the sync topology (dtlab-sync --zero-one-adam W; collective/reducers/
zero_one_adam.py) against the cases it reduces to, and its schedule.

- kappa and W at least --steps: the variance updated at every step, plain data-parallel
  AdamW bit for bit (1-bit Adam's warm-up path).
- kappa >= W and H = 1: the variance frozen from step W, the signs exchanged every step:
  1-bit Adam --onebit-adam W bit for bit (both run onebit_adam.py's SignAllgather).
- The whole method (variance steps on a doubling interval, 1-bit steps, rounds of local
  steps cut at an evaluation and at the end) equal to a single process running the two
  replicas from the docstring's definition (tests/support/mpi_progs/zero_one_cases.py),
  bit for bit in float64; each step's comm_rounds and sent_bytes those of its kind.
All in one launch of two ranks.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from support.mpirun import mpirun
from test_local_sgd import MLP

from dtlab.collective.reducers.zero_one_adam import (
    LOCAL,
    SYNC,
    VARIANCE,
    ZeroOneConfig,
    zero_one_schedule,
)
from dtlab.collective.train import parse_args
from dtlab.models.config import ConfigError
from dtlab.models.run.metrics import read_metrics

pytestmark = pytest.mark.usefixtures("mpiexec")

ADAMW = ["--optimizer", "adamw", "--lr", "3e-3", "--weight-decay", "0.01"]
# W = 4, kappa 2 (v at steps 1, 2, 4), rounds doubling every 2 steps up to H = 4
POLICY = ["--zero-one-adam", "4", "--zero-one-variance-doubling", "2",
          "--zero-one-local-doubling", "2", "--zero-one-local-max", "4"]
V, S, L = VARIANCE, SYNC, LOCAL
# steps 5, 6: rounds of 1; 7-8: of 2; 9-12: of 4, cut at the evaluation after 10; 13-16
KINDS = [V, V, S, V, S, S, L, S, L, S, L, L, L, S, L, S]


def test_the_schedule_follows_the_stated_policies():
    cfg = ZeroOneConfig(4, 2, 2, 4)
    assert zero_one_schedule(cfg, 16, 10) == KINDS
    assert zero_one_schedule(ZeroOneConfig(100, 16, 32, 16), 100, 0).count(V) == 16 + 16 + 13
    ends_cut = zero_one_schedule(ZeroOneConfig(3, 3, 1, 8), 12, 0)  # rounds of 1, 2, 8 cut
    assert ends_cut == [V] * 3 + [S, L, S] + [L] * 5 + [S]
    assert set(zero_one_schedule(ZeroOneConfig(12, 12, 1, 1), 12, 0)) == {V}


def test_zero_one_adam_reduces_to_adam_and_onebit_adam_and_equals_its_twin(tmp_path):
    run = [*MLP, *ADAMW, "--steps", "12"]
    full = [*MLP, *ADAMW, "--steps", "16", "--eval-every", "10", *POLICY]
    f64 = [*full, "--dtype", "float64"]
    metrics = tmp_path / "zo.jsonl"
    cases = [
        {"name": "adam", "argv": run},
        {"name": "never_frozen", "argv": [*run, "--zero-one-adam", "12",
                                          "--zero-one-variance-doubling", "12"]},
        {"name": "onebit", "argv": [*run, "--onebit-adam", "4"]},
        {"name": "as_onebit", "argv": [*run, "--zero-one-adam", "4",
                                       "--zero-one-variance-doubling", "4",
                                       "--zero-one-local-max", "1"]},
        {"name": "zero_one", "argv": [*full, "--metrics", str(metrics)]},
        {"name": "zero_one64", "argv": f64},
        {"name": "zero_one64_twin", "argv": f64, "twin": 2}]
    path, out = tmp_path / "cases.json", tmp_path / "out.npz"
    path.write_text(json.dumps(cases))
    r = mpirun(2, "tests/support/mpi_progs/zero_one_cases.py", str(path), str(out),
               timeout=120)
    assert r.rc == 0, r
    got = dict(np.load(out))
    assert np.array_equal(got["never_frozen"], got["adam"])
    assert np.array_equal(got["as_onebit"], got["onebit"])
    assert np.array_equal(got["zero_one64"], got["zero_one64_twin"])
    assert not np.array_equal(got["zero_one64"], got["onebit"].astype(np.float64))
    header, records = read_metrics(str(metrics))
    n = header["n_params"]
    assert [r["step"] for r in records] == list(range(1, 17))
    assert [r["comm_rounds"] for r in records] == [int(k != L) for k in KINDS]
    assert [r["variance_update"] for r in records] == [int(k == V) for k in KINDS]
    signs = 4 + -(-n // 8)  # dp 2: the scale and n bits to the other rank
    half = -(-n // 2)
    dense = 4 * half + 4 * (n - half)  # the ring all-reduce: a segment each way, each half
    assert [r["sent_bytes"] for r in records] == [
        {V: dense, S: signs, L: 0}[k] for k in KINDS]


def test_zero_one_adam_is_refused_where_it_cannot_run():
    base = [*MLP, "--steps", "10"]
    for extra, why in (
            (["--zero-one-adam", "4", "--optimizer", "sgd"], "give --optimizer"),
            ([*ADAMW, "--zero-one-adam", "4", "--onebit-adam", "4"], "one of them at a time"),
            ([*ADAMW, "--zero-one-adam", "-1"], "must not be negative"),
            ([*ADAMW, "--zero-one-adam", "4", "--zero-one-local-max", "0"], "at least 1"),
            ([*ADAMW, "--zero-one-local-max", "4"], "has no effect without --zero-one-adam")):
        with pytest.raises(ConfigError, match=why):
            parse_args([*base, *extra])
