"""The wire contract as a client written from protos/dtlab_ps.proto alone sees it.

The client half of each test uses nothing of dtlab but the generated classes
and stubs (dtlab.protos), plus zlib, secrets and NumPy: it learns what to
register with from Describe, registers (shard 0 assigns its id), pulls and
pushes on calls and on a Session, with the chunking, Adler-32 and trailer the
.proto describes. The servers are real daemons of the tiny MLP (SGD, lr 1), so
every applied gradient shows exactly in the parameters pulled after it; the
server side (its stores, the model's own layout) is only used to check.
"""

from __future__ import annotations

import json
import secrets
import threading
import time
import zlib

import grpc
import numpy as np
import pytest
from support.pserver_util import addresses, connect, initial_params, serve

from dtlab.protos import dtlab_ps_pb2 as pb
from dtlab.protos import dtlab_ps_pb2_grpc as pb_grpc
from dtlab.pserver.common import codec as wire

C = grpc.StatusCode
DTYPES = {pb.FLOAT32: np.dtype("<f4"), pb.FLOAT64: np.dtype("<f8")}


# -- the client: the .proto's rules, nothing else --------------------------------------------

def layout_text(d: pb.DescribeReply) -> str:
    """RegisterRequest.layout_crc32's input, built from Describe's layout as the .proto says."""
    return ";".join(f"{t.name}:{'x'.join(map(str, t.shape))}" for t in d.layout)


