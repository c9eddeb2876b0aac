"""dtlab.lab.bench.together runs at a tiny size under mpiexec, so it cannot rot, and its
figures hold together: a step's makespan covers every process's step in it."""


import pytest
from support.bench_runs import check_shape, run
from support.mpirun import mpirun

pytestmark = pytest.mark.usefixtures("mpiexec")


@pytest.mark.parametrize("role", ["rank", "worker"])
def test_tiny_together_benchmark(tmp_path, role, tiny_bench):
    r = tiny_bench("together") if role == "rank" else run("together", tmp_path, "--role", role)
    assert r.rc == 0, r
    assert "# legend: alone:" in r.stdout and "makespan" in r.stdout  # legend and header
    data = r.data
    check_shape(data, "together")
    (row,) = data["rows"]
    assert row["ranks"] == 2 and row["role"] == role and row["model"] == "mlp"
    steps = len(row["makespan_s_samples"])
    assert steps == 3 and len(row["alone_s_samples"]) == 3
    walls = row["wall_s_samples"]  # rank 0's steps, then rank 1's
    assert len(walls) == len(row["cpu_s_samples"]) == 2 * steps
    for k, makespan in enumerate(row["makespan_s_samples"]):
        assert makespan >= max(walls[k], walls[steps + k]) > 0
    assert all(0 <= c <= w + 1e-3 for c, w in zip(row["cpu_s_samples"], walls, strict=True))
    assert row["flops_step"] > 0 and row["threads"] >= 1


def test_bad_flags_are_named():
    r = mpirun(1, "-m", "dtlab.lab.bench.together", "--tiny", "--reps", "0", timeout=60)
    assert r.rc != 0 and "--reps must be at least 1" in r.stderr, r
