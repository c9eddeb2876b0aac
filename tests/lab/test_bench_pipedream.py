"""dtlab.lab.bench.pipedream runs at a tiny size, so it cannot rot: its rows carry the
formulas' bubbles, the weight versions each rank keeps and the measured figures."""

import pytest

from dtlab.models.pipedream import bubble_2bw
from dtlab.models.schedule import bubble_formula

pytestmark = pytest.mark.usefixtures("mpiexec")


def test_tiny_pipedream_benchmark(tiny_bench):
    r = tiny_bench("pipedream")
    assert r.rc == 0, r
    assert "# legend: ms = wall time of the K steps" in r.stdout
    flush, two = r.data["rows"]
    assert (flush["method"], two["method"]) == ("flush", "2bw")
    p, m, K = two["pp"], two["microbatches"], two["window"]
    assert flush["bubble_formula"] == bubble_formula("1f1b", p, m)
    assert two["bubble_formula"] == bubble_2bw(p, m, K) < flush["bubble_formula"]
    assert flush["version_bytes"] == [0] * p and min(two["version_bytes"]) > 0
    assert (flush["versions"], two["versions"]) == (1, 2)
    for row in (flush, two):
        assert row["ms"] > 0 and 0 <= row["bubble"] < 1 and 0 <= row["bubble_expected"] < 1
