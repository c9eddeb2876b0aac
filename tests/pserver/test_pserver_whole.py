"""A tensor in one message (WholePush, WholePull on a Session): protobuf by either codec,
data aligned, checked exactly as the header, chunk, trailer it fuses (all or nothing,
exactly once, Adler-32), sent only to a client that asks, and streamed when too big."""

from __future__ import annotations

import queue
import zlib

import grpc
import numpy as np
import pytest
from support.pserver_util import addresses, connect, initial_params, serve

from dtlab.protos import dtlab_ps_pb2 as pb
from dtlab.protos import dtlab_ps_pb2_grpc as pb_grpc
from dtlab.pserver.common import codec as wire
from dtlab.pserver.worker.shard_client import PROCESS_REGISTRATION as REG

INIT = initial_params()
N = INIT.size
C = grpc.StatusCode
META = pb.TensorMeta(dtype=pb.FLOAT32, shape=[N], offset=0, version=0)


@pytest.mark.parametrize("make", ["hand", "generated"])
@pytest.mark.parametrize("nbytes", [0, 4, 100, (1 << 14) - 4, 1 << 20])
@pytest.mark.parametrize("worker", [0, 1 << 20])  # header varints of other widths
def test_whole_messages_are_protobuf_aligned_and_read_alike(make, nbytes, worker):
    values = np.arange(nbytes // 4, dtype=np.float32)
    header = pb.PushHeader(registration=REG, worker_id=worker, step=worker, shard=0, meta=META)
    raw = wire.whole(pb.SessionRequest, "push_whole", header, values, wire.CODECS[make])
    if make == "hand":
        assert (len(raw) - nbytes) % wire.ALIGN == 0  # the data ends the message, aligned
    push = pb.SessionRequest.FromString(raw).push_whole
    assert push.header == header and push.chunk.data == values.tobytes()
    assert (push.chunk.start, push.trailer.chunks) == (0, 1)
    assert push.trailer.adler32 == zlib.adler32(values.tobytes())
    for codec in wire.CODECS.values():
        kind, whole = codec.read(pb.SessionRequest, raw)
        assert kind == "push_whole" and whole.header == header
        assert bytes(whole.data) == values.tobytes() and whole.trailer == push.trailer


def session(address: str):
    """A generated-stub Session: (channel, request queue, replies)."""
    ch = grpc.insecure_channel(address)
    q = queue.SimpleQueue()
    return ch, q, pb_grpc.ParameterServerStub(ch).Session(iter(q.get, None), timeout=20)


def whole_push(grad: np.ndarray, step: int = 0, **trailer) -> pb.SessionRequest:
    fields = {"chunks": 1, "adler32": zlib.adler32(grad.tobytes()), **trailer}
    return pb.SessionRequest(push_whole=pb.WholePush(
        header=pb.PushHeader(registration=REG, worker_id=0, step=step, shard=0, meta=META),
        chunk=pb.Chunk(start=0, data=grad.tobytes()), trailer=pb.Trailer(**fields)))


def test_a_generated_stub_pushes_and_pulls_whole_and_is_streamed_what_it_does_not_take():
    with serve() as daemons:
        address = addresses(daemons)
        connect(address).close()  # registers worker 0
        ch, q, replies = session(address)
        try:
            grad = np.arange(N, dtype=np.float32)
            for _ in range(2):  # the second is a retry of the first
                q.put(whole_push(grad))
                pushed = next(replies).pushed
            assert pushed.duplicate and pushed.version == 1
            q.put(pb.SessionRequest(pull=pb.PullRequest(registration=REG,
                                                        worker_id=0, shard=0, whole_bytes=4 * N)))
            pulled = next(replies).pulled_whole
            assert pulled.header.meta.version == 1 and pulled.trailer.chunks == 1
            np.testing.assert_array_equal(np.frombuffer(pulled.chunk.data, np.float32),
                                          INIT.data - grad)
            assert pulled.trailer.adler32 == zlib.adler32((INIT.data - grad).tobytes())
            for whole_bytes in (0, 4 * N - 1):  # not asked for, or too big: the stream
                q.put(pb.SessionRequest(pull=pb.PullRequest(registration=REG, worker_id=0, shard=0,
                                                            whole_bytes=whole_bytes)))
                kinds = [next(replies).WhichOneof("kind") for _ in range(3)]
                assert kinds == ["header", "chunk", "trailer"]
        finally:
            q.put(None)
            ch.close()
        np.testing.assert_array_equal(daemons[0].store.params, INIT.data - grad)


@pytest.mark.parametrize("fault, code, words", [
    ({"adler32": 1}, C.DATA_LOSS, "trailer.adler32"),
    ({"chunks": 2}, C.DATA_LOSS, "trailer.chunks"),
    ({"short": True}, C.DATA_LOSS, "stream ended at element"),
    ({"nonfinite": True}, C.INVALID_ARGUMENT, "is nan"),
])
def test_a_faulty_whole_push_applies_nothing(fault, code, words):
    with serve() as daemons:
        address = addresses(daemons)
        connect(address).close()
        grad = np.ones(N, np.float32)
        if fault.pop("nonfinite", False):
            grad[3] = np.nan
        message = whole_push(grad, **fault) if not fault.pop("short", False) else \
            whole_push(grad[:-1])
        ch, q, replies = session(address)
        try:
            q.put(message)
            with pytest.raises(grpc.RpcError) as e:
                next(replies)
            assert e.value.code() == code and words in e.value.details()
        finally:
            q.put(None)
            ch.close()
        assert daemons[0].store.version == 0
        np.testing.assert_array_equal(daemons[0].store.params, INIT.data)


def test_the_client_streams_a_push_bigger_than_its_chunk_and_sums_exactly():
    with serve() as daemons:
        client = connect(addresses(daemons), shm=False, chunk_bytes=64)
        try:
            params = np.empty(N, np.float32)
            client.pull(params)
            grad = np.arange(N, dtype=np.float32)
            assert client.push(grad, 0)[0].version == 1
            client.pull(params)
            np.testing.assert_array_equal(params, INIT.data - grad)
        finally:
            client.close()
