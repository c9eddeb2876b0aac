"""1-bit Adam on the sync topology (dtlab-sync --onebit-adam W; collective/reducers/onebit_adam.py)
against the cases it reduces to.

- W >= --steps: every step is a warm-up step, plain data-parallel AdamW bit for bit.
- W < --steps: equal to a single process running the two replicas from the definition
  (tests/support/mpi_progs/method_cases.py, onebit_twin: the momentum's signs with error
  feedback, their mean, the frozen variance), bit for bit in float64 (in float32 an ulp
  apart here and there: measured 1.2e-8 relative, the twin's expressions round otherwise).
- Each compressed step sends one payload (the scale and n bits) to the other rank, and
  the flags it cannot go with are refused by name.
"""

from __future__ import annotations

import numpy as np
import pytest
from test_local_sgd import MLP, rel, run_cases

from dtlab.collective.train import parse_args
from dtlab.models.config import ConfigError
from dtlab.models.run.metrics import read_metrics

pytestmark = pytest.mark.usefixtures("mpiexec")

ADAMW = ["--optimizer", "adamw", "--lr", "3e-3", "--weight-decay", "0.01"]


def test_onebit_adam_reduces_to_adam_and_equals_its_one_process_twin(tmp_path):
    run = [*MLP, *ADAMW, "--steps", "12"]
    onebit = [*run, "--onebit-adam", "4"]
    f64 = [*onebit, "--dtype", "float64"]
    metrics = tmp_path / "onebit.jsonl"
    got = run_cases(tmp_path, 2, [
        {"name": "adam", "argv": run},
        {"name": "all_warmup", "argv": [*run, "--onebit-adam", "12"]},
        {"name": "onebit", "argv": [*onebit, "--metrics", str(metrics)]},
        {"name": "onebit_twin", "argv": onebit, "onebit_twin": 2},
        {"name": "onebit64", "argv": f64},
        {"name": "onebit64_twin", "argv": f64, "onebit_twin": 2}])
    assert np.array_equal(got["all_warmup"], got["adam"])
    assert np.array_equal(got["onebit64"], got["onebit64_twin"])
    assert rel(got["onebit"], got["onebit_twin"]) < 1e-6
    assert rel(got["onebit"], got["adam"]) > 1e-4  # another training after the warm-up
    header, records = read_metrics(str(metrics))
    n = header["n_params"]
    assert [r.get("onebit") for r in records] == [0] * 4 + [1] * 8
    assert {r["sent_bytes"] for r in records[4:]} == {4 + -(-n // 8)}  # dp 2: one payload


def test_onebit_adam_is_refused_where_it_cannot_run():
    base = [*MLP, "--steps", "10"]
    for extra, why in ((["--onebit-adam", "4", "--optimizer", "sgd"], "needs|give --optimizer"),
                       ([*ADAMW, "--onebit-adam", "4", "--local-steps", "2"],
                        "one of them at a time"),
                       ([*ADAMW, "--onebit-adam", "-1"], "must not be negative")):
        with pytest.raises(ConfigError, match=why):
            parse_args([*base, *extra])
