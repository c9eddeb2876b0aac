"""Sessions and shared memory on real servers: the same guarantees as per-call pulls and
pushes (all-or-nothing, exactly once, checksums, deadlines), shared memory only where both
ends share a host and allow it, and no segment left behind when either end is killed."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import time
import zlib
from pathlib import Path

import grpc
import numpy as np
import pytest
from support.pserver_util import (
    ROOT,
    TINY_MLP_FLAGS,
    DaemonProcess,
    addresses,
    connect,
    initial_params,
    serve,
)
from support.waiting import wait_for

from dtlab.protos import dtlab_ps_pb2 as pb
from dtlab.protos import dtlab_ps_pb2_grpc as pb_grpc
from dtlab.pserver.common import shm
from dtlab.pserver.worker.shard_client import PROCESS_REGISTRATION as REG

INIT = initial_params()
N = INIT.size
C = grpc.StatusCode
SGD_FLAGS = ["--optimizer", "sgd", "--lr", "1", "--warmup", "0", "--schedule", "constant"]


def segments(pid: int | None = None) -> list[str]:
    """Our segment names in /dev/shm (of owner `pid`, or any)."""
    prefix = shm.PREFIX + ("" if pid is None else f"{pid}-")
    return sorted(p.name for p in shm.SHM_DIR.iterdir() if p.name.startswith(prefix))


def mapped(pid: int) -> list[str]:
    """Segments process `pid` still maps (unlinked ones show as '(deleted)')."""
    return [line for line in Path(f"/proc/{pid}/maps").read_text().splitlines()
            if shm.PREFIX in line]


@pytest.mark.parametrize("use_shm", [False, True])
def test_a_failed_operation_ends_the_session_and_the_next_one_opens_another(use_shm):
    with serve() as daemons:
        client = connect(addresses(daemons), shm=use_shm)
        try:
            params = np.empty(N, np.float32)
            client.pull(params)
            bad = np.ones(N, np.float32)
            bad[17] = np.inf
            with pytest.raises(grpc.RpcError) as e:
                client.push(bad, 0)
            assert e.value.code() == C.INVALID_ARGUMENT
            assert "gradient element 17 is inf" in e.value.details()
            assert daemons[0].store.version == 0  # nothing applied
            assert client.push(np.ones(N, np.float32), 0)[0].version == 1
            assert client.shards[0].shared_memory == use_shm
            client.pull(params)
            np.testing.assert_array_equal(params, INIT.data - 1)
            assert daemons[0].store.stats().rejected["nonfinite"] == 1
        finally:
            client.close()


@pytest.mark.parametrize("transport", ["calls", "session"])
def test_a_pull_that_waits_too_long_is_deadline_exceeded(transport):
    with serve(consistency="ssp", staleness=0, num_workers=2) as daemons:
        client = connect(addresses(daemons), transport=transport, rpc_timeout_s=0.5)
        try:
            t0 = time.monotonic()
            with pytest.raises(grpc.RpcError) as e:
                client.pull(np.empty(N, np.float32))
            assert e.value.code() == C.DEADLINE_EXCEEDED
            assert time.monotonic() - t0 < 5
            assert "1 of --num-workers 2" in e.value.details() or transport == "calls"
        finally:
            client.close()


def test_shared_memory_is_refused_by_a_no_shm_server_and_for_another_host():
    with serve(shm=False) as daemons:
        client = connect(addresses(daemons))
        try:
            client.pull(np.empty(N, np.float32))
            assert not client.shards[0].shared_memory
            assert "--no-shm" in client.shards[0].shm_refused
        finally:
            client.close()
    with serve() as daemons, grpc.insecure_channel(addresses(daemons)) as ch:
        replies = pb_grpc.ParameterServerStub(ch).Session(
            iter([pb.SessionRequest(shm_request=pb.ShmRequest(boot_id="another-host"))]),
            timeout=20)
        offer = next(replies).shm_offer
        assert offer.path == "" and "another host" in offer.refused
        assert not segments(os.getpid())


def test_a_chunk_or_trailer_outside_a_push_ends_the_session_by_name():
    with serve() as daemons, grpc.insecure_channel(addresses(daemons)) as ch:
        for stray in (pb.SessionRequest(chunk=pb.Chunk(start=0, data=bytes(4))),
                      pb.SessionRequest(trailer=pb.Trailer(chunks=1))):
            replies = pb_grpc.ParameterServerStub(ch).Session(iter([stray]), timeout=20)
            with pytest.raises(grpc.RpcError) as e:
                next(replies)
            assert e.value.code() == C.INVALID_ARGUMENT
            assert f"session: a {stray.WhichOneof('kind')} outside a push" in e.value.details()
        assert daemons[0].store.version == 0
        assert daemons[0].store.stats().rejected["order"] == 2


def shm_session(address: str):
    """A generated-stub session that agreed on shared memory: (channel, request queue,
    replies, the segment's data as float32)."""
    ch = grpc.insecure_channel(address)
    q = queue.SimpleQueue()
    replies = pb_grpc.ParameterServerStub(ch).Session(iter(q.get, None), timeout=20)
    q.put(pb.SessionRequest(shm_request=pb.ShmRequest(boot_id=shm.boot_id())))
    offer = next(replies).shm_offer
    segment = shm.Segment.attach(offer.path, offer.size, offer.data_offset, N * 4)
    q.put(pb.SessionRequest(shm_attach=pb.ShmAttach(token=segment.token)))
    assert next(replies).shm_ready.refused == ""
    assert not Path(offer.path).exists()  # unlinked once both ends map it
    return ch, q, replies, segment.array(np.float32, N)


def test_shared_memory_push_checks_the_checksum_and_is_applied_once():
    with serve() as daemons:
        address = addresses(daemons)
        connect(address).close()  # registers worker 0
        ch, q, replies, data = shm_session(address)
        try:
            grad = np.arange(N, dtype=np.float32)
            data[:] = grad
            meta = pb.TensorMeta(dtype=pb.FLOAT32, shape=[N], offset=0, version=0)
            header = pb.PushHeader(registration=REG, worker_id=0, step=0, shard=0, meta=meta)
            good = zlib.adler32(grad.tobytes())
            q.put(pb.SessionRequest(shm_push=pb.ShmPush(header=header, adler32=good ^ 1)))
            with pytest.raises(grpc.RpcError) as e:
                next(replies)
            assert e.value.code() == C.DATA_LOSS and "adler32" in e.value.details()
            assert daemons[0].store.version == 0
        finally:
            ch.close()
        ch, q, replies, data = shm_session(address)
        try:
            data[:] = grad
            for _ in range(2):  # the second is a retry of the first
                q.put(pb.SessionRequest(shm_push=pb.ShmPush(header=header, adler32=good)))
                pushed = next(replies).pushed
            assert pushed.duplicate and pushed.version == 1
            q.put(pb.SessionRequest(shm_pull=pb.PullRequest(registration=REG,
                                                            worker_id=0, shard=0)))
            pulled = next(replies).shm_pulled
            np.testing.assert_array_equal(data, INIT.data - grad)
            assert pulled.header.meta.version == 1
            assert pulled.adler32 == zlib.adler32((INIT.data - grad).tobytes())
        finally:
            ch.close()
        del data  # the test's own (the worker's) mapping
        wait_for("the server unmapped its segments", lambda: not mapped(os.getpid()))


WORKER = """
import sys, time, numpy as np
sys.path.insert(0, "tests")
from support.pserver_util import connect
client = connect(sys.argv[1])
client.pull(np.empty(int(sys.argv[2]), np.float32))
assert client.shards[0].shared_memory
print("ready", flush=True)
time.sleep(600)
"""


def test_segments_go_when_a_worker_is_killed():
    with serve() as daemons:
        proc = subprocess.Popen([sys.executable, "-c", WORKER, addresses(daemons), str(N)],
                                cwd=ROOT, stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout.readline().strip() == "ready"
            assert mapped(os.getpid()) and mapped(proc.pid)  # both map it ...
            assert not segments()  # ... and its name is gone already
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
            wait_for("the server let go of the segment", lambda: not mapped(os.getpid()))
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=30)


def test_segments_go_when_the_server_is_killed_and_orphans_are_swept(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(timeout=30)
    orphan = shm.SHM_DIR / f"{shm.PREFIX}{dead.pid}-0123456789abcdef"
    orphan.write_bytes(b"\0" * 64)  # as a server killed between create and unlink leaves it
    with DaemonProcess(tmp_path, [*TINY_MLP_FLAGS, *SGD_FLAGS]) as d:
        assert not orphan.exists()  # swept at start
        client = connect(d.address)
        try:
            params = np.empty(N, np.float32)
            client.pull(params)
            assert client.shards[0].shared_memory and not segments(d.proc.pid)
            d.proc.send_signal(signal.SIGKILL)
            d.proc.wait(timeout=30)
            with pytest.raises(grpc.RpcError) as e:
                client.push(np.ones(N, np.float32), 0)
            assert e.value.code() == C.UNAVAILABLE
            assert not client.shards[0].shared_memory and not mapped(os.getpid())
            assert not segments(d.proc.pid)
        finally:
            client.close()
