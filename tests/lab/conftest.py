"""`tiny_bench(name)`: benchmark `name` at its tiny size (support/bench_runs.py), run once
a session however many tests read it."""

from __future__ import annotations

import pytest
from support.bench_runs import BenchRun, run


@pytest.fixture(scope="session")
def tiny_bench(tmp_path_factory):
    done: dict[str, BenchRun] = {}

    def tiny(name: str) -> BenchRun:
        if name not in done:
            done[name] = run(name, tmp_path_factory.mktemp(f"bench-{name}"))
        return done[name]

    return tiny
