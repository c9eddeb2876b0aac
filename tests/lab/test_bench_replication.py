"""dtlab.lab.bench.replication runs at a tiny size, prints its table and writes its JSON:
every push reaches its backups, one row per (workers, replicas)."""


def test_tiny_replication_benchmark(tiny_bench):
    r = tiny_bench("replication")
    assert r.rc == 0, r
    lines = r.stdout.splitlines()
    assert lines[0].startswith("# legend: ") and lines[1].split()[:4] == ["#", "size", "W",
                                                                          "replicas"]
    rows = r.data["rows"]
    assert len(lines) == 2 + len(rows) == 6
    assert {(row["workers"], row["replicas"]) for row in rows} == {(1, 1), (1, 2), (2, 1),
                                                                   (2, 2)}
    for row in rows:
        assert row["wrong"] == 0 and row["push_gbps"] > 0 and row["updates_per_s"] > 0
        assert (row["x1"] == 1.0) == (row["replicas"] == 1)
