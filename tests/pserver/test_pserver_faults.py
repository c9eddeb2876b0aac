"""Bad input and faults over real gRPC: a clear status, and nothing lost or wrongly applied."""

from __future__ import annotations

import random
import subprocess
import sys
import threading
import time
import zlib

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support.pserver_util import ROOT, addresses, connect, initial_params, serve

from dtlab.protos import dtlab_ps_pb2 as pb
from dtlab.pserver.common import codec as wire
from dtlab.pserver.worker.shard_client import PROCESS_REGISTRATION as REG

C = grpc.StatusCode
INIT = initial_params()
N = INIT.size


def header(**kw) -> pb.PushHeader:
    meta = {"dtype": pb.FLOAT32, "shape": [N], "offset": 0, "version": 0, **kw.pop("meta", {})}
    return pb.PushHeader(**{"registration": REG, "worker_id": 0, "step": 0, "shard": 0, **kw},
                         meta=pb.TensorMeta(**meta))


def push_raw(address: str, messages, timeout: float = 20.0):
    """Send raw PushRequest bytes; (status code, reply or details)."""
    with grpc.insecure_channel(address, options=wire.transport_options(64 << 20)) as ch:
        call = ch.stream_unary(f"/{wire.SERVICE}/Push")
        try:
            return C.OK, pb.PushReply.FromString(call(iter(messages), timeout=timeout))
        except grpc.RpcError as e:
            return e.code(), e.details()


def good_stream(grad: np.ndarray, **kw) -> list[bytes]:
    return list(wire.stream(header(**kw), grad, chunk_bytes=64))  # several chunks


@pytest.fixture
def shard():
    """One in-process shard of the tiny MLP with worker 0 registered; yields (daemon, address)."""
    with serve() as daemons:
        address = addresses(daemons)
        connect(address).close()
        yield daemons[0], address


def unchanged(daemon) -> None:
    assert daemon.store.version == 0
    np.testing.assert_array_equal(daemon.store.params, INIT.data)


ONES = np.ones(N, np.float32)
PATHS = {"calls": {"transport": "calls", "shm": False},
         "session": {"transport": "session", "shm": False},
         "shm": {"transport": "session", "shm": True}}


@pytest.mark.parametrize("kw, code, match", [
    ({"meta": {"dtype": pb.FLOAT64}}, C.INVALID_ARGUMENT, "dtype FLOAT64"),
    ({"meta": {"shape": [N + 1]}}, C.INVALID_ARGUMENT, "shape"),
    ({"meta": {"offset": 5}}, C.INVALID_ARGUMENT, "offset"),
    ({"shard": 1}, C.INVALID_ARGUMENT, "shard 1"),
    ({"worker_id": 9}, C.FAILED_PRECONDITION, "worker 9 is not registered"),
    ({"meta": {"version": 3}}, C.INVALID_ARGUMENT, "future"),
])
def test_bad_header_is_refused(shard, kw, code, match):
    daemon, address = shard
    got, details = push_raw(address, good_stream(ONES, **kw))
    assert got == code and match in details
    unchanged(daemon)


def test_bad_payloads_are_refused_and_counted(shard):
    daemon, address = shard
    msgs = good_stream(ONES)
    cases = {
        "nonfinite": good_stream(np.where(np.arange(N) == 17, np.nan, ONES).astype(np.float32)),
        "checksum": msgs[:-1] + [wire.trailer_message(12345, len(msgs) - 2)],
        "missing trailer": msgs[:-1],
        "truncated": msgs[:2] + [msgs[-1]],
        "gap": [msgs[0], msgs[2], *msgs[3:]],
        "chunk after trailer": msgs + [msgs[1]],
        "dtype of chunk": [msgs[0], wire.chunk_message(0, memoryview(b"\x00" * 6))[0], msgs[-1]],
    }
    want = {"nonfinite": (C.INVALID_ARGUMENT, "element 17 is nan"),
            "checksum": (C.DATA_LOSS, "adler32"),
            "missing trailer": (C.DATA_LOSS, "without a trailer"),
            "truncated": (C.DATA_LOSS, "ended at element"),
            "gap": (C.INVALID_ARGUMENT, "chunk.start"),
            "chunk after trailer": (C.INVALID_ARGUMENT, "after the trailer"),
            "dtype of chunk": (C.INVALID_ARGUMENT, "whole number")}
    for name, stream in cases.items():
        code, details = push_raw(address, stream)
        assert (code, want[name][1] in details) == (want[name][0], True), (name, code, details)
    unchanged(daemon)
    rejected = daemon.store.stats().rejected
    assert rejected["nonfinite"] == 1 and rejected["checksum"] == 1
    assert push_raw(address, msgs)[0] == C.OK  # the shard still takes a good push


