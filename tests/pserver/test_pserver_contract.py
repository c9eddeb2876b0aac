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

    def register(self, worker_id: int | None = None, previous: int = 0) -> pb.RegisterReply:
        d = self.described
        reply = self.stub.Register(pb.RegisterRequest(
            worker_id=worker_id, model=d.model, model_size=d.model_size,
            layout_crc32=zlib.crc32(layout_text(d).encode()), registration=self.registration,
            run_config=d.run_config, previous_registration=previous), timeout=20)
        self.worker, self.version = reply.worker_id, reply.meta.version
        return reply

    def pull(self, shard: int | None = None) -> np.ndarray:
        meta, values = read_tensor(self.stub.Pull(pb.PullRequest(
            worker_id=self.worker, shard=self.described.shard if shard is None else shard,
            registration=self.registration), timeout=20), self.dtype)
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
    with serve(allow_takeover=True) as daemons:  # PSClient's registration and these alternate
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


# -- what Register answers, what Describe states, who may call --------------------------------

def refused(call) -> tuple[grpc.StatusCode, str]:
    """(status, details) of a call that must fail."""
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value.code(), e.value.details()


def test_register_reply_carries_the_clock_a_worker_starts_at():
    """A worker joining while another is 4 clocks on starts at 4 (the slowest active
    worker's clock): RegisterReply.clock says so, and its WorkerStats.clock is that plus
    its accepted pushes, which staleness.total counts."""
    with serve() as daemons:
        first, late = (ProtoClient(addresses(daemons), r) for r in (11, 12))
        try:
            assert first.register(0).clock == 0
            zeros = np.zeros(first.pull().size, np.float32)
            for step in range(4):
                first.push(zeros, step)
            joined = late.register(1)
            assert joined.clock == 4
            late.pull()
            for step in range(3):
                late.push(zeros, step)
            stats = late.stub.Stats(pb.StatsRequest(), timeout=20).workers[1]
            assert (stats.clock, stats.staleness.total) == (joined.clock + 3, 3)
        finally:
            first.close()
            late.close()


def gelu(z: np.ndarray, erf: bool = False) -> np.ndarray:
    if erf:
        from math import erf as scalar_erf
        return 0.5 * z * (1 + np.vectorize(scalar_erf)(z / np.sqrt(2)))
    return 0.5 * z * (1 + np.tanh(np.sqrt(2 / np.pi) * (z + 0.044715 * z**3)))


def documented_loss(d: pb.DescribeReply, flat: np.ndarray, x, y, erf: bool = False) -> float:
    """The mlp's mean cross-entropy as the .proto's arithmetic states it, from Describe's
    layout alone (row-major tensors, x @ W + b, tanh GELU, the batch mean)."""
    P = {t.name: flat[t.offset:t.offset + t.size].reshape(tuple(t.shape)) for t in d.layout}
    layers = [t.name[:-2] for t in d.layout if t.name.endswith(".W")]
    h = x
    for name in layers:
        h = h @ P[f"{name}.W"] + P[f"{name}.b"]
        if name != "out":
            h = gelu(h, erf)
    z = h - h.max(axis=1, keepdims=True)
    return float(np.mean(np.log(np.exp(z).sum(axis=1)) - z[np.arange(len(y)), y]))


def test_a_gradient_computed_from_the_documented_arithmetic_is_the_models():
    """Central differences of the loss the .proto's arithmetic defines (float64) equal the
    model's own backward pass; the erf GELU, which the arithmetic rules out, does not."""
    from dtlab.models.config import build
    from dtlab.models.model import Replica
    from dtlab.models.zoo import build_model, config_class

    with serve() as daemons:
        s = ProtoClient(addresses(daemons), 1)
        d = s.described
        s.close()
    assert d.arithmetic == "dtlab-arithmetic/1"
    run = json.loads(d.run_config)
    params = initial_params(dtype="float64")
    rng = np.random.default_rng(5)
    x, y = rng.standard_normal((6, run["model"]["d_in"])), rng.integers(0, 3, size=6)
    model = build_model("mlp", build(config_class("mlp"), dict(run["model"])))
    Replica(model, params).compute_grads([(x, y)])
    flat = params.data.copy()

    def numeric(erf: bool) -> np.ndarray:
        out, h = np.empty_like(flat), 1e-6
        for i in range(flat.size):
            up, down = flat.copy(), flat.copy()
            up[i] += h
            down[i] -= h
            out[i] = (documented_loss(d, up, x, y, erf) - documented_loss(d, down, x, y, erf)) \
                / (2 * h)
        return out

    np.testing.assert_allclose(numeric(erf=False), params.grad, rtol=1e-6, atol=1e-9)
    assert np.abs(numeric(erf=True) - params.grad).max() > 1e-4


def test_the_server_never_clips_and_says_whose_clip_it_is():
    """optim_config.clip is the run's, for the workers: a push far above it is applied
    whole (SGD, lr 1)."""
    with serve(optim={"optimizer": "sgd", "lr": 1.0, "warmup": 0, "schedule": "constant",
                      "clip": 0.5}) as daemons:
        s = ProtoClient(addresses(daemons), 3)
        try:
            assert json.loads(s.register(0).optim_config)["clip"] == 0.5
            before = s.pull()
            big = np.full(before.size, 10.0, np.float32)  # norm far above 0.5
            s.push(big, 0)
            np.testing.assert_array_equal(s.pull(), before - big)
        finally:
            s.close()


