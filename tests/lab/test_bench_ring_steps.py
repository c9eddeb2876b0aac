"""dtlab.lab.bench.ring_steps: the ring's per-step cost table at a tiny size, the stamps it
reads (collective/transport/stamps.py) and how one stamped call is split into steps.

The MPI run is the suite's one tiny run of the benchmark (tests/lab/conftest.py's
tiny_bench, shared with tests/lab/test_bench_shape.py): 2 ranks, 16 and 32 KB.
"""

from __future__ import annotations

import pytest

from dtlab.collective.transport.stamps import Stamps, overhead_ns
from dtlab.lab.bench.ring_steps import KINDS, split_call


def test_stamps_record_each_call_and_pass_its_result():
    stamps = Stamps()
    double = stamps.wrap(lambda x, *, k=1: 2 * x * k, "add")
    wait = stamps.wrap(lambda: None, "wait")
    assert double(3, k=2) == 12 and wait() is None
    events = stamps.take()
    assert [e[0] for e in events] == ["add", "wait"]
    assert all(t0 <= t1 for _, t0, t1 in events) and events[0][2] <= events[1][1]
    assert stamps.take() == [] and stamps.events == []
    double(1)  # the wrapper still records into the emptied list
    assert [e[0] for e in stamps.take()] == ["add"]
    assert 0 <= overhead_ns(200) < 1e5


def test_split_call_accounts_every_nanosecond():
    # two steps of one chunk: step 0 waits, adds, posts, starts; step 1 waits
    events = [("post", 10, 14), ("start", 15, 17),  # lead: 100..120
              ("wait", 120, 150), ("add", 151, 171), ("post", 175, 180), ("start", 181, 183),
              ("wait", 190, 230)]
    got = split_call(events, 100, 260, steps=2)
    ns = 1e-9
    assert got["lead"] == [pytest.approx(20 * ns)] and got["tail"] == [pytest.approx(30 * ns)]
    assert got["wait"] == [pytest.approx(30 * ns), pytest.approx(40 * ns)]
    assert got["add"] == [pytest.approx(20 * ns), 0.0]
    assert got["post"][0] == pytest.approx(5 * ns) and got["start"][0] == pytest.approx(2 * ns)
    assert got["step"] == [pytest.approx(70 * ns), pytest.approx(40 * ns)]
    assert got["py"] == [pytest.approx(13 * ns), pytest.approx(0.0)]  # 70 - 57 recorded
    assert got["records"] == [4, 1] and got["chunks"] == [1]
    with pytest.raises(RuntimeError, match="3 waits recorded"):
        split_call(events + [("wait", 240, 250)], 100, 260, steps=2)


@pytest.mark.usefixtures("mpiexec")
def test_tiny_run_prints_every_step_and_right_sums(tiny_bench):
    r = tiny_bench("ring_steps")
    assert r.rc == 0, r
    assert "# Out of bounds values : 0 OK" in r.stdout, r.stdout
    rows = r.data["rows"]
    sizes = sorted({row["bytes"] for row in rows})
    assert sizes == [16384, 32768], sizes
    for size in sizes:
        steps = [row for row in rows if row["table"] == "steps" and row["bytes"] == size]
        assert [row["step"] for row in steps] == ["0", "1", "lead", "tail"], steps
        reduce, gather = steps[0], steps[1]
        assert (reduce["phase"], gather["phase"]) == ("reduce", "gather")
        assert reduce["add_us"] > 0 and gather["add_us"] == 0  # the gather step adds nothing
        for row in steps[:2]:
            parts = sum(row[f"{k}_us"] for k in (*KINDS, "py"))
            assert parts == pytest.approx(row["step_us"], rel=1e-6), row
            assert row["wait_us"] > 0 and row["chunks"] == 1
        (total,) = [row for row in rows if row["table"] == "totals" and row["bytes"] == size]
        assert total["wrong"] == 0 and total["n"] == 2
        for key in ("ours_us", "ring_us", "mpi_us", "stamped_us", "copy_us"):
            assert total[key] > 0, (key, total)
        whole = sum(row["step_us"] for row in steps)
        assert total["stamped_us"] == pytest.approx(whole, rel=1e-6)