def tensor_stream(cls, header_field: str, header, values: np.ndarray, chunk_elems: int):
    """header, chunks, trailer of `cls` (PushRequest or SessionRequest)."""
    data, checksum, n = values.tobytes(), 1, 0
    yield cls(**{header_field: header})
    step = chunk_elems * values.itemsize
    for start in range(0, len(data), step):
        piece = data[start:start + step]
        checksum = zlib.adler32(piece, checksum)
        n += 1
        yield cls(chunk=pb.Chunk(start=start // values.itemsize, data=piece))
    yield cls(trailer=pb.Trailer(chunks=n, adler32=checksum))


def read_tensor(replies, dtype: np.dtype) -> tuple[pb.TensorMeta, np.ndarray]:
    """A pulled tensor from header, chunks, trailer (checked as the .proto says)."""
    first = next(replies)
    assert first.WhichOneof("kind") == "header" and not first.header.not_modified
    meta, pieces, checksum = first.header.meta, [], 1
    for reply in replies:
        kind = reply.WhichOneof("kind")
        if kind == "trailer":
            assert reply.trailer.chunks == len(pieces) and reply.trailer.adler32 == checksum
            return meta, np.frombuffer(b"".join(pieces), dtype)
        assert kind == "chunk" and reply.chunk.start * dtype.itemsize == sum(map(len, pieces))
        pieces.append(reply.chunk.data)
        checksum = zlib.adler32(reply.chunk.data, checksum)
    raise AssertionError("the pull ended without its trailer")


class ProtoClient:
    """One shard as a client that knows only the .proto sees it."""

    def __init__(self, address: str, registration: int):
        self.channel = grpc.insecure_channel(address)
        self.stub = pb_grpc.ParameterServerStub(self.channel)
        self.registration = registration
        self.described = self.stub.Describe(pb.DescribeRequest(), timeout=20)
        self.dtype = DTYPES[self.described.dtype]

    def register(self, worker_id: int | None = None) -> pb.RegisterReply:
        d = self.described
        reply = self.stub.Register(pb.RegisterRequest(
            worker_id=worker_id, model=d.model, model_size=d.model_size,
            layout_crc32=zlib.crc32(layout_text(d).encode()), registration=self.registration,
            run_config=d.run_config), timeout=20)
        self.worker, self.version = reply.worker_id, reply.meta.version
        return reply

    def pull(self) -> np.ndarray:
        meta, values = read_tensor(self.stub.Pull(pb.PullRequest(
            worker_id=self.worker, shard=self.described.shard, registration=self.registration),
            timeout=20), self.dtype)
        self.version = meta.version
        return values

    def header(self, step: int, registration: int | None = None) -> pb.PushHeader:
        meta = pb.TensorMeta(dtype=self.described.dtype, shape=self.described.meta.shape,
                             offset=self.described.meta.offset, version=self.version)
        return pb.PushHeader(worker_id=self.worker, step=step, shard=self.described.shard,
                             meta=meta, registration=self.registration
                             if registration is None else registration)

    def push(self, grad: np.ndarray, step: int) -> pb.PushReply:
        return self.stub.Push(tensor_stream(pb.PushRequest, "header", self.header(step), grad,
                                            chunk_elems=16), timeout=20)

    def session_push_pull(self, grad: np.ndarray, step: int) -> tuple[pb.PushReply, np.ndarray]:
        """A push, then a pull right behind it, on one Session."""
        pull = pb.PullRequest(worker_id=self.worker, shard=self.described.shard,
                              registration=self.registration)
        requests = [*tensor_stream(pb.SessionRequest, "header", self.header(step), grad, 16),
                    pb.SessionRequest(pull=pull)]
        replies = self.stub.Session(iter(requests), timeout=20)
        pushed = next(replies)
        assert pushed.WhichOneof("kind") == "pushed"
        meta, values = read_tensor(replies, self.dtype)
        self.version = meta.version
        return pushed.pushed, values

    def close(self) -> None:
        self.channel.close()


def test_a_client_that_knows_only_the_proto_registers_pulls_and_pushes():
    with serve(shards=2) as daemons:
        registration = secrets.randbits(64) | 1
        shards = [ProtoClient(f"127.0.0.1:{d.port}", registration) for d in daemons]
        try:
            first, second = (s.described for s in shards)
            assert first.register_required == ["model", "model_size", "layout_crc32",
                                               "registration"]
            assert second.register_required == [*first.register_required, "worker_id"]
            assert first.registration_checked and first.model == "mlp"
            assert zlib.crc32(first.layout_crc32_input.encode()) == first.layout_crc32
            assert layout_text(first) == first.layout_crc32_input
            assert sum(t.size for t in first.layout) == first.model_size
            assert [t.offset for t in first.layout] == list(np.cumsum(
                [0] + [t.size for t in first.layout])[:-1])
            assert first.optimizer == "sgd" and json.loads(first.optim_config)["lr"] == 1.0
            assert first.consistency == pb.ASP and first.dtype == pb.FLOAT32

            worker = shards[0].register().worker_id  # shard 0 assigns the id
            assert shards[1].register(worker).worker_id == worker
            before = [s.pull() for s in shards]
            for d, values in zip(daemons, before, strict=True):
                np.testing.assert_array_equal(values, d.store.params)  # the shard's truth
            grads = [np.arange(v.size, dtype=np.float32) / 8 for v in before]
            assert shards[0].push(grads[0], 0).version == 1  # a Push call
            reply, after = shards[1].session_push_pull(grads[1], 0)  # a Session
            assert (reply.version, reply.duplicate) == (1, False)
            np.testing.assert_array_equal(after, before[1] - grads[1])  # SGD, lr 1
            np.testing.assert_array_equal(shards[0].pull(), before[0] - grads[0])

            # steps: a jump ahead is accepted; the steps it skipped answer duplicate, lr 0
            assert shards[0].push(grads[0], 3).version == 2
            skipped = shards[0].push(grads[0], 2)
            assert skipped.duplicate and skipped.lr == 0.0 and skipped.version == 2
            assert daemons[0].store.version == 2
        finally:
            for s in shards:
                s.close()


def test_describe_is_the_models_own_layout():
    with serve() as daemons:
        d = ProtoClient(addresses(daemons), 1).described
    specs = initial_params().specs
    assert [(t.name, tuple(t.shape)) for t in d.layout] == [(s.name, tuple(s.shape))
                                                          for s in specs]
    assert d.layout_crc32 == wire.layout_crc(specs) == daemons[0].store.layout.layout_crc
    assert d.layout_crc32_input == "l0.W:4x8;l0.b:8;out.W:8x3;out.b:3"
    assert list(d.meta.shape) == [d.model_size] and d.meta.offset == 0


@pytest.mark.parametrize("fault, code", [
    ("gap", C.INVALID_ARGUMENT), ("chunks", C.DATA_LOSS), ("short", C.DATA_LOSS)])
def test_a_gap_and_a_wrong_chunk_count_get_the_documented_status(fault, code):
    with serve() as daemons:
        s = ProtoClient(addresses(daemons), 7)
        try:
            s.register()
            n = s.pull().size
            messages = list(tensor_stream(pb.PushRequest, "header", s.header(0),
                                          np.ones(n, np.float32), 16))  # chunks of 16
            if fault == "gap":  # the second chunk left out
                del messages[2]
                message = "chunk.start 32: expected 16"
            elif fault == "chunks":
                messages[-1].trailer.chunks += 1
                message = f"trailer.chunks {len(messages) - 1} != {len(messages) - 2} chunks"
            else:  # the last chunk left out
                del messages[-2]
                message = f"stream ended at element {16 * ((n - 1) // 16)} of {n}"
            with pytest.raises(grpc.RpcError) as e:
                s.stub.Push(iter(messages), timeout=20)
            assert e.value.code() == code and message in e.value.details()
            assert daemons[0].store.version == 0
        finally:
            s.close()


# -- Stats.rejected["broken"]: real breaks only ---------------------------------------------

def taken_over(address: str, registration: int, timeout: float = 20.0) -> None:
    """Worker 0 registered anew under `registration`: refused (ALREADY_EXISTS) while a
    session of the one before is open, so this returns once that session has ended."""
    s = ProtoClient(address, registration)
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                s.register(0)
                return
            except grpc.RpcError as e:
                assert e.code() == C.ALREADY_EXISTS and time.monotonic() < deadline, e
                time.sleep(0.02)
    finally:
        s.close()


def test_only_a_push_that_breaks_off_counts_as_broken():
    with serve() as daemons:
        address, store = addresses(daemons), daemons[0].store
        for i in range(3):  # PSClient's own sessions, closed as it closes them
            client = connect(address)
            client.pull(np.empty(store.params.size, np.float32))
            client.push(np.ones(store.params.size, np.float32), i)
            client.close()
            taken_over(address, 100 + i)
        s = ProtoClient(address, 200)
        s.register(0)
        pull = pb.PullRequest(worker_id=0, shard=0, registration=200)
        release = threading.Event()

        def pull_then_wait():
            yield pb.SessionRequest(pull=pull)
            release.wait(20)

        call = s.stub.Session(pull_then_wait(), timeout=20)
        read_tensor(call, s.dtype)
        call.cancel()  # a session cancelled between operations
        release.set()
        taken_over(address, 201)
        assert "broken" not in store.stats().rejected

        s.registration = 202
        s.register(0)
        s.pull()
        messages = list(tensor_stream(pb.SessionRequest, "header", s.header(9),
                                      np.ones(store.params.size, np.float32), 16))
        release.clear()

        def push_part():
            yield from messages[:2]  # the header and one chunk of several
            release.wait(20)

        call = s.stub.Session(push_part(), timeout=20)
        deadline = time.monotonic() + 20
        while store.stats().pushes_in_flight == 0:
            assert time.monotonic() < deadline, "the push never arrived"
            time.sleep(0.01)
        call.cancel()  # a push that breaks off
        release.set()
        taken_over(address, 203)
        s.close()
        rejected = store.stats().rejected  # "incomplete" if the end came before the cancel
        assert rejected["broken"] + rejected["incomplete"] == 1, rejected
        assert store.version == 3  # the three whole pushes, not the broken one
