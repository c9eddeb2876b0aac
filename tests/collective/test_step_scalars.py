"""A dtlab-sync step's scalars, the loss average and the stop agreement, in one all-reduce.

Counted by the flight recorder (collective/transport/flight.py) on real MPI ranks
(tests/support/mpi_progs/step_scalars.py): plain data parallelism issues one 24-byte
float64 all-reduce a step over the dp ranks ([loss, SIGTERM count, SIGINT count]),
where the trainer without step scalars issues two (the loss's 8 bytes over dp, the
counts' 16 over the world), and logs the same losses bit for bit (3 ranks: the sum's
order matters). On a pp grid the loss is averaged over each stage's dp ranks and the
agreement must reach every rank: two calls stay (collective/reducers/exchange.py).
"""

import json

import pytest
from support.mpirun import mpirun

pytestmark = pytest.mark.usefixtures("mpiexec")

PROG = "tests/support/mpi_progs/step_scalars.py"
MLP = ["--model", "mlp", "--d-in", "8", "--n-classes", "4", "--d-hidden", "32", "--seed", "4",
       "--log-every", "20"]
STEPS = 3


def scalar_calls(tmp_path, ranks: int, *flags: str, modes: str = "one") -> dict:
    """Per mode (a comma list, trained one after the other in one MPI job): the run's
    losses and every rank's MPI all-reduces."""
    out, metrics = tmp_path / f"{modes}{'-'.join(flags)}.json", tmp_path / "m.jsonl"
    r = mpirun(ranks, PROG, str(out), modes, *flags, *MLP, "--steps", str(STEPS), "--metrics",
               str(metrics), timeout=120)
    assert r.rc == 0, r
    return json.loads(out.read_text())


def test_one_scalar_allreduce_a_step_with_the_losses_bit_for_bit(tmp_path):
    got = scalar_calls(tmp_path, 3, modes="one,apart")  # both trainers, one launch
    one, apart = got["one"], got["apart"]
    assert one["calls"] == [[["dp", 24, "float64"]] * STEPS] * 3
    assert apart["calls"] == [[["dp", 8, "float64"], ["world", 16, "int64"]] * STEPS] * 3
    assert len(one["losses"]) == STEPS and one["losses"] == apart["losses"]


def test_a_pipeline_grid_averages_over_dp_and_agrees_over_the_world(tmp_path):
    got = scalar_calls(tmp_path, 2, "--pp", "2")["one"]
    assert got["calls"] == [[["dp", 8, "float64"], ["world", 16, "int64"]] * STEPS] * 2
