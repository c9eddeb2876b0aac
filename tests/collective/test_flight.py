"""The flight recorder and its analyser (collective/transport/flight.py).

Planted hangs in real 3-rank jobs (tests/support/mpi_progs/flight_prog.py):
each ends within seconds by the watchdog or the abort handler, every rank
dumps its ring, and the analyser names the rank and sequence number. Then the
analyser on hand-written dumps, and the ring itself in this process.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from support.mpirun import mpirun

from dtlab.collective.transport import flight

pytestmark = pytest.mark.usefixtures("mpiexec")

PROG = "tests/support/mpi_progs/flight_prog.py"
QUICK_S = 20  # timeout 2 s, a few seconds to dump and abort; generous for a loaded machine


def _planted(case: str, folder: Path):
    r = mpirun(3, PROG, case, wrap=False, timeout=60,
               env={"DTLAB_COLLECTIVE_TIMEOUT": "2", "DTLAB_FLIGHT_DIR": str(folder)})
    assert not r.timed_out and r.rc != 0, r
    assert r.seconds < QUICK_S, r  # the program sleeps 60 s: only an abort ends it early
    assert f"explain: python -m dtlab.collective.transport.flight {folder}" in r.stderr, r
    dumps = flight.load(folder)
    assert sorted(dumps) == [0, 1, 2], r
    # the abort path unlinked the node's MPICH segment, and nothing brought it back
    gone = [p for d in dumps.values() for p in d["shm_unlinked"]]
    assert gone and not any(Path(p).exists() for p in gone), dumps
    return r, dumps


def test_a_rank_that_skips_an_allreduce_is_named_with_the_sequence_it_never_reached(tmp_path):
    r, dumps = _planted("skip", tmp_path)
    assert "allreduce(shared memory) on 'world' stalled" in r.stderr, r
    assert dumps[1]["reason"] == "another rank is aborting the job"  # rank 1 was asleep
    (f,) = flight.analyse(dumps)
    # sequence 1 is the barrier, 2-6 the all-reduces: rank 1 called only four
    assert (f.comm, f.seq) == ("world", 6), f.text()
    assert f.groups == [("allreduce(4096 B float32, shm-one-shot) [started]", [0, 2])]
    assert f.missing == [(1, "#5 allreduce, done")]
    cli = subprocess.run([sys.executable, "-m", "dtlab.collective.transport.flight", str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert cli.returncode == 0, cli.stderr
    assert "first disagreement at sequence 6" in cli.stdout
    assert "rank 1 never reached it (last: #5 allreduce, done)" in cli.stdout
    sync = subprocess.run([sys.executable, "-m", "dtlab.collective.train", "--explain-hang",
                           str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert sync.returncode == 0 and sync.stdout == cli.stdout, sync.stderr  # dtlab-sync's flag
    mixed = subprocess.run([sys.executable, "-m", "dtlab.collective.train", "--explain-hang",
                            str(tmp_path), "--steps", "3"], capture_output=True, text=True,
                           timeout=60)
    assert mixed.returncode == 2 and "trains nothing: not with --steps 3" in mixed.stderr


def test_a_rank_that_calls_another_operation_is_named(tmp_path):
    r, dumps = _planted("mismatch", tmp_path)
    (f,) = flight.analyse(dumps)
    assert f.seq == 4 and f.missing == [], f.text()
    assert f.groups == [("allreduce(4096 B float32, shm-one-shot) [started]", [0, 1]),
                        ("allgather(12288 B float32, ring) [started]", [2])]


def test_an_exception_dumps_every_rank_through_the_abort_path(tmp_path):
    r, dumps = _planted("raise", tmp_path)
    assert "RuntimeError: planted failure on rank 0" in r.stderr, r
    assert dumps[0]["reason"].startswith("dtlab: uncaught exception on rank 0 of 3")
    (f,) = flight.analyse(dumps)
    assert f.seq == 4 and f.missing == [(0, "#3 allreduce, done")], f.text()


# ---- the analyser on hand-written dumps ---------------------------------------

def _dump(rank: int, calls: list[tuple], comms=(("world", [0, 1, 2]),), size: int = 3) -> dict:
    """A dump whose ranks made `calls`: (comm key, seq, op, bytes[, state])."""
    issued = {}
    for c in calls:
        issued[c[0]] = max(issued.get(c[0], 0), c[1])
    return {
        "rank": rank, "world_size": size, "reason": "test", "shm_unlinked": [],
        "communicators": [{"key": k, "name": k.split("#")[0], "rank": ranks.index(rank),
                           "ranks": ranks, "issued": issued.get(k, 0)} for k, ranks in comms],
        "entries": [{"comm": c[0], "seq": c[1], "op": c[2], "bytes": c[3], "dtype": "float32",
                     "algo": "ring", "peer": None, "start": 0.0, "seconds": None,
                     "state": c[4] if len(c) > 4 else "done"} for c in calls],
    }


def _write(folder: Path, dumps: list[dict]) -> Path:
    for d in dumps:
        (folder / f"rank-{d['rank']}.json").write_text(json.dumps(d))
    return folder


def test_ranks_that_agree_give_no_finding(tmp_path):
    calls = [("world", s, "allreduce", 64) for s in range(1, 4)]
    dumps = flight.load(_write(tmp_path, [_dump(r, calls) for r in range(3)]))
    assert flight.analyse(dumps) == []
    assert "agree on every recorded call" in flight.report(dumps)


def test_a_size_mismatch_is_found_past_entries_the_ring_dropped(tmp_path):
    calls = [("world", s, "allreduce", 64) for s in range(1, 9)]
    bad = [*calls[3:6], ("world", 7, "allreduce", 32, "started")]  # rank 2 kept 4..7 only
    dumps = flight.load(_write(tmp_path, [_dump(0, calls[2:]), _dump(1, calls), _dump(2, bad)]))
    (f,) = flight.analyse(dumps)
    assert f.seq == 7 and f.missing == []
    assert [g[1] for g in f.groups] == [[0, 1], [2]]
    assert "32 B" in f.groups[1][0]


def test_sub_communicators_are_told_apart_and_a_missing_dump_is_named(tmp_path):
    comms = (("world", [0, 1, 2, 3]), ("dp", [0, 2]), ("dp#1", [0, 2]))
    calls = [("world", 1, "barrier", 0), ("dp", 1, "allreduce", 8), ("dp#1", 1, "allreduce", 8)]
    late = [*calls, ("dp#1", 2, "broadcast", 8, "started")]
    dumps = flight.load(_write(tmp_path, [_dump(0, late, comms, 4), _dump(2, calls, comms, 4),
                                          _dump(1, calls[:1], (comms[0],), 4)]))
    (f,) = flight.analyse(dumps)
    assert (f.comm, f.seq, f.missing) == ("dp#1", 2, [(2, "#1 allreduce, done")])
    text = flight.report(dumps)
    assert "no dump from rank 3" in text and "\nworld (" not in text  # world agrees


def test_bad_dumps_are_named(tmp_path):
    assert flight.main([str(tmp_path / "none")]) == 2
    assert flight.main([str(tmp_path)]) == 2  # no dumps
    (tmp_path / "rank-0.json").write_text('{"rank": 0')
    with pytest.raises(flight.DumpError, match="rank-0.json: not a flight-recorder dump"):
        flight.load(tmp_path)


def test_the_ring_keeps_the_newest_entries_with_their_state():
    rec = flight.Recorder("ring-test", 0, [0])
    cap = len(flight._RING.entries)
    for _ in range(cap + 5):
        rec.done(rec.start("allreduce", 4096, np.dtype(np.float32), "ring"))
    open_call = rec.start("broadcast", 8, np.dtype(np.float64), "tree", 0)
    mine = [e for e in flight.snapshot("test")["entries"] if e["comm"] == "ring-test"]
    assert len(mine) == cap and [e["seq"] for e in mine] == list(range(7, cap + 7))
    assert mine[-1] | {"start": 0} == {
        "comm": "ring-test", "seq": cap + 6, "op": "broadcast", "bytes": 8, "dtype": "float64",
        "algo": "tree", "peer": 0, "start": 0, "seconds": None, "state": "started"}
    assert mine[0]["state"] == "done" and mine[0]["seconds"] >= 0
    rec.done(open_call)


def test_a_recorder_turned_off_records_nothing(monkeypatch):
    """Communicator(flight=False) and DTLAB_FLIGHT_ENTRIES=0 get the recorder that records
    nothing: no sequence numbers, no ring entries (dtlab-bench flight's baseline)."""
    before = [(e["comm"], e["seq"]) for e in flight.snapshot("test")["entries"]]
    off = flight.recorder("off-test", 0, [0], on=False)
    assert isinstance(off, flight.Off)
    off.done(off.start("allreduce", 4096, np.dtype(np.float32), "ring"))
    assert [(e["comm"], e["seq"]) for e in flight.snapshot("test")["entries"]] == before
    assert not any(c["name"] == "off-test" for c in flight._COMMS)
    monkeypatch.setenv(flight.ENTRIES_ENV, "0")
    assert isinstance(flight.recorder("env-test", 0, [0]), flight.Off)
    monkeypatch.setenv(flight.ENTRIES_ENV, "-1")
    with pytest.raises(ValueError, match="must be 0 \\(off\\) or more"):
        flight.recorder("bad-test", 0, [0])
