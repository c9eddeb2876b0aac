"""Periodic checkpoints (--checkpoint-every-s, --keep): a daemon killed with -9 resumes
from its newest save, exactly, and its workers go on.

A real daemon process saves every 0.2 s while two real worker processes
train against it; it is killed with SIGKILL, its newest whole checkpoint is
read from disk, the workers are stopped (SIGSTOP) while a daemon restarted
with --resume on the same port comes up, and its state is written out again
(SaveCheckpoint) and compared with the saved one: version, parameters,
optimizer moments, worker clocks and next steps. Then the workers continue
(SIGCONT), their retried calls reach the new daemon, and they run more steps
until SIGTERM stops them cleanly. The fault test prints one line: what was
injected, how long recovery took, what was lost (the updates after the newest
save, which a periodic checkpoint bounds by its period).
"""

from __future__ import annotations

import json
import signal
import time

import grpc
import numpy as np
import pytest
from support.pserver_util import TINY_MLP_FLAGS, DaemonProcess
from test_pserver_leases import (
    ADAM_FLAGS,
    DATA,
    end_all,
    fault_line,
    finish,
    kill9,
    start_worker,
    stats,
    wait_for,
)
from test_pserver_store import g, join, store

from dtlab.models.config import ConfigError, build
from dtlab.models.run import checkpoint as run_checkpoint
from dtlab.models.run.metrics import read_metrics
from dtlab.protos import dtlab_ps_pb2 as pb
from dtlab.pserver.common import codec as wire
from dtlab.pserver.common.config import ServerConfig
from dtlab.pserver.common.errors import InvalidArgument

EVERY_S = 0.2


def save_now(address: str) -> pb.CheckpointReply:
    with grpc.insecure_channel(address) as ch:
        return pb.CheckpointReply.FromString(
            ch.unary_unary(f"/{wire.SERVICE}/SaveCheckpoint")(b"", timeout=30))


def saves(shard_dir) -> list[str]:
    return sorted(p.name for p in shard_dir.iterdir() if p.name.startswith("step-")) \
        if shard_dir.exists() else []


