"""The quantized ring all-reduce (collective/algorithms/quantized_ring.py, dtlab-sync
--quantize-grads int8|int4): every element within its bound of the direct sum at N = 1..4
(tests/support/mpi_progs/quantized_check.py); its error feedback's residual what the
rank's quantizations dropped, and over 64 steps of a constant gradient the results' mean
within |sum of residuals| / 64 of the exact sum, 10x closer than without feedback
(quantized_feedback_check.py, N = 3); training through it at dp 2 near plain data
parallelism (int8 closer than int4, int4 closer with error feedback than without), its
bytes what the ring's schedule sends; --no-quantize-error-feedback refused without
--quantize-grads."""

from __future__ import annotations

import pytest
from support.mpirun import mpirun
from test_local_sgd import MLP, rel, run_cases

from dtlab.collective.train import parse_args
from dtlab.models import quantize
from dtlab.models.config import ConfigError
from dtlab.models.run.metrics import read_metrics

pytestmark = pytest.mark.usefixtures("mpiexec")


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_every_element_within_its_bound_of_the_direct_sum(n):
    r = mpirun(n, "tests/support/mpi_progs/quantized_check.py", timeout=120)
    assert r.rc == 0, r


def test_error_feedback_keeps_what_was_dropped_and_removes_the_bias():
    r = mpirun(3, "tests/support/mpi_progs/quantized_feedback_check.py", timeout=120)
    assert r.rc == 0, r


def test_training_through_the_quantized_ring_stays_near_plain_data_parallelism(tmp_path):
    run = [*MLP, "--optimizer", "adamw", "--lr", "3e-3", "--steps", "20"]
    metrics = tmp_path / "q4.jsonl"
    got = run_cases(tmp_path, 2, [
        {"name": "plain", "argv": run},
        {"name": "int8", "argv": [*run, "--quantize-grads", "int8"]},
        {"name": "int4", "argv": [*run, "--quantize-grads", "int4", "--metrics",
                                  str(metrics)]},
        {"name": "int4_noef", "argv": [*run, "--quantize-grads", "int4",
                                       "--no-quantize-error-feedback"]}])
    assert 0 < rel(got["int8"], got["plain"]) < rel(got["int4"], got["plain"]) < 0.05
    # error feedback brings int4 nearer plain (measured: 0.0120 against 0.0164 relative)
    assert rel(got["int4"], got["plain"]) < rel(got["int4_noef"], got["plain"]) < 0.05
    header, records = read_metrics(str(metrics))
    n = header["n_params"]
    half = -(-n // 2)  # dp 2: one segment each way in each half of the ring
    per_step = quantize.payload_bytes(half, 4) + quantize.payload_bytes(n - half, 4)
    assert {r["sent_bytes"] for r in records} == {per_step}


def test_error_feedback_flag_is_refused_without_the_quantized_ring():
    with pytest.raises(ConfigError, match="has no effect without --quantize-grads"):
        parse_args(["--model", "mlp", "--no-quantize-error-feedback"])