def test_oversized_message_is_resource_exhausted(shard):
    daemon, address = shard
    big = wire.chunk_message(0, memoryview(b"\x00" * (5 << 20)))[0]
    code, _ = push_raw(address, [wire.header_message(header()), big])
    assert code == C.RESOURCE_EXHAUSTED
    unchanged(daemon)


def test_unknown_worker_pull_and_shard_mismatch(shard):
    daemon, address = shard
    with grpc.insecure_channel(address) as ch:
        pull = ch.unary_stream(f"/{wire.SERVICE}/Pull", pb.PullRequest.SerializeToString)
        with pytest.raises(grpc.RpcError) as e:
            list(pull(pb.PullRequest(registration=REG, worker_id=4), timeout=20))
        assert e.value.code() == C.FAILED_PRECONDITION
        with pytest.raises(grpc.RpcError) as e:
            list(pull(pb.PullRequest(registration=REG, worker_id=0, shard=2), timeout=20))
        assert e.value.code() == C.INVALID_ARGUMENT and "shard 2" in e.value.details()


@pytest.mark.parametrize("path", PATHS)
def test_retried_push_is_applied_once(shard, path):
    daemon, address = shard
    client = connect(address, **PATHS[path])
    try:
        client.pull(np.empty(N, np.float32))
        grad = np.arange(N, dtype=np.float32)
        first, again = client.push(grad, 0)[0], client.push(grad, 0)[0]
        assert not first.duplicate and again.duplicate and again.version == first.version == 1
        assert client.push(grad, 1)[0].version == 2  # a session goes on after a duplicate
    finally:
        client.close()
    np.testing.assert_array_equal(daemon.store.params, INIT.data - grad - grad)


HALF_PUSH = """
import sys, time, grpc, numpy as np
from dtlab.pserver.common import codec as wire
from dtlab.protos import dtlab_ps_pb2 as pb
n, registration = int(sys.argv[2]), int(sys.argv[3])  # the test's: worker 0 is its
h = pb.PushHeader(registration=registration, worker_id=0, step=0, shard=0,
                  meta=pb.TensorMeta(dtype=pb.FLOAT32, shape=[n], offset=0, version=0))
msgs = list(wire.stream(h, np.ones(n, np.float32), chunk_bytes=64))
def half():
    yield from msgs[: len(msgs) // 2]
    print("sent", flush=True)
    time.sleep(600)
ch = grpc.insecure_channel(sys.argv[1])
ch.stream_unary("/" + wire.SERVICE + "/Push")(half(), timeout=600)
"""


def test_client_killed_mid_push_applies_nothing(shard):
    daemon, address = shard
    proc = subprocess.Popen([sys.executable, "-c", HALF_PUSH, address, str(N), str(REG)], cwd=ROOT,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "sent"
        deadline = time.monotonic() + 20
        while not daemon.store.stats().pushes_in_flight and time.monotonic() < deadline:
            time.sleep(0.02)
        assert daemon.store.stats().pushes_in_flight == 1
        proc.kill()
        proc.wait(timeout=30)
        # gRPC reports the dead peer as a cancelled call or as a stream that ended early
        # (no trailer): either way the push is refused whole
        deadline = time.monotonic() + 20
        while daemon.store.stats().pushes_in_flight and time.monotonic() < deadline:
            time.sleep(0.05)
        rejected = daemon.store.stats().rejected
        assert rejected["broken"] + rejected["incomplete"] == 1, dict(rejected)
        assert daemon.store.stats().pushes_in_flight == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    unchanged(daemon)


def test_garbage_on_every_method_leaves_the_server_up_and_unchanged(shard):
    daemon, address = shard
    rng = random.Random(0)
    good = good_stream(ONES)

    def garbage() -> bytes:
        kind = rng.randrange(4)
        if kind == 0:
            return rng.randbytes(rng.randrange(0, 64))
        if kind == 1:  # a real message, truncated
            m = rng.choice(good)
            return m[: rng.randrange(len(m))]
        if kind == 2:  # a real message with a flipped byte
            m = bytearray(rng.choice(good))
            m[rng.randrange(len(m))] ^= 1 << rng.randrange(8)
            return bytes(m)
        return pb.PushRequest(header=header(meta={"dtype": rng.randrange(9)})).SerializeToString()

    codes = set()
    with grpc.insecure_channel(address) as ch:
        path = f"/{wire.SERVICE}/"
        for _ in range(40):
            for method in ("Register", "Deregister", "Stats", "SaveCheckpoint"):
                try:
                    ch.unary_unary(path + method)(garbage(), timeout=20)
                except grpc.RpcError as e:
                    codes.add(e.code())
            try:
                list(ch.unary_stream(path + "Pull")(garbage(), timeout=20))
            except grpc.RpcError as e:
                codes.add(e.code())
            stream = [garbage() for _ in range(rng.randrange(1, 5))]
            if rng.random() < 0.5:
                stream = good[: rng.randrange(1, len(good))] + stream
            codes.add(push_raw(address, stream)[0])
        status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=20)
    assert status.status == health_pb2.HealthCheckResponse.SERVING
    assert C.INTERNAL not in codes and C.UNKNOWN not in codes, codes
    unchanged(daemon)
    assert push_raw(address, good)[0] == C.OK


