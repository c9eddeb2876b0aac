"""The quantized ring all-reduce (collective/algorithms/quantized_ring.py, dtlab-sync
--quantize-grads int8|int4): every element within its bound of the direct sum at N = 1..4
(tests/support/mpi_progs/quantized_check.py), and training through it at dp 2 near plain
data parallelism (int8 closer than int4), its bytes what the ring's schedule sends."""

from __future__ import annotations

import pytest
from support.mpirun import mpirun
from test_local_sgd import MLP, rel, run_cases

from dtlab.models import quantize
from dtlab.models.run.metrics import read_metrics

pytestmark = pytest.mark.usefixtures("mpiexec")


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_every_element_within_its_bound_of_the_direct_sum(n):
    r = mpirun(n, "tests/support/mpi_progs/quantized_check.py", timeout=120)
    assert r.rc == 0, r


def test_training_through_the_quantized_ring_stays_near_plain_data_parallelism(tmp_path):
    run = [*MLP, "--optimizer", "adamw", "--lr", "3e-3", "--steps", "20"]
    metrics = tmp_path / "q4.jsonl"
    got = run_cases(tmp_path, 2, [
        {"name": "plain", "argv": run},
        {"name": "int8", "argv": [*run, "--quantize-grads", "int8"]},
        {"name": "int4", "argv": [*run, "--quantize-grads", "int4", "--metrics",
                                  str(metrics)]}])
    assert 0 < rel(got["int8"], got["plain"]) < rel(got["int4"], got["plain"]) < 0.05
    header, records = read_metrics(str(metrics))
    n = header["n_params"]
    half = -(-n // 2)  # dp 2: one segment each way in each half of the ring
    per_step = quantize.payload_bytes(half, 4) + quantize.payload_bytes(n - half, 4)
    assert {r["sent_bytes"] for r in records} == {per_step}