def test_a_deregistered_worker_is_refused_until_it_registers_again():
    with serve() as daemons:
        store = daemons[0].store
        s = ProtoClient(addresses(daemons), 21)
        try:
            s.register(0)
            ones = np.ones(s.pull().size, np.float32)
            s.push(ones, 0)
            leave = pb.DeregisterRequest(worker_id=0, registration=21)
            s.stub.Deregister(leave, timeout=20)
            s.stub.Deregister(leave, timeout=20)  # again: answered, nothing changes
            session_pull = pb.SessionRequest(pull=pb.PullRequest(worker_id=0, shard=0,
                                                                 registration=21))
            for call in (s.pull, lambda: s.push(ones, 0), lambda: s.push(ones, 1),
                         lambda: list(s.stub.Session(iter([session_pull]), timeout=20))):
                code, details = refused(call)
                assert code == C.FAILED_PRECONDITION and "(Deregister)" in details, details
            assert store.stats().rejected["deregistered"] == 4
            assert not store.stats().workers[0].active and store.version == 1
            s.register(0)  # back: its calls are served again
            s.pull()
            assert s.push(ones, 1).version == 2
        finally:
            s.close()


def test_a_pull_waiting_for_its_turn_ends_when_its_worker_deregisters():
    with serve(consistency="ssp", staleness=0, num_workers=2) as daemons:
        fast, slow = (ProtoClient(addresses(daemons), r) for r in (31, 32))
        try:
            fast.register(0)
            slow.register(1)
            fast.push(np.zeros(fast.pull().size, np.float32), 0)  # one clock ahead: waits
            outcome = []
            waiting = threading.Thread(target=lambda: outcome.append(refused(fast.pull)))
            waiting.start()
            time.sleep(0.3)
            fast.stub.Deregister(pb.DeregisterRequest(worker_id=0, registration=31), timeout=20)
            waiting.join(20)
            code, details = outcome[0]
            assert code == C.FAILED_PRECONDITION and "(Deregister)" in details, details
        finally:
            fast.close()
            slow.close()


def test_which_refusal_wins_when_a_call_has_several_faults():
    """The .proto's order: identity (registration 0, unknown worker, superseded,
    deregistered) before the message's fields (shard, dtype, offset)."""
    with serve() as daemons:
        s = ProtoClient(addresses(daemons), 41)
        try:
            s.register(0)
            ones = np.ones(s.pull().size, np.float32)

            def push(**change) -> tuple[grpc.StatusCode, str]:
                h = s.header(0, registration=change.pop("registration", None))
                for k, v in change.items():
                    setattr(h.meta if k in ("dtype", "offset") else h, k, v)
                return refused(lambda: s.stub.Push(
                    tensor_stream(pb.PushRequest, "header", h, ones, 16), timeout=20))

            code, details = push(registration=0, shard=5)
            assert code == C.INVALID_ARGUMENT and "registration 0" in details
            code, details = push(worker_id=9, dtype=pb.FLOAT64)
            assert code == C.FAILED_PRECONDITION and "not registered" in details
            code, details = push(registration=42, offset=3)
            assert code == C.FAILED_PRECONDITION and "registered by another process" in details
            code, details = push(shard=5, offset=3)  # both the message's: shard first
            assert code == C.INVALID_ARGUMENT and "header.shard 5" in details
            s.stub.Deregister(pb.DeregisterRequest(worker_id=0, registration=41), timeout=20)
            code, details = refused(lambda: s.pull(shard=3))
            assert code == C.FAILED_PRECONDITION and "(Deregister)" in details
            assert daemons[0].store.version == 0
        finally:
            s.close()


def test_an_idle_id_is_taken_over_only_presenting_the_registration_it_replaces():
    with serve() as daemons:
        address = addresses(daemons)
        first, thief = ProtoClient(address, 51), ProtoClient(address, 52)
        try:
            assert not first.described.takeover_allowed
            first.register(0)
            first.pull()  # done: the id is idle
            for previous in (0, 53):
                code, details = refused(lambda p=previous: thief.register(0, previous=p))
                assert code == C.FAILED_PRECONDITION and "--allow-takeover" in details
            assert daemons[0].store.stats().rejected["takeover"] == 2
            thief.register(0, previous=51)  # a restart that presents its predecessor
            code, details = refused(first.pull)
            assert code == C.FAILED_PRECONDITION and "registered by another process" in details
            thief.stub.Deregister(pb.DeregisterRequest(worker_id=0, registration=52), timeout=20)
            first.register(0)  # an id its holder deregistered is free
        finally:
            first.close()
            thief.close()
    with serve(allow_takeover=True) as daemons:
        clients = [ProtoClient(addresses(daemons), r) for r in (61, 62)]
        try:
            assert clients[0].described.takeover_allowed
            for c in clients:
                c.register(0)  # the operator allows it: any idle id to anyone
        finally:
            for c in clients:
                c.close()


def test_a_later_operation_on_a_session_is_identified_first_too():
    """A session's worker deregisters (on a call of its own) after the session's first pull:
    the session's next pull, of a wrong shard as well, is refused as deregistered."""
    import queue

    with serve() as daemons:
        s = ProtoClient(addresses(daemons), 71)
        try:
            s.register(0)
            requests: queue.Queue = queue.Queue()
            replies = s.stub.Session(iter(requests.get, None), timeout=20)
            requests.put(pb.SessionRequest(pull=pb.PullRequest(worker_id=0, shard=0,
                                                               registration=71)))
            read_tensor(replies, s.dtype)
            s.stub.Deregister(pb.DeregisterRequest(worker_id=0, registration=71), timeout=20)
            requests.put(pb.SessionRequest(pull=pb.PullRequest(worker_id=0, shard=3,
                                                               registration=71)))
            code, details = refused(lambda: next(replies))
            requests.put(None)
            assert code == C.FAILED_PRECONDITION and "(Deregister)" in details, details
        finally:
            s.close()