def test_killed_daemon_resumes_its_newest_periodic_save_and_workers_go_on(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    shard_dir = ckpt / "shard-0-of-1"
    args = [*TINY_MLP_FLAGS, *DATA, *ADAM_FLAGS, "--grace-s", "5", "--checkpoint-dir",
            str(ckpt), "--checkpoint-every-s", str(EVERY_S), "--keep", "2", "--num-workers", "2"]
    first = DaemonProcess(tmp_path, args)
    workers = {}
    try:
        port = first.port
        workers = {w: start_worker(first.address, tmp_path, w, f"w{w}", "--steps", "100000",
                                   "--delay-ms", "2", "--retries", "12", world=2)
                   for w in range(2)}
        wait_for("a periodic save after 30 updates", lambda: any(
            run_checkpoint.step_of(str(shard_dir / s)) >= 30 for s in saves(shard_dir)))
        # the save's directory is renamed in before its log line is written: wait for both
        wait_for("the save's log line", lambda: "checkpoint " in first.output())
        killed = kill9(first.proc)
        last_seen = max(r["version"][0] for w in range(2)
                        for r in read_metrics(str(tmp_path / f"w{w}.jsonl"))[1])
        newest, skipped = run_checkpoint.latest_valid(str(shard_dir))
        assert newest is not None and not [s for s in skipped if "unfinished" not in s[1]]
        assert len(saves(shard_dir)) <= 3  # --keep 2, and a third if killed before its prune
        saved_arrays, saved_meta = run_checkpoint.load(newest)
        for p in workers.values():
            p.send_signal(signal.SIGSTOP)  # nothing reaches the new daemon before the check

        second = DaemonProcess(tmp_path, [*args, "--resume", "--port", str(port)])
        try:
            recovery = time.monotonic() - killed
            st = stats(second.address)
            assert st.version == saved_meta["version"] and st.pushes == 0
            path = save_now(second.address).path  # the restored state, written out again
            arrays, meta = run_checkpoint.load(path)
            assert sorted(arrays) == sorted(saved_arrays)
            for name, saved in saved_arrays.items():
                np.testing.assert_array_equal(arrays[name], saved, err_msg=name)
            for key in ("version", "optimizer_steps", "workers", "staleness"):
                assert meta[key] == saved_meta[key], key
            for p in workers.values():
                p.send_signal(signal.SIGCONT)
            resumed_at = {w: s["next_step"] for w, s in saved_meta["workers"].items()}
            wait_for("both workers pushed 20 more steps to the restarted daemon", lambda: all(
                ws.next_step >= resumed_at[str(w)] + 20
                for w, ws in stats(second.address).workers.items()))
            for p in workers.values():
                p.send_signal(signal.SIGTERM)  # finish the step, leave, exit 0
            errs = [finish(workers[w], tmp_path, f"w{w}") for w in range(2)]
            assert "resumed from" in second.output()
            assert "checkpoint failed" not in second.output()
            final = stats(second.address)
        finally:
            second.close()
    finally:
        end_all(workers)
        first.close()
    for w in range(2):  # each worker's steps went on without a gap or a repeat
        steps = [r["step"] for r in read_metrics(str(tmp_path / f"w{w}.jsonl"))[1]]
        assert steps == list(range(1, len(steps) + 1)), steps[:5]
        assert "Traceback" not in errs[w]
    assert final.duplicates == 0
    lost = last_seen - saved_meta["version"]
    fault_line(capsys, f"kill -9 of the daemon under 2 workers, newest periodic save at "
                       f"version {saved_meta['version']}", recovery,
               f"the {lost} update(s) acknowledged after that save (at most "
               f"--checkpoint-every-s {EVERY_S} s of them); the restored state equals the "
               "save exactly")


def test_periodic_saves_skip_an_unchanged_shard_and_keep_the_newest(tmp_path):
    ckpt = tmp_path / "ckpt"
    shard_dir = ckpt / "shard-0-of-1"
    with DaemonProcess(tmp_path, [*TINY_MLP_FLAGS, *DATA, *ADAM_FLAGS, "--checkpoint-dir",
                                  str(ckpt), "--checkpoint-every-s", "0.1", "--keep", "1",
                                  "--log-level", "debug"]) as d:
        wait_for("a save skipped", lambda: "periodic checkpoint skipped" in d.output())
        assert saves(shard_dir) == []  # nothing changed since the start: nothing written
        worker = start_worker(d.address, tmp_path, 0, "w0", "--steps", "5", world=1)
        finish(worker, tmp_path, "w0")
        wait_for("the last version saved", lambda: saves(shard_dir) == ["step-00000005"])
        assert d.terminate() == 0
    meta = json.loads((shard_dir / "step-00000005" / "meta.json").read_text())
    assert meta["workers"]["0"]["next_step"] == 5
    assert saves(shard_dir) == ["step-00000005"]  # --keep 1; the SIGTERM save replaced it


@pytest.mark.parametrize("fields, message", [
    ({"checkpoint_every_s": 1.0}, "--checkpoint-every-s needs --checkpoint-dir"),
    ({"keep": 2}, "--keep needs --checkpoint-dir"),
    ({"checkpoint_dir": "x", "checkpoint_every_s": -1.0}, "--checkpoint-every-s must not be "
                                                           "negative"),
    ({"checkpoint_dir": "x", "keep": -1}, "--keep must not be negative"),
    ({"worker_timeout": -0.5}, "--worker-timeout must not be negative"),
])
def test_bad_checkpoint_and_lease_flags_are_named(fields, message):
    with pytest.raises(ConfigError, match=message):
        build(ServerConfig, fields)


def test_a_resumed_shard_takes_its_workers_versions_from_before_the_restart_once():
    """A checkpoint older than the server's last state: a worker's versions from before
    the restart may name other values here (known_version ignored) or none yet (a push
    read at a newer version counts as read now), until it has read from this server."""
    before = store()
    join(before, 0)
    for step in range(3):
        before.push(0, step, before.version, g(1.0))
    saved = before.state()  # version 3; versions 4 and 5 are lost with the server
    for step in range(3, 5):
        before.push(0, step, before.version, g(1.0))
    after = store()
    after.load_state(saved)
    join(after, 1)  # a worker the checkpoint does not name
    with pytest.raises(InvalidArgument, match="from the future"):
        after.push(1, 0, 5, g(1.0))
    result = after.push(0, 5, 5, g(2.0))  # read at version 5 before the restart
    assert (result.version, result.staleness) == (4, 0)
    read = after.read(0, known_version=4, timeout=1.0)  # its 4 is not this server's 4
    assert read.tensor is not None and read.version == 4
    after.release(read)
    np.testing.assert_array_equal(after.params, g(-5.0))  # -3 saved, then -2
    with pytest.raises(InvalidArgument, match="from the future"):  # it has read here now
        after.push(0, 6, 9, g(1.0))
