"""Chrome traces (--trace): every rank writes well-formed trace events; merged, the ranks'
timelines share one clock."""

import json

import pytest
from support.mpirun import mpirun

from dtlab.models.run.trace import PHASES, merge

pytestmark = pytest.mark.usefixtures("mpiexec")

MLP = ["--model", "mlp", "--d-in", "8", "--n-classes", "4", "--d-hidden", "32",
       "--n-samples", "4096", "--steps", "3", "--grad-accum", "2"]


def events(path) -> list[dict]:
    with open(path) as f:
        return json.load(f)["traceEvents"]


def test_each_rank_writes_a_trace_and_they_merge_on_one_clock(tmp_path):
    r = mpirun(2, "-m", "dtlab.collective.train", *MLP, "--pp", "2",
               "--trace", tmp_path / "sync.{rank}.json", timeout=60)
    assert r.rc == 0, r
    paths = [tmp_path / f"sync.{rank}.json" for rank in (0, 1)]
    for rank, path in enumerate(paths):
        spans = [e for e in events(path) if e["ph"] == "X"]
        assert {e["pid"] for e in events(path)} == {rank}
        names = {e["name"] for e in spans}
        assert {"compute", "optimizer", "F0", "F1", "BW0", "BW1"} <= names, names
        assert all(e["dur"] >= 0 and 0 <= e["tid"] < len(PHASES) for e in spans)
        assert sum(e["name"] == "compute" for e in spans) == 3
        meta = {e["args"]["name"] for e in events(path) if e["ph"] == "M"}
        assert f"sync rank {rank}" in meta and "pipeline" in meta
    out = tmp_path / "merged.json"
    assert merge([str(p) for p in paths], str(out)) == sum(len(events(p)) for p in paths)
    merged = [e for e in events(out) if e["ph"] == "X"]
    firsts = [min(e["ts"] for e in merged if e["pid"] == rank) for rank in (0, 1)]
    assert abs(firsts[0] - firsts[1]) < 5e6  # microseconds of one wall clock, not per-process