@pytest.mark.parametrize("path", PATHS)
def test_concurrent_workers_sum_exactly(path):
    """W clients x K integer pushes to 2 shards, SGD lr 1: the exact sum, W*K records,
    on every data path."""
    W, K = 4, 12
    with serve(shards=2) as daemons:
        servers = addresses(daemons)
        clients = [connect(servers, worker=w, **PATHS[path]) for w in range(W + 1)]
        try:
            zero = clients[W]  # first cancel the random init exactly: p - p = 0
            zero.pull(np.empty(N, np.float32))
            zero.push(INIT.data, 0)

            def work(w):
                buf = np.empty(N, np.float32)
                for k in range(K):
                    clients[w].pull(buf)
                    clients[w].push((np.arange(N) % 7 + w + k).astype(np.float32), k)

            threads = [threading.Thread(target=work, args=(w,)) for w in range(W)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=120)
            want = -sum((np.arange(N) % 7 + w + k) for w in range(W) for k in range(K))
            got = np.concatenate([d.store.params for d in daemons])
            np.testing.assert_array_equal(got, want.astype(np.float32))
            assert all(s.shared_memory == (path == "shm") for c in clients for s in c.shards)
            for d in daemons:
                st = d.store.stats()
                assert st.staleness.total == W * K + 1 == sum(st.staleness.counts.values())
                assert [st.workers[w].staleness.total for w in range(W)] == [K] * W
                assert 0 < st.check_seconds < st.receive_seconds  # every push timed
        finally:
            for c in clients:
                c.close()


def adler32_by_definition(data: bytes, start: int = 1) -> int:
    """RFC 1950: A = 1 + sum of bytes, B = sum of the A's, both mod 65521; B << 16 | A."""
    a, b = start & 0xFFFF, start >> 16
    for byte in data:
        a = (a + byte) % 65521
        b = (b + a) % 65521
    return b << 16 | a


def test_checksum_is_adler32_by_definition():
    """The trailer checksum is RFC 1950's Adler-32, whatever implementation computes it,
    also when continued chunk by chunk and past zlib's 5552-byte reduction interval."""
    assert wire.adler32(b"Wikipedia") == 0x11E60398  # the published example
    data = np.random.default_rng(1).integers(0, 256, 20_000, dtype=np.uint8).tobytes()
    data += b"\xff" * 12_000  # the largest bytes stress the modular reduction
    want = adler32_by_definition(data)
    assert wire.adler32(data) == zlib.adler32(data) == want
    running = wire.ADLER_START
    for lo in range(0, len(data), 7_001):
        running = wire.adler32(data[lo : lo + 7_001], running)
    assert running == want and wire.adler32(b"") == wire.ADLER_START


def test_push_retries_unavailable_across_a_restart(tmp_path):
    """The shard restarts from its checkpoint while a push is retried: applied once."""
    ckpt = str(tmp_path / "ckpt")
    with serve(checkpoint_dir=ckpt) as daemons:
        port = daemons[0].port
        client = connect(f"127.0.0.1:{port}")
        client.pull(np.empty(N, np.float32))
    result = []
    try:
        pusher = threading.Thread(target=lambda: result.append(client.push(ONES, 0)[0]))
        pusher.start()
        time.sleep(0.3)  # the first attempts find nobody
        with serve(checkpoint_dir=ckpt, resume=True, port=port) as daemons:
            pusher.join(timeout=60)
            assert result and result[0].version == 1 and not result[0].duplicate
            np.testing.assert_array_equal(daemons[0].store.params, INIT.data - ONES)
            assert client.push(ONES, 0)[0].duplicate
    finally:
        client.close()
