"""The daemon as a process: CLI errors, metrics, reflection, SIGTERM, checkpoints, resume."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import numpy as np
import pytest
from google.protobuf import descriptor_pool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)
from prometheus_client.parser import text_string_to_metric_families
from support.pserver_util import (
    ROOT,
    TINY_MLP_FLAGS,
    DaemonProcess,
    connect,
    initial_params,
    wait_stopped,
)

from dtlab.protos import dtlab_ps_pb2 as pb
from dtlab.pserver.common import codec as wire

INIT = initial_params()
N = INIT.size
SGD_FLAGS = ["--optimizer", "sgd", "--lr", "1", "--warmup", "0", "--schedule", "constant"]


def serve_args(*extra: str) -> list[str]:
    return [*TINY_MLP_FLAGS, *SGD_FLAGS, "--grace-s", "5", *extra]


@pytest.mark.parametrize("flags, message", [
    (["--shard", "2", "--num-shards", "2"], "--shard must be in [0, --num-shards=2)"),
    (["--staleness", "2"], "--staleness applies to --consistency ssp"),
    (["--resume"], "--resume needs --checkpoint-dir"),
    (["--token-env", "DTLAB_TEST_NO_SUCH_VAR"], "--token-env DTLAB_TEST_NO_SUCH_VAR"),
])
def test_bad_flags_exit_2_naming_the_flag(flags, message):
    r = subprocess.run([sys.executable, "-m", "dtlab.pserver", "serve", *TINY_MLP_FLAGS, *flags],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and message in r.stderr, r.stderr


def test_port_in_use_is_a_clear_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        for flag in ("--port", "--metrics-port"):
            r = subprocess.run([sys.executable, "-m", "dtlab.pserver", "serve", *TINY_MLP_FLAGS,
                                flag, str(port)], cwd=ROOT, capture_output=True, text=True,
                               timeout=60)
            assert r.returncode == 2 and f"{flag} {port}" in r.stderr, r.stderr
            last = r.stderr.strip().splitlines()[-1]  # the error, said once, and nothing else
            assert f"{flag} {port}" in last and "already in use" in last.lower(), r.stderr
            assert r.stderr.count("in use") == 1 and "add_port" not in r.stderr, r.stderr


def scrape(port: int) -> tuple[dict, dict]:
    """GET /metrics: ({(sample name, frozenset of labels): value}, {family: type})."""
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=20).read().decode()
    families = list(text_string_to_metric_families(body))
    samples = {(s.name, frozenset(s.labels.items())): s.value for f in families
               for s in f.samples}
    return samples, {f.name: f.type for f in families}


def slow_push(address: str, registration: int, step: int, version: int, sent: threading.Event,
              out: list, pause_after: int = 2, resume: threading.Event | None = None):
    """A push of worker 0 (`registration`) that pauses after its first `pause_after` messages
    (0: before its header) until `resume` is set (None: for 0.5 s), `sent` set at the pause;
    (code, reply) lands in `out`."""
    h = pb.PushHeader(worker_id=0, step=step, shard=0, registration=registration,
                      meta=pb.TensorMeta(dtype=pb.FLOAT32, shape=[N], offset=0, version=version))
    msgs = list(wire.stream(h, np.ones(N, np.float32), chunk_bytes=64))

    def trickle():
        for i, m in enumerate(msgs):
            if i == pause_after:
                sent.set()
                if resume is None:
                    time.sleep(0.5)
                else:
                    assert resume.wait(60)
            yield m

    with grpc.insecure_channel(address) as ch:
        try:
            out.append((grpc.StatusCode.OK,
                        ch.stream_unary(f"/{wire.SERVICE}/Push", None,
                                        pb.PushReply.FromString)(trickle(), timeout=30)))
        except grpc.RpcError as e:
            out.append((e.code(), e.details()))


def test_metrics_reflection_and_sigterm_with_checkpoint(tmp_path: Path):
    ckpt = tmp_path / "ckpt"
    with DaemonProcess(tmp_path, serve_args("--checkpoint-dir", str(ckpt), "--metrics-port", "0",
                                            "--reflection")) as d:
        client = connect(d.address)
        client.pull(np.empty(N, np.float32))
        client.push(np.ones(N, np.float32), 0)

        samples, types = scrape(d.metrics_port)
        shard0 = frozenset({("shard", "0")})
        assert samples["dtlab_ps_staleness_bucket", shard0 | {("le", "0")}] == 1
        assert samples["dtlab_ps_staleness_bucket", shard0 | {("le", "+Inf")}] == 1
        assert samples["dtlab_ps_worker_staleness_count", shard0 | {("worker", "0")}] == 1
        assert samples["dtlab_ps_pushes_total", shard0] == 1
        assert samples["dtlab_ps_version", shard0] == 1
        assert types["dtlab_ps_staleness"] == "histogram"
        assert types["dtlab_ps_pushes"] == "counter"
        # the process collector: this daemon's memory, CPU time and open descriptors
        assert samples["process_resident_memory_bytes", frozenset()] > 1 << 20
        assert samples["process_open_fds", frozenset()] >= 3
        assert "process_cpu_seconds_total" in {name for name, _ in samples}
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(f"http://127.0.0.1:{d.metrics_port}/other", timeout=20)
        assert e.value.code == 404

        with grpc.insecure_channel(d.address) as ch:
            reflected = ProtoReflectionDescriptorDatabase(ch)
            services = reflected.get_services()
            assert wire.SERVICE in services and "grpc.health.v1.Health" in services
            describe = descriptor_pool.DescriptorPool(reflected).FindServiceByName(
                wire.SERVICE).FindMethodByName("Describe")  # a client's way in, reflected
            assert describe.output_type.fields_by_name["layout_crc32_input"]

            watch = health_pb2_grpc.HealthStub(ch).Watch(
                health_pb2.HealthCheckRequest(service=wire.SERVICE), timeout=60)
            assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
            sent_first, result = threading.Event(), []
            pusher = threading.Thread(target=slow_push, args=(
                d.address, client.registration, 1, client.versions[0], sent_first, result))
            pusher.start()
            assert sent_first.wait(30)
            d.proc.send_signal(15)  # SIGTERM while the push is in flight
            assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
            watch.cancel()
            pusher.join(timeout=60)
        client.close()
        assert d.proc.wait(timeout=60) == 0, d.output()
        logged = [line for line in d.output().splitlines() if " INFO " in line]
        assert logged and all(" INFO shard 0: " in line for line in logged), logged
        code, reply = result[0]
        assert code == grpc.StatusCode.OK and reply.version == 2  # finished, not dropped
        saved = sorted(p.name for p in (ckpt / "shard-0-of-1").iterdir())
        assert saved == ["step-00000002"], saved
        assert "checkpoint" in d.output()


def test_sigterm_lets_a_push_finish_whose_header_has_not_arrived(tmp_path: Path):
    """The call is counted from its acceptance (pserver.server.inflight), not from its first
    message: a shutdown that starts between the two waits for it."""
    with DaemonProcess(tmp_path, serve_args("--metrics-port", "0")) as d:
        client = connect(d.address)
        client.pull(np.empty(N, np.float32))
        called, resume, result = threading.Event(), threading.Event(), []
        pusher = threading.Thread(target=slow_push, args=(
            d.address, client.registration, 0, client.versions[0], called, result, 0, resume))
        pusher.start()
        try:
            assert called.wait(30)
            calls = frozenset({("shard", "0")})
            for _ in range(600):  # the daemon has accepted the call, before any message
                if scrape(d.metrics_port)[0]["dtlab_ps_calls_in_flight", calls] == 1:
                    break
                time.sleep(0.05)
            else:
                raise AssertionError("the push was never counted in flight")
            d.proc.send_signal(15)
            for _ in range(600):
                if "shutting down" in d.output():
                    break
                time.sleep(0.05)
            else:
                raise AssertionError(f"no shutdown logged:\n{d.output()}")
        finally:
            resume.set()
            pusher.join(timeout=60)
        client.close()
        assert d.proc.wait(timeout=60) == 0, d.output()
        code, reply = result[0]
        assert code == grpc.StatusCode.OK and reply.version == 1, result


def test_resume_and_corrupt_checkpoint(tmp_path: Path):
    ckpt = tmp_path / "ckpt"
    with DaemonProcess(tmp_path, serve_args("--checkpoint-dir", str(ckpt))) as d:
        client = connect(d.address)
        for step in range(3):
            client.pull(np.empty(N, np.float32))
            client.push(np.full(N, step + 1, np.float32), step)
        path = client.shards[0].save_checkpoint().path
        client.close()
        assert d.terminate() == 0
    want = INIT.data - np.float32(1) - np.float32(2) - np.float32(3)  # float32, in order

    with DaemonProcess(tmp_path, serve_args("--checkpoint-dir", str(ckpt), "--resume")) as d:
        client = connect(d.address)
        try:
            assert client.connect(0, "mlp", N, wire.layout_crc(INIT.specs)) == 3  # next step
            params = np.empty(N, np.float32)
            client.pull(params)
            assert client.versions == [3]
            np.testing.assert_array_equal(params, want)
            assert client.stats()[0].staleness.total == 3  # the histograms go on counting
            assert client.push(np.ones(N, np.float32), 2)[0].duplicate  # seen before the restart
        finally:
            client.close()
        assert d.terminate() == 0

    victim = Path(path) / "params.npy"
    raw = bytearray(victim.read_bytes())
    raw[-1] ^= 0xFF
    victim.write_bytes(bytes(raw))
    for p in (ckpt / "shard-0-of-1").iterdir():  # make the corrupt one the newest
        if p != Path(path):
            for f in p.iterdir():
                f.unlink()
            p.rmdir()
    d = DaemonProcess(tmp_path, serve_args("--checkpoint-dir", str(ckpt), "--resume"),
                      wait=False)
    try:
        assert d.proc.wait(timeout=60) == 1
        assert "params.npy" in d.output() and "corrupt" in d.output()
    finally:
        d.close()


FREEZE = '''"""tests/pserver/test_pserver_daemon.py: this process stops itself (SIGSTOP) right
before its {nth}th {event} of a path matching {pattern!r} (an audit hook). The signal goes
to the calling thread, so it stops there before the call runs."""
import re, signal, sys, threading
_seen = [0]
def _freeze(name, args):
    if name == {event!r} and args and re.search({pattern!r}, str(args[0])):
        _seen[0] += 1
        if _seen[0] == {nth}:
            signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)
sys.addaudithook(_freeze)
'''


def frozen_at(tmp: Path, event: str, pattern: str, nth: int) -> dict:
    """The environment of a process that stops itself before the nth `event` on a path
    matching `pattern` (a sitecustomize on its PYTHONPATH)."""
    hook = tmp / "freeze"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(FREEZE.format(event=event, pattern=pattern, nth=nth))
    return {"PYTHONPATH": os.pathsep.join(filter(None, [str(hook),
                                                        os.environ.get("PYTHONPATH")]))}


def save_failing(shard) -> None:
    """SaveCheckpoint on a daemon that is killed before it answers."""
    with pytest.raises(grpc.RpcError):
        shard.save_checkpoint()


def push_steps(client, steps) -> None:
    for step in steps:
        client.pull(np.empty(N, np.float32))
        client.push(np.full(N, step + 1, np.float32), step)


def test_a_daemon_killed_between_the_renames_of_a_resave_resumes_that_version(tmp_path: Path):
    """SaveCheckpoint twice at one version with --keep 1: the second save moves the first
    aside, then renames itself in. Killed between the two (kill -9 of the frozen daemon),
    no step-* is left; the resumed daemon puts the moved-aside copy back and serves it."""
    ckpt, step3 = tmp_path / "ckpt", r"/\.step-00000003\.[^/]+$"
    args = serve_args("--checkpoint-dir", str(ckpt), "--keep", "1")
    d = DaemonProcess(tmp_path, args, env=frozen_at(tmp_path, "os.rename", step3, 2))
    try:
        client = connect(d.address)
        push_steps(client, range(3))
        client.shards[0].save_checkpoint()
        again = threading.Thread(target=save_failing, args=(client.shards[0],))
        again.start()
        wait_stopped(d.proc)
        names = sorted(p.name.split(".")[1] for p in (ckpt / "shard-0-of-1").iterdir())
        assert names == ["replaced-step-00000003", "step-00000003"]  # and no step-*
        d.proc.kill()
        again.join(timeout=60)
        client.close()
    finally:
        d.close()
    with DaemonProcess(tmp_path, [*args, "--resume"]) as d:
        client = connect(d.address)
        try:
            params = np.empty(N, np.float32)
            client.pull(params)
            assert client.versions == [3]
            np.testing.assert_array_equal(params, INIT.data - np.float32(1) - np.float32(2)
                                          - np.float32(3))
        finally:
            client.close()
        assert "step-00000003: put back from" in d.output()
        assert sorted(p.name for p in (ckpt / "shard-0-of-1").iterdir()) == ["step-00000003"]


def test_resume_passes_a_damaged_newest_and_removes_an_unfinished_save(tmp_path: Path):
    """As the trainers do: the newest checkpoint that verifies, the damaged one named in the
    log; the temporary directory a killed save left is removed, and said."""
    ckpt = tmp_path / "ckpt"
    shard = ckpt / "shard-0-of-1"
    with DaemonProcess(tmp_path, serve_args("--checkpoint-dir", str(ckpt))) as d:
        client = connect(d.address)
        push_steps(client, range(2))
        client.shards[0].save_checkpoint()
        push_steps(client, [2])
        newest = Path(client.shards[0].save_checkpoint().path)
        client.close()
        d.proc.kill()  # kill -9: no shutdown save
    with open(newest / "params.npy", "r+b") as f:
        f.truncate(100)
    unfinished = shard / ".step-00000004.k9x"
    unfinished.mkdir()
    (unfinished / "params.npy").write_bytes(b"\x93NUMPY")
    with DaemonProcess(tmp_path, serve_args("--checkpoint-dir", str(ckpt), "--resume")) as d:
        client = connect(d.address)
        try:
            params = np.empty(N, np.float32)
            client.pull(params)
            assert client.versions == [2]
            np.testing.assert_array_equal(params, INIT.data - np.float32(1) - np.float32(2))
        finally:
            client.close()
        out = d.output()
    assert f"--resume: skipped {newest} (params.npy: truncated (100 of" in out, out
    assert f"{unfinished}: removed (an unfinished save" in out, out
    assert not unfinished.exists()
